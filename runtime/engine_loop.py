"""One thread that drives an :class:`~pagedpack.runtime.engine.LLMEngine` for every caller.

Callers in any thread add requests and abort them; the loop thread takes them in between steps
and runs steps while any request is live, handing each request's deltas to its ``sink`` (a
callable, called in the loop thread). The thread exists only while there is work: it ends when
the last request finishes and starts again with the next one, so an idle engine holds no thread.
``LLM.generate`` (a blocking client) and ``AsyncLLM`` (an asyncio one) both run on it, so
requests from several threads or coroutines share steps (continuous batching across callers).

A step that raises fails every live request: each sink gets the exception instead of a delta,
their blocks are freed, and the loop goes on with the requests added later.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from typing import Callable

from pagedpack.runtime.engine import LLMEngine
from pagedpack.runtime.outputs import RequestOutput
from pagedpack.runtime.sampling import SamplingParams

Sink = Callable[[RequestOutput | BaseException], None]


class EngineLoop:
    """``add_request(request_id, prompt, params, sink)`` / ``abort_request(request_id)`` from any thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._adds: deque = deque()
        self._aborts: deque[str] = deque()
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None

    @property
    def num_live(self) -> int:
        """Requests added and not yet finished (or aborted)."""
        return len(self._sinks)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None, sink: Sink, *,
                    made=None) -> None:
        """Tokenize and check ``prompt`` here (``ValueError`` for one that can never run, or an id that
        is live; ``made``: what ``engine.make_request`` already returned for it), then queue it for
        the loop's next step."""
        made = made if made is not None else self.engine.make_request(request_id, prompt, params)
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request_id: {request_id!r} is already running; expected a new id")
            self._sinks[request_id] = sink
            self._adds.append((request_id, made))
            self._wake()

    def stream(self, made: dict) -> Iterator[RequestOutput]:
        """Add the requests ``made`` (request id -> what ``engine.make_request`` returned) and yield
        their deltas in arrival order until each has finished, in the calling thread; the step's
        exception is raised here. Closing the iterator early (or an exception) aborts the rest."""
        arrived = queue.SimpleQueue()
        for request_id, request in made.items():
            self.add_request(request_id, None, None, arrived.put, made=request)
        live = set(made)
        try:
            while live:
                delta = arrived.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.finished:
                    live.discard(delta.request_id)
                yield delta
        finally:
            for request_id in live:  # closed early, interrupted, or the step failed
                self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        """Abort ``request_id`` before the loop's next step (its sink gets the final ``"abort"`` delta);
        nothing for a request that is not live."""
        with self._lock:
            if request_id in self._sinks:
                self._aborts.append(request_id)
                self._wake()

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedpack-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                adds, aborts = list(self._adds), list(self._aborts)
                self._adds.clear()
                self._aborts.clear()
                if not adds and not aborts and not engine.has_unfinished():
                    self._thread = None
                    return
            for request_id, made in adds:
                try:
                    engine.add_request(request_id, None, made=made)
                except ValueError as err:
                    self._deliver(request_id, err, final=True)
            for request_id in aborts:
                out = engine.abort_request(request_id)
                if out is not None:
                    self._deliver(request_id, out, final=True)
            try:
                outputs = engine.step()
            except Exception as err:  # noqa: BLE001 -- the step's own error goes to every caller it stopped
                self._fail_all(err)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, final=out.finished)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            live = list(self._sinks)
        for request_id in live:
            self.engine.abort_request(request_id)
            self._deliver(request_id, err, final=True)
        self.engine.scheduler.abort_all()

    def _deliver(self, request_id: str, out, *, final: bool) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None) if final else self._sinks.get(request_id)
        if sink is not None:
            sink(out)
