"""Driving one :class:`~pagedpack.runtime.engine.LLMEngine` for every caller.

Callers in any thread add requests and abort them; between steps the driver takes them in, and
it runs steps while any request is live, handing each request's deltas to its ``sink`` (a
callable). Who drives: a blocking caller (:meth:`EngineLoop.stream`, ``LLM.generate``) steps the
engine itself in its own thread, one step at a time under the driver lock, while it waits for
its requests, so requests from several threads share steps (continuous batching across callers)
and the steps run where the model was built. An asyncio caller (``AsyncLLM``) cannot block its
event loop: its requests wake a background thread that steps while work remains and then ends.

Why the caller's thread: PyTorch's CPU kernels run on OpenMP, and libgomp keeps one pool of worker
threads per thread that starts parallel regions; once a second thread has a pool, the process has
more OpenMP threads than cores and libgomp stops spinning between regions (its throttled wait),
which made each small op ~20x and the W1 workload ~1.4x slower when every step ran in a thread of
its own (measured, 2 cores). A server (``pagedpack serve``) has its main thread, which built the
model, drive for good (:meth:`EngineLoop.serve_forever`) while the HTTP front runs in another.

A step fails only its own requests (:meth:`LLMEngine.step`: they end with ``finish_reason="error"``).
What escapes a step (a bug outside the model call and the per-request work) fails every live request:
each sink gets the exception instead of a delta, their blocks are freed, and stepping goes on with
the requests added later, unless it was :class:`EngineDeadError` (a tensor-parallel rank is gone):
then no request runs again. Backpressure: :mod:`pagedpack.runtime.flow_control`.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from typing import Callable

from pagedpack.runtime.engine import EngineDeadError, LLMEngine
from pagedpack.runtime.flow_control import FlowControl, OutputFlows
from pagedpack.runtime.memory import trim_heap
from pagedpack.runtime.outputs import RequestOutput
from pagedpack.runtime.sampling import SamplingParams

Sink = Callable[[RequestOutput | BaseException], None]
_TAKE_OVER_S = 0.02  # a waiting caller steps itself when no delta came for this long (its driver left)


class EngineLoop:
    """``add_request(request_id, prompt, params, sink)`` / ``abort_request(request_id)`` from any
    thread; a reader reports each delta it takes with :meth:`taken` (backpressure, ``flow_control``:
    :mod:`pagedpack.runtime.flow_control`)."""

    def __init__(self, engine: LLMEngine, flow_control: FlowControl = FlowControl()):
        self.engine = engine
        self._lock = threading.Lock()  # guards the queues, the sinks, the flows and the thread
        self._drive = threading.Lock()  # held for one step by whoever drives
        self._adds: deque = deque()
        self._aborts: deque[str] = deque()
        self._resumes: deque[str] = deque()
        self._flows = OutputFlows(flow_control)
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self._wakeup: threading.Event | None = None  # set while serve_forever drives
        self._kick = threading.Event()  # wakes the background thread (_run) waiting for a stalled request
        self.error: BaseException | None = None  # why serve_forever's driving ended, if it failed

    def add_request(self, request_id: str, prompt, params: SamplingParams | None, sink: Sink, *,
                    made=None, background: bool = True) -> None:
        """Tokenize and check ``prompt`` here (``ValueError`` for one that can never run, or an id that
        is live; ``made``: what ``engine.make_request`` already returned for it), then queue it for
        the next step; ``background``: a thread of the loop's steps it (the caller will not)."""
        made = made if made is not None else self.engine.make_request(request_id, prompt, params)
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine loop has died ({type(self.error).__name__}: {self.error})")
            if request_id in self._sinks:
                raise ValueError(f"request_id: {request_id!r} is already running; expected a new id")
            self._sinks[request_id] = sink
            self._adds.append((request_id, made))
            if background:
                self._wake()

    def abort_request(self, request_id: str) -> None:
        """Abort ``request_id`` before the next step (its sink gets the final ``"abort"`` delta);
        nothing for a request that is not live."""
        with self._lock:
            if request_id in self._sinks:
                self._aborts.append(request_id)
                self._wake()

    def taken(self, request_id: str, delta: RequestOutput, *, wake: bool = True) -> None:
        """The reader of ``request_id`` took ``delta`` from its sink's queue: a request paused for
        its unread output is resumed once enough is taken (``wake``: a thread of the loop's steps it)."""
        with self._lock:
            if self._flows.taken(request_id, delta.num_tokens):
                self._resumes.append(request_id)
                if wake:
                    self._wake()

    @property
    def flow_control(self) -> FlowControl:
        return self._flows.control

    @flow_control.setter
    def flow_control(self, control: FlowControl) -> None:
        with self._lock:
            self._flows.control = control

    @property
    def num_paused(self) -> int:
        """Requests paused because their readers take no output."""
        return self._flows.num_paused

    def stream(self, made: dict) -> Iterator[RequestOutput]:
        """Add the requests ``made`` (request id -> what ``engine.make_request`` returned) and yield
        their deltas in arrival order until each has finished, stepping the engine in this thread
        (unless another caller is); the step's exception is raised here. Closing the iterator early
        (or an exception) aborts the rest."""
        arrived = queue.SimpleQueue()
        for request_id, request in made.items():
            self.add_request(request_id, None, None, arrived.put, made=request, background=False)
        live = set(made)
        try:
            while live:
                try:
                    delta = arrived.get(block=False)
                except queue.Empty:
                    if self._step(blocking=False):
                        continue
                    try:  # another caller drives: wait for a delta, or take over when it stops
                        delta = arrived.get(timeout=_TAKE_OVER_S)
                    except queue.Empty:
                        continue
                if isinstance(delta, BaseException):
                    raise delta
                if delta.finished:
                    live.discard(delta.request_id)
                else:
                    self.taken(delta.request_id, delta, wake=False)
                yield delta
        finally:
            if live:  # closed early, interrupted, or the step failed: abort now, freeing the blocks
                with self._drive:
                    with self._lock:
                        self._adds = deque(a for a in self._adds if a[0] not in live)
                        for request_id in live:
                            self._sinks.pop(request_id, None)
                            self._flows.ended(request_id)
                    for request_id in live:
                        self.engine.abort_request(request_id)

    def abort_all(self) -> None:
        """Abort every live request before the next step (a server stopping)."""
        with self._lock:
            live = list(self._sinks)
        for request_id in live:
            self.abort_request(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the next step, or waiting in the scheduler."""
        return len(self._adds) + len(self.engine.scheduler.waiting)

    def serve_forever(self, stop: threading.Event, *, poll_s: float = 0.5) -> None:
        """Drive the engine in this thread until ``stop`` is set: steps while any request is live,
        otherwise sleeps until one is added (or ``poll_s`` passes, to look at ``stop``); going idle,
        it gives the heap's free pages back to the OS (:func:`~pagedpack.runtime.memory.trim_heap`:
        glibc keeps what a busy spell's steps freed, so an idle server's RSS drifted with the load
        it last had) and checks that the engine can still step (:meth:`LLMEngine.check_health`). If driving
        fails outside a step (a step's own error fails only its requests), every live request gets
        the error, :attr:`error` is set, later adds raise :class:`EngineDeadError`, and it re-raises."""
        self._wakeup = threading.Event()
        busy = False
        try:
            while not stop.is_set():
                self._wakeup.clear()
                if self._step(blocking=True):
                    busy = True
                    continue
                if busy:  # going idle: hand the heap pages the busy spell freed back to the OS
                    trim_heap()
                    busy = False
                self.engine.check_health()  # idle too: a server's /health turns 503 once it cannot step
                self._wakeup.wait(poll_s)
        except BaseException as err:
            with self._lock:
                self.error = err
                sinks, self._sinks = self._sinks, {}
            for sink in sinks.values():
                sink(EngineDeadError(f"the engine loop has died ({type(err).__name__}: {err})"))
            raise
        finally:
            self._wakeup = None

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedpack-engine", daemon=True)
            self._thread.start()
        else:
            self._kick.set()

    def _run(self) -> None:
        """The background driver: steps while there is work; with only paused requests left it waits
        to abort the first that stalls (woken earlier by new work), and ends when nothing is left."""
        while True:
            with self._lock:
                self._kick.clear()
                stall_in = None
                if not (self._adds or self._aborts or self._resumes or self.engine.has_unfinished()):
                    stall_in = self._flows.until_stalled()
                    if stall_in is None:
                        self._thread = None
                        return
            if stall_in is not None:
                self._kick.wait(stall_in)
            self._step(blocking=True)

    def _step(self, *, blocking: bool) -> bool:
        """Take the adds and aborts in and run one step, as the driver; False if another thread
        drives now (``blocking=False``) or there was nothing to do."""
        if not self._drive.acquire(blocking=blocking):
            return False
        try:
            with self._lock:
                adds, aborts, resumes = list(self._adds), list(self._aborts), list(self._resumes)
                aborts += self._flows.stalled()
                self._adds.clear()
                self._aborts.clear()
                self._resumes.clear()
            engine = self.engine
            for request_id in resumes:
                engine.resume_request(request_id)
            for request_id, made in adds:
                try:
                    engine.add_request(request_id, None, made=made)
                except ValueError as err:
                    self._deliver(request_id, err, final=True)
            for request_id in aborts:
                out = engine.abort_request(request_id)
                if out is not None:
                    self._deliver(request_id, out, final=True)
            if not engine.has_unfinished():
                return bool(adds or aborts or resumes)
            try:
                outputs = engine.step()
            except Exception as err:  # noqa: BLE001 -- the step's own error goes to every caller it stopped
                if isinstance(err, EngineDeadError):
                    with self._lock:
                        self.error = err
                self._fail_all(err)
                return True
            for out in outputs:
                self._deliver(out.request_id, out, final=out.finished)
            return True
        finally:
            self._drive.release()

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            live = list(self._sinks)
        for request_id in live:
            self.engine.abort_request(request_id)
            self._deliver(request_id, err, final=True)
        self.engine.scheduler.abort_all()

    def _deliver(self, request_id: str, out, *, final: bool) -> None:
        """Hand ``out`` to the request's sink (as the driver); pause the request if its reader lags."""
        pause = False
        with self._lock:
            sink = self._sinks.pop(request_id, None) if final else self._sinks.get(request_id)
            if final:
                self._flows.ended(request_id)
            elif sink is not None:
                pause = self._flows.delivered(request_id, out.num_tokens)
        if pause:
            self.engine.pause_request(request_id)
        if sink is not None:
            sink(out)
