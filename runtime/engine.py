"""The engine: requests in at any time, one step at a time, per-request deltas out.

Each :meth:`LLMEngine.step` schedules a step, builds its metadata, runs the program, samples,
updates the requests and returns what each request gained (vLLM's ``LLMEngine.step`` /
``EngineCoreOutputs``). Requests join and leave between steps: :meth:`~LLMEngine.add_request`
queues one for the next step's admission (chunked prefill keeps a long prompt from holding the
others' decode back), :meth:`~LLMEngine.abort_request` finishes one and frees its blocks at once.
The engine is not thread-safe: one thread drives it (:mod:`pagedpack.runtime.engine_loop`);
:meth:`~LLMEngine.make_request` (tokenizing and checking a prompt) may run in any thread.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedpack.inputs import check_token_ids, normalize_prompt
from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.cpu_threads import CpuThreads
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.kv_connector.driver import KVConnectorDriver, make_connectors
from pagedpack.runtime.kv_event_publisher import KVEventsConfig, NullEventPublisher, make_publisher
from pagedpack.runtime.kv_events import KVEventBatch
from pagedpack.runtime.lora import LoRAConfig, LoRAManager, LoRARequest
from pagedpack.runtime.model_runner import ModelRunner
from pagedpack.runtime.output_processor import OutputProcessor
from pagedpack.runtime.outputs import CompletionOutput, RequestOutput
from pagedpack.runtime.prompt_logprobs import prompt_rows, take_prompt_logprobs
from pagedpack.runtime.request import Request, RequestStatus, make_request
from pagedpack.runtime.sampling import Sampler, SamplerOutput, SamplingParams
from pagedpack.runtime.scheduler import KVConnectorOutput, Scheduler, SchedulerOutput
from pagedpack.runtime.spec_decode.config import SpeculativeConfig
from pagedpack.runtime.spec_decode.draft_model import DraftModel, check_draft
from pagedpack.runtime.spec_decode.proposer import Proposer
from pagedpack.runtime.spec_decode.verify import StepSample, sample_positions, spec_rows
from pagedpack.step.contract import ModelDescription, bytes_per_token
from pagedpack.step.metadata import state_metadata

if TYPE_CHECKING:
    from pagedpack.runtime.grammar_bitmask import StepBitmask

log = logging.getLogger("pagedpack.engine")


class EngineDeadError(RuntimeError):
    """The engine cannot step again (a tensor-parallel rank is gone, or the thread driving it for good
    has died): no request runs again."""


@dataclass
class EngineStats:
    """Counters over the engine's life (what ``pagedpack generate`` summarises)."""

    num_steps: int = 0
    num_batched_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # tokens at positions < the prompt length (recomputes too)
    num_preemptions: int = 0
    # The first MAX_COMPOSITIONS distinct batch compositions seen (each step's tuple of per-sequence
    # query lengths): bounded, so that a long-running server's memory does not grow with them.
    compositions: set = field(default_factory=set)


# A step that schedules nothing because every live request waits on the KV connector (a pull, a
# delayed free) sleeps this long before the loop asks again: a pull takes milliseconds, and a loop
# spinning on it keeps a core busy that other processes' computation could use.
CONNECTOR_POLL_S = 0.001

MAX_COMPOSITIONS = 1024


@dataclass(frozen=True)
class Stats:
    """A snapshot of the engine's counters (``LLM.get_stats()``, the CLI summary).

    Steps and tokens: ``num_steps``; ``num_batched_tokens`` (tokens computed, all steps);
    ``num_prompt_tokens_computed`` (of those, prompt tokens, recomputed ones included);
    ``num_preemptions``. Prefix cache, in tokens of admitted requests as vLLM counts them:
    ``prefix_cache_queries``, ``prefix_cache_hits``, ``prefix_cache_hit_rate`` (0 with no
    query); ``num_evictions`` (cached blocks handed out for other contents). KV blocks now:
    ``kv_blocks_used`` (owned by requests) + ``kv_blocks_cached_free`` (owned by nobody, cached:
    reusable by a hit) + ``kv_blocks_free`` (neither) == ``kv_blocks_total``; ``kv_blocks_cached``
    (owned or not); ``kv_blocks_peak_used``. KV memory: ``kv_cache_dtype`` (the caches' dtype name),
    ``kv_cache_bytes_per_block`` (K and V of one block over all layers, in that dtype; both with a draft model's);
    ``kv_cache_bytes_used`` = ``kv_blocks_used`` x that. ``prefix_caching``: whether the prefix cache
    is on (off for a model with recurrent layers: their state is not cached with a prefix's blocks);
    ``state_slots_total`` / ``state_slots_used``: the recurrent-state slots (0 without such layers).
    With a KV connector (vLLM's ``external_prefix_cache_*``): ``external_prefix_cache_queries`` (tokens of
    requests admitted) and ``external_prefix_cache_hits`` (of those, tokens the connector loaded).
    With speculative decoding (vLLM's ``spec_decode_*``, :mod:`pagedpack.runtime.spec_decode.stats`):
    ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
    ``spec_decode_num_accepted_tokens_per_pos`` (a tuple, one count per draft position).
    """

    num_steps: int
    num_batched_tokens: int
    num_prompt_tokens_computed: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_evictions: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_cached_free: int
    kv_blocks_free: int
    kv_blocks_peak_used: int
    kv_cache_dtype: str
    kv_cache_bytes_per_block: int
    kv_cache_bytes_used: int
    prefix_caching: bool
    state_slots_total: int
    state_slots_used: int
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


class RequestRejected(ValueError):
    """A prompt that can never run (``LLMEngine.make_request``): the message names the request and
    the limit; ``prompt_token_ids`` are its tokens."""

    def __init__(self, message: str, prompt_token_ids: list[int]):
        super().__init__(message)
        self.prompt_token_ids = prompt_token_ids

    def output(self, request_id: str, prompt: str | None) -> RequestOutput:
        """The request's output: ``error`` set, one empty completion finished with ``"error"``."""
        return RequestOutput(request_id, prompt, self.prompt_token_ids, [CompletionOutput(0, "", [], "error")],
                             error=str(self))


def _bans_every_token(request: Request, vocab: int) -> bool:
    """``min_tokens`` bans ``request``'s stop tokens and EOS; do they cover ``range(vocab)``?"""
    params = request.sampling_params
    banned = set(params.stop_token_ids)
    if not params.ignore_eos and request.eos_token_id is not None:
        banned.add(request.eos_token_id)
    return len(banned) >= vocab and banned.issuperset(range(vocab))


class LLMEngine:
    """Drives requests to completion with continuous batching over one step program.

    ``description``: the model's eos ids, vocabulary and tokenizer (prompts as text, text deltas,
    stop strings need the tokenizer; without one, token ids only). ``kv_event_publisher``: where
    each step's KV cache events go, one batch per step that has some
    (:mod:`pagedpack.runtime.kv_event_publisher`; shut down by :meth:`close`, or when the engine is
    collected or the process exits)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler | None = None, *,
                 description: ModelDescription | None = None, kv_event_publisher=None, kv_connector=None,
                 lora_manager: LoRAManager | None = None, speculative_config: SpeculativeConfig | None = None,
                 draft_model: DraftModel | None = None):
        self.runner, self.scheduler, self.lora = runner, scheduler, lora_manager
        self.proposer = Proposer(speculative_config, draft_model) if speculative_config is not None else None
        # a KV connector's WORKER half (the scheduler holds its SCHEDULER half), driven around each step
        self.kv_connector = KVConnectorDriver(kv_connector, runner) if kv_connector is not None else None
        self.kv_event_publisher = kv_event_publisher or NullEventPublisher()
        self._close_publisher = weakref.finalize(self, self.kv_event_publisher.shutdown)
        self.sampler = sampler or Sampler()
        self.description = description or ModelDescription()
        self.stats = EngineStats()
        self.step_observers: list = []  # called with the engine after every step that ran
        self.tokenizer_lock = threading.Lock()  # encoding (any thread) and decoding (the stepping one)
        self.output_processor = OutputProcessor(self.description.tokenizer, self.tokenizer_lock)
        self._structured_outputs = None  # a StructuredOutputManager, made by the first request asking for one
        self._structured_outputs_lock = threading.Lock()

    @classmethod
    def build(cls, program, description: ModelDescription, *, num_blocks: int, block_size: int, device,
              enable_prefix_caching: bool, max_num_batched_tokens: int, max_num_seqs: int,
              max_model_len: int, cpu_threads: CpuThreads | None = None, workers=None,
              kv_events_config: KVEventsConfig | None = None, kv_event_publisher=None,
              kv_transfer_config=None, model_stamp=None, lora_config: LoRAConfig | None = None,
              speculative_config: SpeculativeConfig | None = None, draft=None) -> "LLMEngine":
        """The engine of ``program`` (a :class:`~pagedpack.step.contract.StepProgram`) over a pool of
        ``num_blocks`` KV blocks of ``block_size`` tokens on ``device``, with those scheduler limits
        and, on the CPU, that thread policy; ``workers``: the other tensor-parallel ranks, if any;
        ``kv_events_config``: vLLM's KV events configuration (None: no events); ``kv_event_publisher``:
        its publisher if made already (``LLM`` binds its sockets before the build), else made here;
        ``kv_transfer_config``: a :class:`~pagedpack.runtime.kv_connector.factory.KVTransferConfig` (None: no
        KV connector); ``model_stamp``: what tells the model's checkpoint apart, for a connector
        keeping blocks across processes (None: unknown); ``lora_config``: the adapter slots of a program
        rewritten with ``enable_lora`` (:mod:`pagedpack.runtime.lora`; None: one slot of rank 1, unused);
        ``speculative_config``: propose and verify draft tokens (:mod:`pagedpack.runtime.spec_decode`; None:
        no speculation); ``draft``: its draft model (method ``draft_model``; its ``program`` and ``description``:
        :class:`pagedpack.compiler.program.Draft`);
        ``ValueError`` naming it for a model with recurrent layers (their state cannot step back from a
        rejected draft yet) or with a KV connector, or naming ``speculative_config.model`` for a draft
        whose token ids are not the target's."""
        # a state slot per running request (max_num_seqs of them); prefix caching off (KVCacheManager)
        num_state_slots = max_num_seqs if getattr(program, "state_specs", None) else 0
        if speculative_config is not None and (num_state_slots or kv_transfer_config is not None):
            raise ValueError("speculative_config: " + (
                "a model with recurrent layers cannot take speculation yet (their state would have to step back "
                "past rejected draft tokens)" if num_state_slots else
                "a KV connector (kv_transfer_config) and speculation do not run together yet") +
                "; expected speculative_config=None")
        if enable_prefix_caching and num_state_slots:
            log.warning("prefix caching is off for this model: a cached prefix's blocks would not hold its recurrent "
                        "layers' state (enable_prefix_caching=False says so and silences this)")
        lora = lora_config or LoRAConfig(1, 1, 1)
        lora.check_slot_memory(getattr(program, "lora_specs", ()))
        runner = ModelRunner(program, num_blocks=num_blocks, block_size=block_size, device=device,
                             cpu_threads=cpu_threads, workers=workers, num_state_slots=num_state_slots,
                             lora_slots=(lora.max_loras, lora.max_lora_rank))
        lora_manager = LoRAManager(runner.lora_specs, runner.lora_weights, max_loras=lora.max_loras,
                                   max_lora_rank=lora.max_lora_rank,
                                   max_cpu_loras=lora.max_cpu_loras) if runner.lora_specs and lora_config else None
        events = kv_events_config is not None and kv_events_config.enable_kv_cache_events
        kv_cache_manager = KVCacheManager(num_blocks, block_size, num_state_slots=num_state_slots,
                                          enable_prefix_caching=enable_prefix_caching and not num_state_slots,
                                          enable_kv_cache_events=events)
        scheduler_connector, worker_connector = make_connectors(kv_transfer_config, runner, kv_cache_manager,
                                                                workers=workers, num_state_slots=num_state_slots,
                                                                model_stamp=model_stamp)
        scheduler = Scheduler(kv_cache_manager, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, max_model_len=max_model_len, connector=scheduler_connector,
                              max_loras=lora.max_loras if lora_manager else 0)
        draft_model = None
        if draft is not None:
            check_draft(description, draft.description)
            draft_model = DraftModel(draft.program, num_blocks=num_blocks, block_size=block_size,
                                     max_num_seqs=max_num_seqs, device=device, cpu_threads=cpu_threads,
                                     scratch_per_seq=speculative_config.scratch_blocks_per_seq(block_size),
                                     max_positions=draft.description.max_model_len)
        publisher = kv_event_publisher or make_publisher(kv_events_config)
        return cls(runner, scheduler, description=description, kv_event_publisher=publisher,
                   kv_connector=worker_connector, lora_manager=lora_manager, speculative_config=speculative_config,
                   draft_model=draft_model)

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     lora_request: LoRARequest | None = None) -> tuple[Request, str | None]:
        """``(request, prompt text)`` for ``prompt`` (text, token ids or a dict as
        :func:`pagedpack.inputs.normalize_prompts` takes): tokenized and checked against the
        vocabulary and the scheduler's limits, its LoRA adapter (if any) loaded; thread-safe.
        :class:`RequestRejected` for a prompt that can never run, ``ValueError`` for a malformed one
        or an adapter that cannot be served."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected a SamplingParams, got {params!r:.80}")
        prompt = normalize_prompt(prompt)
        tokenizer = self.description.tokenizer
        if params.stop and tokenizer is None:  # matched in the text, which only a tokenizer makes
            raise ValueError(f"stop: stop strings need a tokenizer and the model ({self._model_name}) has none, got "
                             f"{params.stop!r:.120}; use stop_token_ids, or pass a tokenizer with "
                             "LLM(..., tokenizer=...) / --tokenizer")
        if isinstance(prompt.content, str):
            if tokenizer is None:
                raise ValueError(f"prompts: got a string but the model ({self._model_name}) has no tokenizer (no "
                                 "tokenizer files); pass token ids, or a tokenizer with LLM(..., tokenizer=...) / "
                                 "--tokenizer")
            with self.tokenizer_lock:
                token_ids = tokenizer(prompt.content).input_ids
        else:
            token_ids = prompt.content
        adapter = self._lora_manager(lora_request).adapter(lora_request) if lora_request is not None else None
        request = make_request(request_id, token_ids, params, eos_token_ids=self.description.eos_token_ids,
                               cache_salt=prompt.cache_salt, lora_request=lora_request)
        if adapter is not None:
            for completion in [request, *request.forks]:
                completion.set_lora_adapter(adapter)
        if params.structured_outputs is not None:
            matchers = self.structured_outputs.matchers(params.structured_outputs, params.n)
            for completion, matcher in zip([request, *request.forks], matchers):
                completion.grammar = matcher
        vocab = self.description.vocab_size
        if vocab is not None and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: expected token ids in [0, vocab_size={vocab}), got "
                             f"{sorted(t for t in params.logit_bias if t >= vocab)[:5]}")
        if vocab is not None and request.sampling_params.min_tokens and _bans_every_token(request, vocab):
            raise ValueError(f"min_tokens: no token could be sampled before min_tokens={params.min_tokens}: "
                             f"stop_token_ids and EOS, banned until then, cover all {vocab} tokens of the vocabulary")
        for name in ("logprobs", "prompt_logprobs"):
            if vocab is not None and (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name}: expected at most vocab_size={vocab} tokens, got {getattr(params, name)}")
        why = getattr(self.runner.program, "one_logits_row_per_seq", None)
        if params.prompt_logprobs is not None and why:
            raise ValueError(f"prompt_logprobs: {why}")
        if (params.extra_args or {}).get("kv_transfer_params") is not None:
            if self.scheduler.connector is None:
                raise ValueError("kv_transfer_params: this engine has no KV connector (kv_transfer_config); expected "
                                 "none")
            self.scheduler.connector.check_kv_transfer_params(request)
        try:
            if vocab is not None:
                check_token_ids(request.prompt_token_ids, vocab)
            self.scheduler.check_request(request)
        except ValueError as err:
            message = f"request {request_id!r}: {err}" if str(err).startswith("prompt:") else str(err)
            raise RequestRejected(message, request.prompt_token_ids) from err
        return request, prompt.content if isinstance(prompt.content, str) else None

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load ``lora_request``'s adapter (vLLM's ``LLMEngine.add_lora``); True if loaded now, False if it
        was. ``ValueError`` naming ``lora_request`` for an engine without ``enable_lora`` or an adapter that
        cannot be served (the file and field)."""
        return self._lora_manager(lora_request).add_lora(lora_request)

    def _lora_manager(self, lora_request) -> LoRAManager:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(f"lora_request: this engine serves no LoRA adapters, got {lora_request.lora_name!r}; "
                             "build it with enable_lora=True (--enable-lora)")
        return self.lora

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload adapter ``lora_int_id``; False if it was not loaded (or the engine serves none)."""
        return self.lora is not None and self.lora.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded (vLLM's ``list_loras`` gives their ids; these are the requests)."""
        return [] if self.lora is None else self.lora.list_loras()

    @property
    def structured_outputs(self):
        """The :class:`~pagedpack.runtime.structured_output.StructuredOutputManager` of this model's
        tokenizer, made on first use (importing xgrammar takes seconds); ``ValueError`` naming
        ``structured_outputs`` for a model without a tokenizer or a known vocabulary size."""
        with self._structured_outputs_lock:
            if self._structured_outputs is None:
                tokenizer, vocab = self.description.tokenizer, self.description.vocab_size
                if tokenizer is None or vocab is None:
                    lacking = "tokenizer" if tokenizer is None else "vocab_size"
                    raise ValueError(f"structured_outputs: a grammar is made of the tokenizer's tokens and the model "
                                     f"({self._model_name}) has no {lacking}; pass a tokenizer with LLM(..., "
                                     "tokenizer=...) / --tokenizer, or leave structured_outputs out")
                from pagedpack.runtime.structured_output import StructuredOutputManager
                self._structured_outputs = StructuredOutputManager(tokenizer, vocab, self.description.eos_token_ids)
            return self._structured_outputs

    @property
    def _model_name(self) -> str:
        return self.description.model_name or "given as an instance"

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    made: tuple[Request, str | None] | None = None) -> None:
        """Queue ``prompt`` as ``request_id`` for the next step (``made``: what :meth:`make_request`
        returned for it, made in another thread). ``ValueError`` for an id already live, or a
        prompt that can never run."""
        if request_id in self.output_processor:
            raise ValueError(f"request_id: {request_id!r} is already running; expected a new id")
        request, text = made if made is not None else self.make_request(request_id, prompt, params)
        self.output_processor.add_request(request_id, request, text)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish ``request_id`` now (its completions end with ``finish_reason="abort"``) and free its
        KV blocks; returns its last delta, None if it is not live."""
        self.scheduler.finish_requests(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def pause_request(self, request_id: str) -> None:
        """Stop scheduling ``request_id``'s completions, freeing their KV blocks, until
        :meth:`resume_request` (its reader takes no output: :mod:`pagedpack.runtime.flow_control`)."""
        self.scheduler.pause_requests(self.output_processor.child_ids(request_id))

    def resume_request(self, request_id: str) -> None:
        """Schedule ``request_id``'s paused completions again (their K/V is recomputed)."""
        self.scheduler.resume_requests(self.output_processor.child_ids(request_id))

    def has_unfinished(self) -> bool:
        """Requests to schedule (paused ones are not)."""
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """``EngineDeadError`` if the engine cannot step again (a tensor-parallel worker has exited)."""
        if self.runner.workers is not None:
            self.runner.workers.check()

    def get_stats(self) -> Stats:
        kv = self.scheduler.kv_cache_manager
        pool, prefix = kv.pool, kv.prefix_cache_stats
        cached_free = pool.num_cached_free_blocks
        programs = [self.runner.program] + ([self._draft_model.runner.program] if self._draft_model else [])
        per_block = sum(bytes_per_token(p.kv_cache_specs) for p in programs) * self.runner.block_size  # both's KV
        dtypes = sorted({str(s.dtype).removeprefix("torch.") for p in programs for s in p.kv_cache_specs})
        return Stats(
            num_steps=self.stats.num_steps, num_batched_tokens=self.stats.num_batched_tokens,
            num_prompt_tokens_computed=self.stats.num_prompt_tokens_computed,
            num_preemptions=self.stats.num_preemptions, prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits, prefix_cache_hit_rate=prefix.hit_rate, num_evictions=pool.num_evictions,
            kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_blocks, kv_blocks_cached_free=cached_free,
            kv_blocks_free=pool.num_free_blocks - cached_free, kv_blocks_peak_used=pool.peak_used_blocks,
            kv_cache_dtype=", ".join(dtypes),
            kv_cache_bytes_per_block=per_block, kv_cache_bytes_used=per_block * pool.num_used_blocks,
            prefix_caching=kv.enable_prefix_caching, state_slots_total=kv.num_state_slots,
            state_slots_used=kv.num_state_slots - kv.num_free_state_slots,
            external_prefix_cache_queries=self.scheduler.connector_prefix_cache_stats.queries,
            external_prefix_cache_hits=self.scheduler.connector_prefix_cache_stats.hits,
            **self._spec_decode_stats())

    def _spec_decode_stats(self) -> dict:
        if self.proposer is None:
            return {}
        spec = self.proposer.stats
        return dict(spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
                    spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody holds (vLLM's ``reset_prefix_cache``) and publish the
        ``AllBlocksCleared``; returns False, changing nothing, while requests hold blocks. Call it
        from the thread that steps the engine, or while no step runs."""
        done = self.scheduler.kv_cache_manager.pool.reset_cache()
        self._publish_kv_events()
        return done

    def close(self) -> None:
        """Shut the KV event publisher and the KV connector down (later events go nowhere); idempotent."""
        self._close_publisher()
        self.kv_event_publisher = NullEventPublisher()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.scheduler.connector.shutdown()

    def _publish_kv_events(self) -> None:
        events = self.scheduler.kv_cache_manager.pool.take_events()
        if self.scheduler.connector is not None:
            events += self.scheduler.connector.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def step(self) -> list[RequestOutput]:
        """One scheduled step; returns a delta for every request that advanced or finished in it.
        The prefix cache's changes in it are published as one batch of KV events.

        A failure is its requests' alone: a row the sampler cannot draw from, or an exception while
        sampling or making one request's output, fails that request (``finish_reason="error"``, its
        ``error`` says why); an exception running the step (the model call) fails the requests it
        computed, and the others run on. :class:`EngineDeadError` is raised: nothing runs again."""
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if not output.scheduled:
            if self.kv_connector is not None:  # saves and asynchronous loads still finish (vLLM: no forward)
                self.kv_connector.before_step(output)
                self.kv_connector.after_step()
                self.scheduler.update_from_connector_output(output, self.kv_connector.finish_step(output))
                time.sleep(CONNECTOR_POLL_S)  # every request waits on the connector: poll it, don't spin a core
            return []
        connector_output, rolled_back = KVConnectorOutput(), set()
        try:
            if self.kv_connector is not None:
                self.kv_connector.before_step(output)
            if output.blocks_to_copy:
                self.runner.copy_blocks(output.blocks_to_copy)
                if self._draft_model is not None:
                    self._draft_model.copy_blocks(output.blocks_to_copy)
            if output.states_to_copy:
                self.runner.copy_states(output.states_to_copy)
            spans, prompt_logits_rows = prompt_rows(output.scheduled)
            draft_rows, verify_rows = spec_rows(output.scheduled, len(output.scheduled) + len(prompt_logits_rows))
            batch = build_batch(output.scheduled, block_size=self.runner.block_size,
                                num_blocks=self.runner.num_blocks, device=self.runner.device,
                                extra_logits_rows=prompt_logits_rows + verify_rows)
            state = state_metadata([s.request.state_slot for s in output.scheduled],
                                   [s.request.num_computed_tokens for s in output.scheduled],
                                   self.runner.device) if self.runner.state_specs else ()
            takers = [r for s in output.scheduled for r in s.sample_requests]
            # filled in a worker thread while the model runs; None (no thread) without a constrained request
            grammar = self._structured_outputs.bitmasks.start(takers) if self._structured_outputs else None
            lora_indices = None if self.lora is None else self.lora.token_indices(
                [s.request.lora_adapter for s in output.scheduled], [s.num_new_tokens for s in output.scheduled],
                self.runner.device)
            logits = self.runner.execute(batch, *state, lora_indices=lora_indices)
            if self._draft_model is not None:  # its cache holds every position the target's does
                self._draft_model.follow(batch)
            if self.kv_connector is not None:
                self.kv_connector.after_step()
                connector_output = self.kv_connector.finish_step(output)
                rolled_back = self.scheduler.update_from_connector_output(output, connector_output)
        except EngineDeadError:
            raise
        except Exception as err:  # noqa: BLE001 -- not one request's: the step's requests fail, the others run on
            return self._fail_step(output, err)
        if spans:  # the prompt rows follow the B last rows
            take_prompt_logprobs(logits[len(output.scheduled):len(output.scheduled) + len(prompt_logits_rows)], spans)
        rows, drafts, to_sample = [], [], []  # per request taking tokens: its rows (one per position), drafts
        for i, s in enumerate(output.scheduled):
            if s.request.request_id not in rolled_back:
                for request in s.sample_requests:
                    rows.append([*draft_rows.get(i, ()), i])
                    drafts.append(s.spec_token_ids if request is s.request else [])
                    to_sample.append(request)
        sample = StepSample()
        if to_sample:
            if grammar is not None and len(to_sample) < len(takers):  # rolled back: no token
                grammar = grammar.select([takers.index(r) for r in to_sample])
            sample = sample_positions(self._sample, logits, to_sample, rows, drafts, grammar, self._next_bitmask)
        if self.proposer is not None:
            for s in output.scheduled:
                if s.spec_token_ids and s.request.request_id in sample.token_ids:
                    self.proposer.observe(s, sample.token_ids[s.request.request_id])
        self._count(output)
        sampled, failed = sample.token_ids, sample.failed
        finished = self.scheduler.update_from_output(output, sampled, failed, rolled_back)
        outputs, stopped, broken = self.output_processor.process(
            [*to_sample, *(r for r in finished if r.request_id not in sampled and r.request_id not in failed)])
        if stopped:  # by a stop string in the text
            self.scheduler.finish_requests([r.request_id for r in stopped], RequestStatus.FINISHED_STOPPED)
        if broken:  # their output failed: already handed out as errors
            self.scheduler.finish_requests([r.request_id for r in broken], RequestStatus.FINISHED_ERROR)
        if self.proposer is not None:
            self.proposer.propose([s.request for s in output.scheduled], self.scheduler.live_request_ids)
            self.proposer.observe_step(output.scheduled, time.perf_counter() - started)
        for observe in self.step_observers:
            observe(self)
        return outputs

    @property
    def _draft_model(self) -> DraftModel | None:
        """The proposer's draft model (method ``draft_model``), None otherwise."""
        return self.proposer.draft_model if self.proposer is not None else None

    def _next_bitmask(self, requests: list[Request]) -> StepBitmask | None:
        """The grammar bitmask of a speculative step's later position (None: no request constrained)."""
        return self._structured_outputs.bitmasks.start(requests) if self._structured_outputs else None

    def _sample(self, logits, requests: list[Request], grammar: StepBitmask | None) -> SamplerOutput:
        """The sampler's output for ``requests`` (``grammar``: their rows' bitmask, None if none is
        constrained); if it raises, each row is sampled alone and a row that raises again fails its
        request only."""
        try:
            return self.sampler.sample(logits, requests, grammar)
        except Exception:  # noqa: BLE001 -- find the row it came from
            log.exception("sampling %d rows failed; sampling them one by one", len(requests))
        whole = SamplerOutput([0] * len(requests), [None] * len(requests))
        for i, request in enumerate(requests):
            try:
                alone = self.sampler.sample(logits[i:i + 1], [request], grammar and grammar.select([i]))
            except Exception as err:  # noqa: BLE001 -- this request's alone
                log.exception("sampling request %r failed", request.request_id)
                whole.errors[i] = f"sampling: request {request.request_id!r} failed ({type(err).__name__})"
                continue
            whole.token_ids[i], whole.logprobs[i] = alone.token_ids[0], alone.logprobs[0]
            if alone.errors:
                whole.errors[i] = alone.errors[0]
        return whole

    def _fail_step(self, output: SchedulerOutput, err: Exception) -> list[RequestOutput]:
        """The step of ``output`` raised before its logits: its requests (and their parallel samples
        not started) finish with ``"error"``, the blocks it named for the prefix cache are uncached
        (their K/V may be partly written) and the copies it held are released."""
        log.error("a step of %d requests failed; they finish with an error, the others run on",
                  len(output.scheduled), exc_info=err)
        requests = [s.request for s in output.scheduled]
        forks = [f for r in requests for f in r.forks]
        self.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ERROR)
        self.scheduler.kv_cache_manager.reset()
        why = f"the step computing this request failed ({type(err).__name__}; the engine's log has the traceback)"
        for request in [*requests, *forks]:
            request.fail(why)
        return self.output_processor.process([*requests, *forks])[0]

    def _count(self, output: SchedulerOutput) -> None:
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += output.num_batched_tokens
        self.stats.num_prompt_tokens_computed += sum(
            max(0, min(s.request.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens)
                - s.request.num_computed_tokens) for s in output.scheduled)
        self.stats.num_preemptions += len(output.preempted)
        if len(self.stats.compositions) < MAX_COMPOSITIONS:
            self.stats.compositions.add(tuple(s.num_new_tokens for s in output.scheduled))
