"""``ProgramBuilder``: from what an ``LLM`` is given to the step program it serves.

Source (a checkpoint, a module, a file) -> source model -> rewritten step -> lowered program, each
stage a value (below), with what comes along: the model's description, the pass report, the
weights serving holds, the compile cache and the let-go / load-again / capture-again life cycle.
``LLM`` and the CLI share it; the capture side (``transformers``' modeling code, capture, the
passes) is imported where it is used, so a process serving an exported file never imports it (its
memory: ``docs/cpu-kernels.md``). It builds one rank's program; the runtime starts the other ranks.

Memory: when the target lowers to a program of its own (the reference target on the CPU, a copy
with prepacked weights; ``onnx``), that program takes copies of the tensors it shares with the
model (it serves the weights as they were when built) and the builder lets the rewritten model
and a model it loaded itself go, so that serving holds each weight once, not three times
(checkpoint, rewritten graph, program). ``model`` and ``rewritten`` are then loaded and captured
again on first use and kept; ``export`` and ``plan_memory`` do so without keeping them. Loading
again refuses a checkpoint directory whose files changed since (``ValueError``).
``keep_source_model=True`` keeps both instead.

Compile cache: a local checkpoint served on the CPU by the reference target is captured in a
child process whose ``.pt2`` export is loaded here, kept for later LLMs of it
(:mod:`pagedpack.compiler.compile_cache`; ``PAGEDPACK_COMPILE_CACHE=0``: in this process).
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedpack.compiler.planner import resident_weight_bytes
from pagedpack.compiler.source import describe_source, load_source, rewrite_module
from pagedpack.engine_args import EngineArgs
from pagedpack.inputs import KV_CACHE_DTYPES, check_kv_cache_dtype
from pagedpack.lowering.targets import export_format_for, format_of, get_target, tensor_parallel_format
from pagedpack.passes.graph_attrs import own_attrs
from pagedpack.step.contract import ModelDescription, StepProgram, bytes_per_token

# The stages of a build, each a value made by one stage function from the one before:
# Source -> SourceModel (load_model) -> RewrittenStep (rewrite_model; shard) -> Lowered (lower).
# A file (an export, a compile-cache entry) enters at Lowered (load_file, from_compile_cache).


@dataclass(frozen=True)
class Source:
    """What a build starts from: the arguments, and the tensor-parallel rank whose program it builds."""

    args: EngineArgs
    rank: int = 0


@dataclass(frozen=True)
class SourceModel:
    """The ``transformers`` module ``args.model`` names, loaded and described; ``stamp``: its
    checkpoint's files when loaded (:func:`~pagedpack.models.aliases.checkpoint_stamp`; loading
    again checks them); ``note``: the description's caveat, for the pass report."""

    module: torch.nn.Module
    description: ModelDescription
    stamp: tuple | None
    note: str | None = None


@dataclass(frozen=True)
class RewrittenStep:
    """The step graph captured from a :class:`SourceModel` and rewritten: a
    :class:`~pagedpack.passes.pipeline.RewrittenModel` (refused sites in its report, not raised)."""

    step: object

    @property
    def report(self):
        return self.step.report


@dataclass(frozen=True)
class Lowered:
    """The step program serving runs, lowered here or loaded from a file, with what comes along:
    the ``target`` serving it, the pass ``report`` (None from an exported file), the checkpoint's
    ``stamp``, the program's KV cache specs as built (the model's dtype), the weight bytes serving
    holds ``(source let go, source kept)`` (None from an exported file) and the rewritten graph's
    activation ``peak`` once derived (None until then)."""

    program: StepProgram
    target: str
    report: object | None
    stamp: tuple | None
    kv_cache_specs: tuple
    weight_bytes: tuple[int, int] | None
    peak: object | None = None


def load_model(source: Source) -> SourceModel:
    """``source.args.model`` loaded (on the target's device) and described."""
    from pagedpack.models.aliases import checkpoint_stamp

    args = source.args
    args.lowering_target.prepare_device(args.device)
    module, description, note = describe_source(args)
    return SourceModel(module, description, checkpoint_stamp(args.model), note)


def rewrite_model(source: Source, model: SourceModel) -> RewrittenStep:
    """``model`` captured and rewritten (the description's caveat noted in the report)."""
    step = rewrite_module(model.module, source.args)
    if model.note:
        step.report.notes.append(model.note)
    return RewrittenStep(step)


def shard(source: Source, model: SourceModel, rewritten: RewrittenStep, join_group: Callable[[], str]) -> RewrittenStep:
    """Rank ``source.rank``'s shard of ``rewritten`` (:mod:`pagedpack.passes.tensor_parallel`). Rank 0
    checks the split on a sample first; then ``join_group()`` gives the process group's name (the
    runtime joins it, starting the other ranks: :mod:`pagedpack.runtime.tensor_parallel`)."""
    from pagedpack.passes.pipeline import RewrittenModel
    from pagedpack.passes.tensor_parallel import (
        check_no_recurrent_state,
        check_no_sparse_attention,
        check_shards,
        count_all_gathers,
        count_all_reduces,
        shard_step_graph,
    )

    step, tp_size, rank = rewritten.step, source.args.tensor_parallel_size, source.rank
    check_no_recurrent_state(step.state_specs, tp_size)
    check_no_sparse_attention(step.graph_module, tp_size)
    if rank == 0:
        check_shards(step.graph_module, step.kv_cache_specs, model.module, tp_size=tp_size)
    gm, specs = shard_step_graph(step.graph_module, step.kv_cache_specs, model.module, tp_size=tp_size, rank=rank,
                                 group_name=join_group())
    collectives = f"{count_all_reduces(gm)} all-reduces and {count_all_gathers(gm)} all-gathers"
    step.report.notes.append(f"tensor_parallel: rank {rank} of {tp_size}, {specs[0].num_kv_heads} KV "
                             f"heads per layer, {collectives} per step")
    return RewrittenStep(RewrittenModel(gm, step.report, specs))


def lower(source: Source, model: SourceModel, rewritten: RewrittenStep, *,
          whole: RewrittenStep | None = None) -> Lowered:
    """``rewritten`` (this rank's shard of ``whole``, if sharded) lowered for the target, with the
    weight bytes serving holds and, under a ``memory_budget``, the activation peak of ``whole``
    (derived before lowering, which may change the graph in place)."""
    args, target, step = source.args, source.args.lowering_target, rewritten.step
    bounds = dataclasses.replace(args.step_bounds, max_model_len=args.max_model_len or model.description.max_model_len)
    refused = target.recurrent_refusals(step) if step.state_specs else []
    if refused:
        raise ValueError(f"target: the {target.name} target does not run these recurrent layers (serve the model "
                         "on the reference target):\n  " + "\n  ".join(refused))
    refused = target.sparse_attention_refusals(step)
    if refused:
        raise ValueError(f"target: the {target.name} target does not run these sparse-attention (DSA) layers (serve "
                         "the model on the reference target):\n  " + "\n  ".join(refused))
    if step.lora_specs and not target.supports_lora:
        raise ValueError(f"enable_lora: the {target.name} target does not run LoRA adapters yet (serve them on the "
                         "reference target)")
    target.check_limits(step, block_size=args.block_size, bounds=bounds)
    peak = _activation_peak(whole or rewritten) if args.memory_budget is not None else None
    program = target.lower(step, args.target_options, block_size=args.block_size, bounds=bounds, device=args.device)
    program.description = model.description
    if program.note:
        step.report.notes.append(program.note)
    # what serving holds, with the source let go and kept: LLM.plan_memory(keep_source_model=...)
    weight_bytes = tuple(_serving_weight_bytes(program, step, model.module, kept or not program.standalone)
                         for kept in (False, True))
    return Lowered(program, target.name, step.report, model.stamp, tuple(program.kv_cache_specs), weight_bytes, peak)


def load_file(source: Source, path: str, *, trust_file: bool = False,
              join_group: Callable[[], str] | None = None) -> Lowered:
    """The program of a file ``pagedpack export`` wrote, served by the target of its format (a
    compile-cache entry is never trusted as code); a tensor-parallel manifest's rank file for
    ``source.rank``, its all-reduces on the process group ``join_group()`` names. With
    ``enable_lora``, ``ValueError`` naming it for a file whose program takes no LoRA inputs (a file
    that takes them and is served without ``enable_lora`` runs the base model: no slot is ever named)."""
    from pagedpack.passes.tensor_parallel import count_all_reduces, set_group_name

    args = source.args
    fmt, target = format_of(path)
    program = target.load_exported(path, fmt, trust_file=trust_file, device=args.device,
                                   max_model_len=args.max_model_len, rank=source.rank)
    if fmt.world_size is not None:
        set_group_name(program.run, (join_group or world_group_name)())
    elif getattr(program, "tensor_parallel", None) is not None or (
            isinstance(program.run, torch.fx.GraphModule) and count_all_reduces(program.run)):
        raise ValueError(f"path: {path!r} is one rank of a tensor-parallel export; serve its manifest")
    if args.enable_lora and not program.lora_specs:
        raise ValueError(f"enable_lora: {path!r} (format {fmt.name}) takes no LoRA inputs; export the model with "
                         "enable_lora (format pt2) to serve adapters from a file, or serve it without enable_lora")
    return Lowered(program, target.name, None, None, tuple(program.kv_cache_specs), None)


def from_compile_cache(source: Source) -> Lowered | None:
    """The program of the compile-cache entry of ``source.args``, with its report and weight counts
    as after a capture here; None where the cache does not apply or its entry does not load."""
    from pagedpack.compiler.compile_cache import compiled_step, forget

    compiled = compiled_step(source.args)
    for rebuild in (True, False):  # a damaged entry (its checksum) is built once more, then given up
        if compiled is None:
            return None
        try:
            lowered = load_file(source, compiled.path)
            break
        except ValueError as err:
            forget(compiled.path)
            then = "building it again" if rebuild else "capturing in this process"
            print(f"pagedpack: the compile cache's entry does not load ({err}); {then}", file=sys.stderr)
            compiled = compiled_step(source.args) if rebuild else None
    else:
        return None
    program, report = lowered.program, compiled.report
    report.notes.append(program.note)
    # kept, the source would share all but the prepacked copies with the program
    tensors = [*program.run.parameters(), *program.run.buffers()]
    packed = sum(t.numel() * t.element_size() for t in tensors if t.is_mkldnn)
    weight_bytes = (resident_weight_bytes(program.run), packed + compiled.source_weight_bytes)
    return dataclasses.replace(lowered, report=report, stamp=compiled.stamp, weight_bytes=weight_bytes)


def world_group_name() -> str:
    """The name the step graphs' all-reduces give the default process group (joined already: a
    worker rank's, a launcher's)."""
    import torch.distributed as dist

    return dist.group.WORLD.group_name


class ProgramBuilder:
    """Builds one step program for ``args`` (:meth:`build`) through the stages above, and keeps the
    stage values the source's life cycle needs after: ``source_model`` and ``rewritten_step`` (None
    once let go: ``model`` and ``rewritten`` load and capture them again) and ``lowered``; ``report``,
    :meth:`weight_bytes`, :meth:`activation_peak`, :meth:`source_graph`.

    ``rank``: the tensor-parallel rank whose program it builds; ``join_group``: called when the
    program needs the ranks' process group (rank 0's split checked, or a manifest's rank file
    loaded), returns its name. The runtime joins the group and starts the other ranks
    (:class:`pagedpack.runtime.tensor_parallel.TensorParallelRanks`); default: the group this
    process joined already."""

    def __init__(self, args: EngineArgs, *, rank: int = 0, join_group: Callable[[], str] | None = None):
        self.args, self.source, self.exported = args, Source(args, rank), args.is_exported
        self.join_group = join_group or world_group_name
        self.source_model: SourceModel | None = None
        self.rewritten_step: RewrittenStep | None = None  # the whole step graph (not this rank's shard)
        self.lowered: Lowered | None = None

    @property
    def rank(self) -> int:
        return self.source.rank

    @property
    def target(self) -> str:
        """The name of the target serving the program (for a file: the target of its format)."""
        return self.lowered.target if self.lowered is not None else self.args.lowering_target.name

    @property
    def report(self):
        """The pass report (None when served from a file)."""
        if self.lowered is not None:
            return self.lowered.report
        return self.rewritten_step.report if self.rewritten_step is not None else None

    def build(self) -> tuple[StepProgram, ModelDescription]:
        """The program and the model's description: from the file ``args.model`` names, from the
        compile cache, or captured, rewritten and lowered here."""
        if self.exported:
            lowered = load_file(self.source, self.args.model, trust_file=self.args.trust_file,
                                join_group=self.join_group)
        else:
            lowered = from_compile_cache(self.source) or self._lower_here()
        self.lowered, program = lowered, lowered.program
        # the runner allocates the caches from the program's specs: args.kv_cache_dtype's
        program.kv_cache_specs = self.kv_cache_specs(self.args.kv_cache_dtype)
        return program, program.description

    def kv_bytes_per_token(self, kv_cache_dtype: str | None = None) -> int:
        """KV-cache bytes per token of the program as built (``kv_cache_dtype``: in that dtype instead)."""
        specs = self.lowered.program.kv_cache_specs if kv_cache_dtype is None else self.kv_cache_specs(kv_cache_dtype)
        return bytes_per_token(specs)

    def kv_cache_specs(self, kv_cache_dtype: str) -> list:
        """The program's KV cache specs with caches of ``kv_cache_dtype`` (a name as
        ``EngineArgs.kv_cache_dtype``); ``ValueError`` naming the option if the target does not run
        the program so (:meth:`pagedpack.lowering.targets.Target.check_kv_cache_dtype`)."""
        kv_dtype = KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)]
        built = list(self.lowered.kv_cache_specs)
        if kv_dtype is None:
            return built
        target = get_target(self.target)
        for spec in built:
            try:
                target.check_kv_cache_dtype(kv_dtype, spec.dtype)
            except ValueError as err:  # named as the user spelled it ("fp8" is float8_e4m3fn)
                raise ValueError(f"{err} (kv_cache_dtype={kv_cache_dtype!r})") from None
        return [dataclasses.replace(spec, dtype=kv_dtype) for spec in built]

    def capture(self) -> tuple[torch.nn.Module, ModelDescription, object]:
        """``(module, description, rewritten)``: the source loaded, captured and rewritten, not lowered
        (what ``pagedpack inspect`` prints); refused sites are in the report, not raised."""
        self.source_model = load_model(self.source)
        self.rewritten_step = rewrite_model(self.source, self.source_model)
        return self.source_model.module, self.source_model.description, self.rewritten_step.step

    def _lower_here(self) -> Lowered:
        """Source -> SourceModel -> RewrittenStep (-> this rank's shard) -> Lowered, in this process;
        then, unless kept, the source model and the rewritten graph let go."""
        args = self.args
        self.capture()
        model, rewritten = self.source_model, self.rewritten_step
        rewritten.step.raise_if_refused()
        if args.tensor_parallel_size > 1:
            lowered = lower(self.source, model, shard(self.source, model, rewritten, self.join_group),
                            whole=rewritten)
        else:
            lowered = lower(self.source, model, rewritten)
        if lowered.program.standalone and not args.keep_source_model:
            # the program takes copies of the tensors it shares with the model; the caller's module stays theirs
            if isinstance(lowered.program.run, torch.fx.GraphModule):
                own_attrs(lowered.program.run)
            self.rewritten_step = None
            if not isinstance(args.model, torch.nn.Module):
                self.source_model = None
        return lowered

    def _load_again(self) -> SourceModel:
        """The source model once let go, loaded again; ``ValueError`` if its checkpoint is gone or changed."""
        from pagedpack.models.aliases import checkpoint_stamp

        model, built = self.args.model, self.lowered.stamp
        stamp = checkpoint_stamp(built[0] if built else model)
        try:
            if stamp != built:
                raise ValueError("its files changed since or are gone")
            module = load_source(self.args, model=stamp[0] if stamp else None)[0]
        except (ValueError, OSError) as err:
            raise ValueError(f"model: this LLM let its source model go once lowered and cannot load {model!r} "
                             f"again ({err}); build the LLM with keep_source_model=True to keep it") from err
        return SourceModel(module, self.lowered.program.description, stamp)

    def _capture_again(self) -> RewrittenStep:
        """The rewritten step of the source model (kept or loaded again), captured again."""
        model = self.source_model if self.source_model is not None else self._load_again()
        return RewrittenStep(rewrite_module(model.module, self.args))

    @property
    def model(self) -> torch.nn.Module | None:
        """The ``transformers`` module (None when served from a file); loaded again if let go."""
        if self.source_model is None and not self.exported:
            self.source_model = self._load_again()
        return self.source_model.module if self.source_model is not None else None

    @property
    def rewritten(self):
        """The :class:`~pagedpack.passes.pipeline.RewrittenModel` (None when served from a file);
        captured and rewritten again from ``model`` if let go."""
        if self.rewritten_step is None and not self.exported:
            self.rewritten_step = self._capture_again()
        return self.rewritten_step.step if self.rewritten_step is not None else None

    def source_graph(self):
        """The rewritten model for an export: the one kept, else captured again without keeping it.
        ``ValueError`` for a program served from a file."""
        if self.exported:
            raise ValueError("source: an LLM served from an exported file (LLM.from_exported) cannot be exported "
                             "again; export the original model")
        return (self.rewritten_step or self._capture_again()).step

    def export(self, path, description: ModelDescription, *, format: str | None = None,
               tensor_parallel_size: int | None = None, **options) -> str:
        """Write the rewritten step program with ``description`` to ``path`` as ``format`` (a registered
        export format, :func:`~pagedpack.lowering.targets.format_names`; None: the one ``path``'s suffix
        names, else ``pt2``: :func:`~pagedpack.lowering.targets.export_format_for`; ``options``: its own
        export options, e.g. ONNX's ``attention``) (``LLM.export``); split over ``tensor_parallel_size``
        ranks (None: this LLM's) as the format's tensor-parallel manifest and one file per rank
        (:mod:`pagedpack.lowering.reference.tp`)."""
        fmt, _ = export_format_for(path, format)
        format = fmt.name
        fmt.check_options(options)
        tp_size = self.args.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
        if tp_size != 1:
            manifest, _ = tensor_parallel_format(format)
            return manifest.export(self.source_graph(), path, description, model=self.model,
                                   tensor_parallel_size=tp_size, **options)
        return fmt.export(self.source_graph(), path, description, **options)

    def weight_bytes(self, keep_source_model: bool) -> int | None:
        """Bytes of weights serving holds, with the source model and the rewritten graph kept or not
        (None where the lowering did not count them)."""
        return None if self.lowered.weight_bytes is None else self.lowered.weight_bytes[keep_source_model]

    def activation_peak(self):
        """The rewritten step graph's activation peak (:mod:`pagedpack.passes.activation_memory`),
        derived once: from the rewritten graph before lowering (captured again if it was let go or
        lowered in place). ``ValueError`` for a program served from a file."""
        if self.exported:
            raise ValueError("memory_budget: an LLM served from an exported file has no step graph to plan from; "
                             "give num_blocks or kv_cache_memory")
        if self.lowered.peak is None:
            fresh = self.rewritten_step is not None and self.lowered.program.standalone
            peak = _activation_peak(self.rewritten_step if fresh else self._capture_again())
            self.lowered = dataclasses.replace(self.lowered, peak=peak)
        return self.lowered.peak


def build_rank_program(args: EngineArgs, rank: int) -> StepProgram:
    """Rank ``rank``'s program of a tensor-parallel ``args`` (what a worker process runs, in the
    process group it joined)."""
    return ProgramBuilder(args, rank=rank).build()[0]


class Draft(ProgramBuilder):
    """``args.speculative_config``'s draft model (method ``draft_model``), built as the target's program
    is, with its dtype, KV cache dtype, target, device, block size, step bounds (its ``max_model_len``
    its own) and threads: its ``program`` and ``description``, and what it adds to the target's memory
    (its KV takes the pool's blocks beside the target's: :meth:`kv_bytes_per_token`; its weights and
    proposal scratch are fixed: :meth:`fixed_bytes`)."""

    def __init__(self, args: EngineArgs):
        self.config = args.speculative_config
        try:  # what fails here is the draft's: said so
            super().__init__(EngineArgs(
                model=self.config.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, target=args.target,
                target_options=args.target_options, device=args.device, block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                num_threads=args.num_threads, reserved_cpus=args.reserved_cpus))
            self.program, self.description = self.build()
        except (ValueError, OSError) as err:
            raise ValueError(f"speculative_config.model: {str(err).removeprefix('model: ')}") from err

    def fixed_bytes(self, kv_cache_dtype: str | None = None) -> int:
        """Bytes the draft holds whatever the pool: its weights as served and the scratch blocks of
        ``max_num_seqs`` proposals (:mod:`pagedpack.runtime.spec_decode.draft_model`), their KV in
        ``kv_cache_dtype`` (None: as built)."""
        block_size = self.args.block_size
        scratch_tokens = self.args.max_num_seqs * self.config.scratch_blocks_per_seq(block_size) * block_size
        return (self.weight_bytes(False) or 0) + scratch_tokens * self.kv_bytes_per_token(kv_cache_dtype)


def build_draft(args: EngineArgs) -> Draft | None:
    """``args``' draft model (:class:`Draft`), None unless ``speculative_config``'s method is ``draft_model``."""
    config = args.speculative_config
    return Draft(args) if config is not None and config.method == "draft_model" else None


def max_model_len(args: EngineArgs, description: ModelDescription) -> int:
    """``args.max_model_len``, at most the model's limit, or the model's; ``ValueError`` naming it."""
    limit = description.max_model_len
    if args.max_model_len is not None and limit is not None and args.max_model_len > limit:
        raise ValueError(f"max_model_len: expected 1 .. {limit} (the model's limit), got {args.max_model_len}")
    if (args.max_model_len or limit) is None:
        raise ValueError("max_model_len: the model records no limit; pass max_model_len")
    return args.max_model_len or limit


def load_exported(path, *, trust_file: bool = False, device="cpu", max_model_len: int | None = None) -> StepProgram:
    """The program serving a file ``pagedpack export`` wrote, whatever its name: the registry finds its
    format and target (:func:`~pagedpack.lowering.targets.format_of`, by the file's first bytes) and the
    target serves it (:meth:`~pagedpack.lowering.targets.Target.load_exported`: a ``.pt2`` lowered for
    the CPU, an ONNX model on an onnxruntime session, ...), its ``description`` set; ``ValueError`` if no
    format claims the file, it is damaged (its checksum), or its metadata disagrees with its program.
    ``trust_file``: see :func:`~pagedpack.lowering.reference.pt2.load_pt2`."""
    fmt, target = format_of(path)
    return target.load_exported(path, fmt, trust_file=trust_file, device=device, max_model_len=max_model_len)


def _activation_peak(rewritten: RewrittenStep):
    from pagedpack.passes.activation_memory import activation_peak

    return activation_peak(rewritten.step.graph_module, rewritten.step.kv_cache_specs, rewritten.step.state_specs)


def _serving_weight_bytes(program: StepProgram, rewritten, module: torch.nn.Module, keep: bool) -> int:
    """Bytes of weights an LLM holds while it serves: its program's (another runtime's session,
    such as onnxruntime's, counted as a copy of the rewritten graph's), with the rewritten graph's
    and the model's if it ``keep``s them (:func:`pagedpack.compiler.planner.resident_weight_bytes`)."""
    source = (rewritten.graph_module, module) if keep else ()
    if isinstance(program.run, torch.nn.Module) or not program.standalone:
        return resident_weight_bytes(*[m for m in (program.run, *source) if isinstance(m, torch.nn.Module)])
    return resident_weight_bytes(rewritten.graph_module) + (resident_weight_bytes(*source) if keep else 0)
