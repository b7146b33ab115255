"""``LLM``: the offline generation API, in the style of vLLM's ``LLM``.

The capture side (``transformers``' modeling code, capture, the rewrite passes) is imported where
it is used, so a process serving an exported file never imports it (its memory:
``docs/cpu-kernels.md``)."""
from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from pagedpack.contract import ModelDescription, StepProgram, bytes_per_token
from pagedpack.devices import is_cpu
from pagedpack.engine_args import EngineArgs
from pagedpack.inputs import (
    Prompt,
    check_token_ids,
    normalize_prompts,
    normalize_sampling_params,
    parse_bytes,
)
from pagedpack.lowering.cpu import cpu_step
from pagedpack.passes.graph_attrs import own_attrs
from pagedpack.planner import MemoryPlan, plan_memory, resident_weight_bytes
from pagedpack.runtime.engine import LLMEngine, Stats
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.memory import physical_memory, release_memory
from pagedpack.runtime.model_runner import ModelRunner
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.runtime.scheduler import Scheduler
from pagedpack.source import capture_source, load_source

_DEFAULT_KV_CACHE_MEMORY = 256 << 20  # bytes, when neither num_blocks nor kv_cache_memory is given


@dataclass
class CompletionOutput:
    """One completion: generated ``token_ids`` and their decoded ``text``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"


@dataclass
class RequestOutput:
    """The result of one prompt. ``error`` is set (and ``outputs[0]`` empty) if it failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return True


class LLM:
    """Capture a model, rewrite it to packed + paged attention, lower it for a target, and
    generate with it (or serve a file written by ``pagedpack export``).

    ``LLM(model, **kwargs)``: the arguments of :class:`pagedpack.engine_args.EngineArgs`, which
    documents them (``tokenizer``, ``target``, ``block_size``, ``num_blocks`` / ``kv_cache_memory``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, ``enable_prefix_caching``, ``dtype``,
    ``device``).

    Attributes: ``model`` (the ``transformers`` module, None when served from a file),
    ``rewritten`` (the :class:`~pagedpack.passes.pipeline.RewrittenModel`, None from a file),
    ``program`` (the :class:`~pagedpack.contract.StepProgram` the runner calls), ``description``
    (eos ids, ``max_model_len``, vocabulary, tokenizer), ``report`` (the pass report, None from a file).

    Memory: when the target lowers to a program of its own (the reference target on the CPU, a
    copy with prepacked weights; ``onnx``), that program takes copies of the tensors it shares
    with the model (it serves the weights as they were when built) and the LLM lets the rewritten
    model and a model it loaded itself go, so that serving holds each weight once, not three
    times (checkpoint, rewritten graph, program). ``model`` and ``rewritten`` are then loaded and
    captured again on first use and kept; ``export`` and ``plan_memory`` do so without keeping
    them. Loading again refuses a checkpoint directory whose files changed since (``ValueError``).
    ``keep_source_model=True`` keeps both instead.

    A local checkpoint served on the CPU by the reference target is captured in a child process
    whose ``.pt2`` export this LLM loads, kept for later LLMs of it (:mod:`pagedpack.compile_cache`;
    ``PAGEDPACK_COMPILE_CACHE=0``: in this process).
    Raises:
        ValueError on bad arguments; :class:`pagedpack.contract.UnsupportedModelError`
        if the pass cannot rewrite every attention site (its report says why).
    """

    def __init__(self, model=None, **kwargs):
        args = EngineArgs(model=model, **kwargs)
        self.engine_args, self.target = args, args.lowering_target.name
        self._model, self._rewritten, self._report, self._peak = None, None, None, None
        self._exported, self._stamp, self._weight_bytes = args.is_exported, None, {}
        if self._exported:
            self.program, description = self._load_exported(args, args.model, trust_file=args.trust_file)
        else:
            self.program, description = self._capture_and_lower(args)
        release_memory()  # what the rewrite's float64 checks, a let-go source model or a lowered .pt2 program held
        if args.tokenizer is not None:
            from pagedpack.models.loading import load_tokenizer

            description.tokenizer = load_tokenizer(args.tokenizer)
        self.description, self.tokenizer = description, description.tokenizer
        self.vocab_size = description.vocab_size
        limit = description.max_model_len
        if args.max_model_len is not None and limit is not None and args.max_model_len > limit:
            raise ValueError(f"max_model_len: expected 1 .. {limit} (the model's limit), got {args.max_model_len}")
        if (args.max_model_len or limit) is None:
            raise ValueError("max_model_len: the model records no limit; pass max_model_len")
        self.max_model_len = args.max_model_len or limit
        self.block_size = args.block_size
        self.num_blocks = self._num_blocks(args)
        self._check_pool_fits(args)
        runner = ModelRunner(self.program, num_blocks=self.num_blocks, block_size=self.block_size, device=args.device)
        kv_cache_manager = KVCacheManager(self.num_blocks, self.block_size,
                                          enable_prefix_caching=args.enable_prefix_caching)
        scheduler = Scheduler(kv_cache_manager,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len)
        self.llm_engine = LLMEngine(runner, scheduler)
        self._ids = itertools.count()
        self._generate_lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        return cls(**args.as_kwargs())

    @classmethod
    def from_exported(cls, path, **kwargs) -> "LLM":
        """An ``LLM`` serving a file written by ``pagedpack export``: a ``.pt2`` archive or an ONNX
        model run by an onnxruntime CPU session; same scheduler and sampler, CPU only, no capture.
        ``block_size`` and the pool size are chosen here, not at export; ``tokenizer`` overrides
        the one stored in the file. Raises ``ValueError`` for bad arguments or a file that is not
        such an export."""
        from pagedpack.export import check_export_file

        return cls(check_export_file(path), **kwargs)

    def _load_exported(self, args: EngineArgs, path: str, *, trust_file: bool = False
                       ) -> tuple[StepProgram, ModelDescription]:
        """A file's program and description (a compile-cache entry is never trusted as code)."""
        from pagedpack.export import load_exported

        program = load_exported(path, trust_file=trust_file)
        if args.target is not None and args.target != program.target:
            raise ValueError(f"target: {path!r} is run by the {program.target!r} target, got {args.target!r}")
        self.target = program.target
        if isinstance(program.run, torch.fx.GraphModule):  # a .pt2 program: the CPU kernels, as after a capture
            limit = args.max_model_len or program.description.max_model_len
            program.run, note = cpu_step(program.run, program.kv_cache_specs, args.device, limit)
            program.note = "; ".join(filter(None, (program.note, note)))
        return program, program.description

    def _capture_and_lower(self, args: EngineArgs) -> tuple[StepProgram, ModelDescription]:
        from pagedpack.compile_cache import compiled_step

        compiled = compiled_step(args)
        loaded = self._load_compiled(args, compiled) if compiled is not None else None
        if loaded is not None:
            return loaded
        from pagedpack.models.aliases import checkpoint_stamp

        target = args.lowering_target
        target.prepare_device(args.device)
        module, description, rewritten = capture_source(args)
        self._model, self._stamp = module, checkpoint_stamp(args.model)
        self._rewritten, self._report = rewritten, rewritten.report
        rewritten.raise_if_refused()
        bounds = dataclasses.replace(args.step_bounds, max_model_len=args.max_model_len or description.max_model_len)
        target.check_limits(rewritten, block_size=args.block_size, bounds=bounds)
        if args.memory_budget is not None:  # before lowering, which may change the graph in place
            self._activation_peak()
        graph = dict(graph=args.graph_config) if target.graph_modes else {}
        program = target.lower(rewritten, block_size=args.block_size, bounds=bounds, device=args.device, **graph)
        if program.note:
            rewritten.report.notes.append(program.note)
        keep = args.keep_source_model or not program.standalone
        # what serving holds, with the source kept and without: plan_memory(keep_source_model=...)
        self._weight_bytes = {kept: _serving_weight_bytes(program, rewritten, module, kept or not program.standalone)
                              for kept in (True, False)}
        if not keep:
            self._let_source_go(program)
        return program, description

    def _load_compiled(self, args: EngineArgs, compiled) -> tuple[StepProgram, ModelDescription] | None:
        """The program and description of a compile-cache entry (:mod:`pagedpack.compile_cache`), with
        its report and weight counts as after a capture here; None (the entry dropped) if it does not load."""
        from pagedpack.compile_cache import compiled_step, forget

        for rebuild in (True, False):  # a damaged entry (its checksum) is built once more, then given up
            try:
                program, description = self._load_exported(args, compiled.path)
                break
            except ValueError as err:
                forget(compiled.path)
                then = "building it again" if rebuild else "capturing in this process"
                print(f"pagedpack: the compile cache's entry does not load ({err}); {then}", file=sys.stderr)
                compiled = compiled_step(args) if rebuild else None
                if compiled is None:
                    return None
        self._stamp, self._report = compiled.stamp, compiled.report
        self._report.notes.append(program.note)
        # kept, the source would share all but the prepacked copies with the program
        tensors = [*program.run.parameters(), *program.run.buffers()]
        packed = sum(t.numel() * t.element_size() for t in tensors if t.is_mkldnn)
        self._weight_bytes = {False: resident_weight_bytes(program.run), True: packed + compiled.source_weight_bytes}
        return program, description

    def _let_source_go(self, program: StepProgram) -> None:
        """Give the program copies of the tensors it shares with the model, then drop the rewritten
        model and, if this LLM loaded it, the source model (class docstring)."""
        if isinstance(program.run, torch.fx.GraphModule):
            own_attrs(program.run)
        self._rewritten = None
        if not isinstance(self.engine_args.model, torch.nn.Module):  # the caller's module stays theirs
            self._model = None

    def _load_again(self) -> torch.nn.Module:
        """The source model once let go, loaded again; ``ValueError`` if its checkpoint is gone or changed."""
        from pagedpack.models.aliases import checkpoint_stamp

        model = self.engine_args.model
        stamp = checkpoint_stamp(self._stamp[0] if self._stamp else model)
        try:
            if stamp != self._stamp:
                raise ValueError("its files changed since or are gone")
            return load_source(self.engine_args, model=stamp[0] if stamp else None)[0]
        except (ValueError, OSError) as err:
            raise ValueError(f"model: this LLM let its source model go once lowered and cannot load {model!r} "
                             f"again ({err}); build the LLM with keep_source_model=True to keep it") from err

    def _capture_again(self):
        """The rewritten model of the source model (kept or loaded again), captured again."""
        from pagedpack.models.capture import capture
        from pagedpack.passes.pipeline import rewrite

        module = self._model if self._model is not None else self._load_again()
        return rewrite(capture(module), extra_passes=self.engine_args.extra_passes)

    @property
    def model(self) -> torch.nn.Module | None:
        """The ``transformers`` module (None when served from a file); loaded again if let go."""
        if self._model is None and not self._exported:
            self._model = self._load_again()
        return self._model

    @property
    def rewritten(self):
        """The :class:`~pagedpack.passes.pipeline.RewrittenModel` (None when served from a file);
        captured and rewritten again from ``model`` if let go."""
        if self._rewritten is None and not self._exported:
            self._rewritten = self._capture_again()
        return self._rewritten

    @property
    def report(self):
        """The pass report (what ``pagedpack inspect`` prints); None when served from a file."""
        return self._report

    def get_stats(self) -> Stats:
        """The engine's counters now (steps, tokens computed, preemptions, prefix-cache queries,
        hits and evictions, KV blocks used / cached / free): a :class:`pagedpack.runtime.engine.Stats`.
        Counters run over the LLM's life (take differences around a call); ``reset_prefix_cache``
        empties the cache, not the counters."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody holds (as vLLM's ``LLM.reset_prefix_cache``); returns
        False, changing nothing, while requests hold blocks."""
        return self.llm_engine.scheduler.kv_cache_manager.pool.reset_cache()

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token takes over all layers."""
        return bytes_per_token(self.program.kv_cache_specs)

    def export(self, path, *, format: str = "pt2", attention: str = "pagedpack") -> str:
        """Write the rewritten step program to ``path`` as ``format`` (``"pt2"`` or ``"onnx"``,
        ``attention`` for ONNX as in :func:`pagedpack.onnx_export.export_onnx`) with this LLM's
        description (eos ids, ``max_model_len``, vocabulary, tokenizer); returns ``str(path)``.
        ``ValueError`` for an LLM served from a file or lowered for a target other than the reference."""
        from pagedpack.export import check_format, export_pt2

        check_format(format)
        if self._exported:
            raise ValueError("source: an LLM served from an exported file (LLM.from_exported) cannot be exported "
                             "again; export the original model")
        if format == "onnx":
            from pagedpack.onnx_export import export_onnx

            return export_onnx(self._source_graph(), path, self.description, attention=attention)
        if attention != "pagedpack":
            raise ValueError(f"attention: only with format 'onnx', got attention={attention!r} with 'pt2'")
        return export_pt2(self._source_graph(), path, self.description)

    def _source_graph(self):
        """The rewritten model: the one kept, else captured again without keeping it."""
        return self._rewritten if self._rewritten is not None else self._capture_again()

    def plan_memory(self, memory, *, keep_source_model: bool | None = None) -> MemoryPlan:
        """The :class:`pagedpack.planner.MemoryPlan` of this model under a budget of ``memory``
        bytes (an int or a string such as ``"4GiB"``) with this LLM's block size, step limits and
        ``max_model_len``; weights counted as serving holds them: a program of the target's own
        (on the CPU, with the prepacked copies) alone, otherwise, or with ``keep_source_model``
        (None: as this LLM was built), with the model and the rewritten graph. ``ValueError`` for
        an LLM served from a file (no graph to plan from)."""
        if self._exported:
            raise ValueError("memory_budget: an LLM served from an exported file has no step graph to plan from; "
                             "give num_blocks or kv_cache_memory")
        args = self.engine_args
        keep = args.keep_source_model if keep_source_model is None else keep_source_model
        if not isinstance(keep, bool):
            raise ValueError(f"keep_source_model: expected a bool or None, got {keep_source_model!r}")
        return plan_memory(self._activation_peak(), bytes_per_token=self.bytes_per_token,
                           memory=parse_bytes("memory", memory), block_size=self.block_size,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           max_model_len=self.max_model_len, weight_bytes=self._weight_bytes[keep])

    def _activation_peak(self):
        """The rewritten step graph's activation peak (:mod:`pagedpack.passes.activation_memory`),
        derived once: from the rewritten graph before lowering (captured again if it was let go or
        lowered in place)."""
        if self._peak is None:
            lowered = getattr(self, "program", None)
            fresh = self._rewritten is not None and (lowered is None or lowered.standalone)
            rewritten = self._rewritten if fresh else self._capture_again()
            from pagedpack.passes.activation_memory import activation_peak

            self._peak = activation_peak(rewritten.graph_module, rewritten.kv_cache_specs)
        return self._peak

    def _check_pool_fits(self, args: EngineArgs) -> None:
        """A CPU pool larger than the machine's RAM would fail in the allocator (or swap): refuse it."""
        ram = physical_memory() if is_cpu(args.device) else None
        pool = self.num_blocks * self.block_size * self.bytes_per_token
        if ram is not None and pool > ram:
            sizes = ("num_blocks", "kv_cache_memory", "memory_budget")
            given = next((n for n in sizes if getattr(args, n) is not None), "num_blocks")
            raise ValueError(f"{given}: a KV pool of {self.num_blocks} blocks ({pool} bytes) is more than this "
                             f"machine's memory ({ram} bytes)")

    def _num_blocks(self, args: EngineArgs) -> int:
        bytes_per_block = self.bytes_per_token * self.block_size
        if args.num_blocks is not None:
            return args.num_blocks
        if args.memory_budget is not None:
            plan = self.plan_memory(args.memory_budget)
            if plan.num_blocks < 1:
                raise ValueError(f"memory_budget: {plan.memory} bytes leave no room for the KV pool after the weights "
                                 f"({plan.weight_bytes} bytes) and one step's activation peak at max_num_batched_"
                                 f"tokens={plan.max_num_batched_tokens} ({plan.activation_bytes} bytes)")
            return plan.num_blocks
        if args.kv_cache_memory is not None:
            if args.kv_cache_memory < bytes_per_block:
                raise ValueError(f"kv_cache_memory: expected at least one block ({bytes_per_block} bytes), "
                                 f"got {args.kv_cache_memory}")
            return int(args.kv_cache_memory // bytes_per_block)
        full = args.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(full, _DEFAULT_KV_CACHE_MEMORY // bytes_per_block))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for ``prompts`` (a string, a list of token ids, a dict ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}`` with an optional ``"cache_salt"``, or a list of those), all
        submitted together; returns one :class:`RequestOutput` per prompt, in order.

        A request that can never run (token ids outside the vocabulary, prompt longer than
        ``max_model_len``, more tokens than the whole KV pool) gets ``error`` set; the others
        finish normally. Malformed arguments raise ``ValueError`` before anything is queued.

        Thread-safe: calls from several threads run one after another (the engine, the tokenizer and
        the caches are one per ``LLM``), so no call sees or aborts another call's requests.
        """
        with self._generate_lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        prompts = normalize_prompts(prompts)
        params = normalize_sampling_params(sampling_params, len(prompts))
        if any(isinstance(p.content, str) for p in prompts) and self.tokenizer is None:
            name = self.description.model_name or "given as an instance"
            raise ValueError(f"prompts: got a string but the model ({name}) has no tokenizer (no tokenizer files); "
                             "pass token ids, or a tokenizer with LLM(..., tokenizer=...) / --tokenizer")
        requests = [self._make_request(prompt, p) for prompt, p in zip(prompts, params)]  # tokenize first
        outputs, live = [], {}
        for prompt, (request_id, request) in zip(prompts, requests):
            out = RequestOutput(request_id, prompt.content if isinstance(prompt.content, str) else None,
                                request.prompt_token_ids)
            outputs.append(out)
            try:
                check_token_ids(request.prompt_token_ids, self.vocab_size)
                self.llm_engine.add_request(request)
                live.update({r.request_id: (i, out) for i, r in enumerate([request, *request.forks])})
            except ValueError as err:
                out.error = f"request {request_id!r}: {err}" if str(err).startswith("prompt:") else str(err)
                out.outputs.append(CompletionOutput(0, "", [], "error"))
        try:
            with tqdm(total=len(live), desc="generate", unit="completion", disable=not use_tqdm) as bar:
                while self.llm_engine.has_unfinished():
                    for request in self.llm_engine.step():
                        index, out = live[request.request_id]
                        out.outputs.append(CompletionOutput(index, self._decode(request.output_token_ids),
                                                            list(request.output_token_ids), request.finish_reason))
                        out.error = out.error or request.error
                        bar.update(1)
        except BaseException:
            self.llm_engine.scheduler.abort_all()  # this call's requests only (the lock): the engine stays usable
            raise
        for out in outputs:
            out.outputs.sort(key=lambda completion: completion.index)
        return outputs

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> tuple[str, Request]:
        """``(request_id, request)``: with ``params.n > 1`` the request is the first of the ``n``
        completions (id ``"0_<request_id>"``, as vLLM's child requests) and carries the others
        as its ``forks``, seeded ``seed + i``."""
        ids = self.tokenizer(prompt.content).input_ids if isinstance(prompt.content, str) else prompt.content
        eos_ids = self.description.eos_token_ids
        eos = eos_ids[0] if eos_ids else None
        if len(eos_ids) > 1 and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *eos_ids[1:]])
        request_id = str(next(self._ids))
        if params.n == 1:
            return request_id, Request(request_id, ids, params, eos_token_id=eos, cache_salt=prompt.cache_salt)
        first, *forks = [
            Request(f"{i}_{request_id}", ids, dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i),
                eos_token_id=eos, cache_salt=prompt.cache_salt)
            for i in range(params.n)]
        first.forks = forks
        return request_id, first

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _serving_weight_bytes(program: StepProgram, rewritten, module: torch.nn.Module, keep: bool) -> int:
    """Bytes of weights an LLM holds while it serves: its program's (another runtime's session,
    such as onnxruntime's, counted as a copy of the rewritten graph's), with the rewritten graph's
    and the model's if it ``keep``s them (:func:`pagedpack.planner.resident_weight_bytes`)."""
    source = (rewritten.graph_module, module) if keep else ()
    if isinstance(program.run, torch.nn.Module) or not program.standalone:
        return resident_weight_bytes(*[m for m in (program.run, *source) if isinstance(m, torch.nn.Module)])
    return resident_weight_bytes(rewritten.graph_module) + (resident_weight_bytes(*source) if keep else 0)
