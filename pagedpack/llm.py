"""``LLM``: the offline generation API, in the style of vLLM's ``LLM``: a program built by
:class:`pagedpack.compiler.program.ProgramBuilder`, an engine over it, and ``generate``."""
from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from pagedpack.chat import conversations, render
from pagedpack.compiler.planner import MemoryPlan, plan_memory, pool_num_blocks
from pagedpack.compiler.program import ProgramBuilder, build_draft, max_model_len
from pagedpack.engine_args import EngineArgs
from pagedpack.host.devices import is_cpu
from pagedpack.inputs import normalize_prompts, parse_bytes
from pagedpack.runtime.cpu_threads import CpuThreads
from pagedpack.runtime.engine import LLMEngine, RequestRejected, Stats
from pagedpack.runtime.engine_loop import EngineLoop
from pagedpack.runtime.kv_event_publisher import publisher_for
from pagedpack.runtime.lora import LoRAConfig, normalize_lora_requests
from pagedpack.runtime.memory import release_memory
from pagedpack.runtime.outputs import merge
from pagedpack.runtime.sampling import SamplingParams, normalize_sampling_params
from pagedpack.runtime.tensor_parallel import TensorParallelRanks
from pagedpack.step.contract import state_bytes_per_seq


class LLM:
    """Capture a model, rewrite it to packed + paged attention, lower it for a target, and
    generate with it (or serve a file written by ``pagedpack export``).

    ``LLM(model, **kwargs)``: the arguments of :class:`pagedpack.engine_args.EngineArgs`, which documents them.

    Attributes: ``model`` (the ``transformers`` module, None when served from a file), ``rewritten`` (the
    :class:`~pagedpack.passes.pipeline.RewrittenModel`, None from a file), ``program`` (the
    :class:`~pagedpack.step.contract.StepProgram` the runner calls), ``description`` (eos ids, ``max_model_len``,
    vocabulary, tokenizer), ``bytes_per_token`` (KV bytes a token takes over all cache pairs, a draft model's too),
    ``report`` (the pass report, None from a file), ``ranks`` (this process's tensor-parallel rank and the other
    ranks' processes: :mod:`pagedpack.runtime.tensor_parallel`).

    Memory and the compile cache: :mod:`pagedpack.compiler.program` (a program of the target's own lets the
    source model go; ``model`` and ``rewritten`` are then loaded and captured again on first use).
    Raises: ValueError on bad arguments; :class:`pagedpack.step.contract.UnsupportedModelError` if the pass
    cannot rewrite every attention site (its report says why).
    """

    def __init__(self, model=None, **kwargs):
        args = EngineArgs(model=model, **kwargs)
        self.ranks = TensorParallelRanks(args)  # the runtime starts the other ranks, if any
        self.engine_args, self._builder = args, ProgramBuilder(args, rank=self.ranks.rank, join_group=self.ranks.join)
        events = args.kv_events_config if self.ranks.rank == 0 else None
        with publisher_for(events) as publisher:  # bound first: an endpoint in use fails before the model loads
            (self.program, description), self.target = self._builder.build(), self._builder.target
            release_memory(self._builder.weight_bytes(True))  # the float64 checks', a let-go model's, a .pt2's
            if args.tokenizer is not None:
                from pagedpack.models.loading import load_tokenizer

                description.tokenizer = load_tokenizer(args.tokenizer)
            self.description, self.tokenizer, self.block_size = description, description.tokenizer, args.block_size
            self.vocab_size, self.max_model_len = description.vocab_size, max_model_len(args, description)
            self._draft = build_draft(args)  # before the pool: its KV takes the pool's blocks too
            self.bytes_per_token = self._kv_bytes_per_token()
            self.num_blocks = pool_num_blocks(args, bytes_per_token=self.bytes_per_token,
                                              max_model_len=self.max_model_len, plan=self.plan_memory)
            self.llm_engine = LLMEngine.build(
                self.program, description, num_blocks=self.num_blocks, block_size=self.block_size, device=args.device,
                enable_prefix_caching=args.enable_prefix_caching, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                cpu_threads=CpuThreads(args.num_threads, args.reserved_cpus) if is_cpu(args.device) else None,
                workers=self.ranks.workers, kv_events_config=events, kv_event_publisher=publisher,
                kv_transfer_config=args.kv_transfer_config, model_stamp=self._builder.lowered.stamp,
                lora_config=LoRAConfig.of(args), speculative_config=args.speculative_config, draft=self._draft)
        self._loop = EngineLoop(self.llm_engine)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        return cls(**args.as_kwargs())

    @classmethod
    def from_exported(cls, path, **kwargs) -> "LLM":
        """An ``LLM`` serving a file written by ``pagedpack export`` (a ``.pt2`` archive, or an ONNX model in an
        onnxruntime CPU session): same scheduler and sampler, CPU only, no capture; ``block_size`` and the pool
        chosen here, ``tokenizer`` overriding the file's. ``ValueError`` for bad arguments or another file."""
        from pagedpack.formats.export import check_export_file

        return cls(check_export_file(path), **kwargs)

    @property
    def model(self):
        """The ``transformers`` module (None when served from a file); loaded again if let go."""
        return self._builder.model

    @property
    def rewritten(self):
        """The :class:`~pagedpack.passes.pipeline.RewrittenModel` (None from a file); captured again if let go."""
        return self._builder.rewritten

    @property
    def report(self):
        """The pass report (what ``pagedpack inspect`` prints); None when served from a file."""
        return self._builder.report

    def get_stats(self) -> Stats:
        """The engine's counters now, over the LLM's life (:class:`pagedpack.runtime.engine.Stats`: steps, tokens,
        preemptions, prefix-cache queries, hits, evictions, KV blocks); ``reset_prefix_cache`` keeps them."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody holds (vLLM's; KV events: ``AllBlocksCleared``); False while held."""
        return self.llm_engine.reset_prefix_cache()

    def _kv_bytes_per_token(self, kv_cache_dtype: str | None = None) -> int:
        return sum(built.kv_bytes_per_token(kv_cache_dtype) for built in (self._builder, self._draft) if built)

    def export(self, path, *, format: str | None = None, tensor_parallel_size=None, **options) -> str:
        """Write the rewritten step program to ``path`` as ``format`` (a registered export format: ``"pt2"``, ``"onnx"``
        ...; None: the one ``path``'s suffix names, else ``"pt2"``; ``options`` its own, e.g. ONNX's ``attention``), or
        split over ``tensor_parallel_size`` ranks (None: this LLM's) as a manifest and a ``.pt2`` per rank
        (:mod:`pagedpack.lowering.reference.tp`), with this LLM's description; returns ``str(path)``.
        ``ValueError`` for an LLM served from a file or lowered for a target other than the reference."""
        return self._builder.export(path, self.description, format=format, tensor_parallel_size=tensor_parallel_size,
                                    **options)

    def plan_memory(self, memory, *, keep_source_model: bool | None = None,
                    kv_cache_dtype: str | None = None) -> MemoryPlan:
        """The :class:`pagedpack.compiler.planner.MemoryPlan` of this model under a budget of ``memory``
        bytes (an int or a string such as ``"4GiB"``) with this LLM's block size, step limits and
        ``max_model_len``; weights counted as serving holds them: a program of the target's own
        (on the CPU, with the prepacked copies) alone, otherwise, or with ``keep_source_model``
        (None: as this LLM was built), with the model and the rewritten graph. ``kv_cache_dtype``
        (a name as ``EngineArgs.kv_cache_dtype``; None: this LLM's) sizes the KV cache in that dtype.
        ``ValueError`` for an LLM served from a file (no graph to plan from)."""
        peak, args = self._builder.activation_peak(), self.engine_args  # ValueError for a file
        keep = args.keep_source_model if keep_source_model is None else keep_source_model
        if not isinstance(keep, bool):
            raise ValueError(f"keep_source_model: expected a bool or None, got {keep_source_model!r}")
        return plan_memory(
            peak, bytes_per_token=self._kv_bytes_per_token(kv_cache_dtype), memory=parse_bytes("memory", memory),
            block_size=self.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
            weight_bytes=self._builder.weight_bytes(keep),
            state_bytes_per_seq=state_bytes_per_seq(self.program),
            draft_bytes=self._draft.fixed_bytes(kv_cache_dtype) if self._draft else 0)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, stream: bool = False, lora_request=None):
        """Generate for ``prompts`` (a string, a list of token ids, a dict ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}`` with an optional ``"cache_salt"``, or a list of those), all
        submitted together; returns one :class:`RequestOutput` per prompt, in order. ``stream=True``:
        an iterator of deltas instead (:mod:`pagedpack.runtime.outputs`: the new token ids and text of
        each request as they come, in arrival order; closing it aborts what is left). ``lora_request``:
        a :class:`~pagedpack.runtime.lora.LoRARequest` for every prompt, or a list of one (or None) per prompt.

        A request that can never run (ids outside the vocabulary, too long for ``max_model_len`` or
        the KV pool) or fails while running (``LLMEngine.step``) gets ``error`` set; the others
        finish normally. Malformed arguments raise ``ValueError`` before anything is queued.

        Thread-safe: calls from several threads share the engine's steps, each getting its own
        requests' outputs (:mod:`pagedpack.runtime.engine_loop`).
        """
        prompts = normalize_prompts(prompts)
        params = normalize_sampling_params(sampling_params, len(prompts))
        loras = normalize_lora_requests(lora_request, len(prompts))
        ids = [str(next(self._ids)) for _ in prompts]
        made, failed = {}, {}
        for request_id, prompt, p, lora in zip(ids, prompts, params, loras):  # all tokenized before any is queued
            try:
                made[request_id] = self.llm_engine.make_request(request_id, prompt, p, lora)
            except RequestRejected as err:  # the others run
                failed[request_id] = err.output(request_id, prompt.content if isinstance(prompt.content, str) else None)
        deltas = self._loop.stream(made)
        if stream:
            return itertools.chain(failed.values(), deltas)
        whole = dict(failed)
        with tqdm(total=sum(p.n for i, p in zip(ids, params) if i in made), desc="generate", unit="completion",
                  disable=not use_tqdm) as bar:
            for delta in deltas:
                whole[delta.request_id] = merge(whole.get(delta.request_id), delta)
                bar.update(sum(c.finished for c in delta.outputs))
        return [whole[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True, stream: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None, lora_request=None):
        """Generate replies to ``messages`` (one conversation, a list of ``{"role", "content"}`` dicts, or a list of
        conversations), each rendered by the tokenizer's chat template (or ``chat_template``; ``tools``: its tools)
        as vLLM's ``LLM.chat``; returns what :meth:`generate` (``lora_request`` as there) returns (a list for a list
        of conversations, each output's ``prompt`` the rendered text)."""
        convs, _ = conversations(messages)
        rendered = [render(self.tokenizer, c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                           tools=tools) for c in convs]
        outputs = self.generate([prompt for _, prompt in rendered], sampling_params, use_tqdm=use_tqdm, stream=stream,
                                lora_request=lora_request)
        if stream:
            return outputs
        for out, (text, _) in zip(outputs, rendered):
            out.prompt = text
        return outputs
