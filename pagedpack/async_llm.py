"""``AsyncLLM``: the asyncio front of the engine (vLLM's ``AsyncLLM``), for servers and notebooks.

::

    engine = AsyncLLM("smollm2-135m")
    async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=16), "req-1"):
        print(out.outputs[0].text)            # all the text so far (delta=True: what is new)

One engine loop thread (:mod:`pagedpack.runtime.engine_loop`) runs steps while any request is live
and batches every caller's requests together; awaiting a request never blocks the event loop.
Leaving the ``async for`` early (``break``, an exception, the task cancelled, a client gone)
aborts the request: its blocks are freed before the next step, its cached prefix blocks go back
to the prefix cache's LRU.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

from pagedpack.engine_args import EngineArgs
from pagedpack.llm import LLM
from pagedpack.runtime.lora import LoRARequest
from pagedpack.runtime.outputs import RequestOutput, merge
from pagedpack.runtime.sampling import SamplingParams


def check_online(args: EngineArgs) -> None:
    """``ValueError`` for ranks a launcher started (``external_launcher``): they stay in step only
    on the same requests at the same steps (``LLM.generate``), and an online engine's arrive at one."""
    if args.tensor_parallel_size > 1 and args.distributed_executor_backend == "external_launcher":
        raise ValueError("distributed_executor_backend: 'external_launcher' ranks each run the same offline requests "
                         "(LLM.generate); an online engine or server takes requests at one rank: use 'mp'")


class AsyncLLM:
    """``AsyncLLM(model, **kwargs)``: the arguments of :class:`pagedpack.LLM` (which builds the
    program and the engine); or :meth:`from_llm` to share an existing ``LLM``'s engine."""

    def __init__(self, model=None, **kwargs):
        args = EngineArgs(model=model, **kwargs)
        check_online(args)
        self.llm = LLM.from_engine_args(args)
        self._ids = itertools.count()

    @classmethod
    def from_llm(cls, llm: LLM) -> "AsyncLLM":
        check_online(llm.engine_args)
        engine = cls.__new__(cls)
        engine.llm, engine._ids = llm, itertools.count()
        return engine

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                    *, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Add one request now and return the stream of its deltas (what each step added, the last
        with ``finished`` set); call it in the event loop's thread. ``prompt`` as ``LLM.generate``
        takes one; ``request_id`` unique among live requests (default: a new one); ``lora_request``:
        the adapter it runs with (None: the base model; one not loaded is read here: load it first
        with ``llm.llm_engine.add_lora`` in another thread to keep file reads off the event loop). Raises here,
        before anything runs: ``ValueError`` for a bad prompt or parameter,
        :class:`~pagedpack.runtime.engine.RequestRejected` for one that can never run,
        :class:`~pagedpack.runtime.engine_loop.EngineDeadError` once a server's engine loop died.
        The stream raises the step's exception if the engine's step failed; leaving it early (or
        cancelling the task that reads it) aborts the request. A stream never read must be
        aborted by its id (:meth:`abort`)."""
        request_id = f"async-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: expected a non-empty str, got {request_id!r:.80}")
        loop, arrived = asyncio.get_running_loop(), asyncio.Queue()

        def sink(out):  # called in the engine loop's thread
            try:
                loop.call_soon_threadsafe(arrived.put_nowait, out)
            except RuntimeError:  # the event loop is closed: nobody waits for this request any more
                pass

        made = self.llm.llm_engine.make_request(request_id, prompt, sampling_params, lora_request)  # checked here
        self.llm._loop.add_request(request_id, None, None, sink, made=made)  # stepped elsewhere
        return self._deltas(request_id, arrived)

    async def _deltas(self, request_id: str, arrived: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await arrived.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                if not finished:
                    self.llm._loop.taken(request_id, out)
                yield out
        finally:
            if not finished:
                self.llm._loop.abort_request(request_id)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       *, delta: bool = False, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The outputs of one request as it runs (:meth:`add_request`, which raises what it says; with
        ``lora_request``'s adapter), the last with ``finished`` set: cumulative (all tokens and text so
        far, vLLM's default) or, with ``delta``, only what each step added."""
        whole = None
        async with contextlib.aclosing(self.add_request(prompt, sampling_params, request_id,
                                                        lora_request=lora_request)) as deltas:
            async for out in deltas:
                whole = out if delta else merge(whole, out)
                yield whole

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` (its generator then ends with an ``"abort"`` output)."""
        self.llm._loop.abort_request(request_id)

    def get_stats(self):
        return self.llm.get_stats()
