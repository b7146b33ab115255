"""``ProgramBuilder``: from what an ``LLM`` is given to the step program it serves.

Source (a checkpoint, a module, a file) -> rewritten model -> lowered program, with what comes
along: the model's description, the pass report, the weights serving holds, the compile cache
and the let-go / load-again / capture-again life cycle. ``LLM`` and the CLI share it; the capture
side (``transformers``' modeling code, capture, the passes) is imported where it is used, so a
process serving an exported file never imports it (its memory: ``docs/cpu-kernels.md``).

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
(:mod:`pagedpack.compile_cache`; ``PAGEDPACK_COMPILE_CACHE=0``: in this process).
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from pagedpack.contract import ModelDescription, StepProgram
from pagedpack.engine_args import EngineArgs
from pagedpack.inputs import KV_CACHE_DTYPES, check_kv_cache_dtype
from pagedpack.lowering.targets import format_of, get_format, get_target, tensor_parallel_format
from pagedpack.passes.graph_attrs import own_attrs
from pagedpack.planner import resident_weight_bytes
from pagedpack.source import capture_source, load_source


class ProgramBuilder:
    """Builds and keeps one step program for ``args`` (:meth:`build`), and what the source's life
    cycle needs after: ``model`` and ``rewritten`` (loaded / captured again if let go),
    ``report``, :meth:`weight_bytes`, :meth:`activation_peak`, :meth:`source_graph`."""

    def __init__(self, args: EngineArgs, *, rank: int = 0):
        self.args, self.target, self.rank = args, args.lowering_target.name, rank
        self.workers = None  # rank 0 of a tensor-parallel LLM: the other ranks' processes
        self.exported = args.is_exported
        self.report = None
        self._model, self._rewritten, self._peak, self._stamp, self._weight_bytes = None, None, None, None, {}
        self._program: StepProgram | None = None
        self.source_specs: list = []  # the program's KV cache specs as built (the model's dtype)

    def build(self) -> tuple[StepProgram, ModelDescription]:
        """The program and the model's description: from the file ``args.model`` names, from the
        compile cache, or captured, rewritten and lowered here."""
        if self.args.tensor_parallel_size > 1 and self.args.distributed_executor_backend == "external_launcher":
            from pagedpack.runtime.tensor_parallel import join_launched_group

            self.rank = join_launched_group(self.args.tensor_parallel_size)
        if self.exported:
            program = self._load_file(self.args.model, trust_file=self.args.trust_file)
        else:
            program = self._from_compile_cache() or self._capture_and_lower()
        self._apply_kv_cache_dtype(program)
        self._program = program
        return program, program.description

    def _apply_kv_cache_dtype(self, program: StepProgram) -> None:
        """Give ``program`` caches of ``args.kv_cache_dtype`` (the runner allocates them from its specs);
        ``source_specs`` keeps the specs it was built with (the model's dtype)."""
        self.source_specs = list(program.kv_cache_specs)
        program.kv_cache_specs = self.kv_cache_specs(self.args.kv_cache_dtype)

    def kv_cache_specs(self, kv_cache_dtype: str) -> list:
        """The program's KV cache specs with caches of ``kv_cache_dtype`` (a name as
        ``EngineArgs.kv_cache_dtype``); ``ValueError`` naming the option if the target does not run
        the program so (:meth:`pagedpack.lowering.targets.Target.check_kv_cache_dtype`)."""
        kv_dtype = KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)]
        if kv_dtype is None:
            return list(self.source_specs)
        target = get_target(self.target)
        for spec in self.source_specs:
            try:
                target.check_kv_cache_dtype(kv_dtype, spec.dtype)
            except ValueError as err:  # named as the user spelled it ("fp8" is float8_e4m3fn)
                raise ValueError(f"{err} (kv_cache_dtype={kv_cache_dtype!r})") from None
        return [dataclasses.replace(spec, dtype=kv_dtype) for spec in self.source_specs]

    def _load_file(self, path: str, *, trust_file: bool = False) -> StepProgram:
        """The program of a file ``pagedpack export`` wrote, served by the target of its format
        (a compile-cache entry is never trusted as code); a tensor-parallel manifest's rank file for
        this rank, its all-reduces on this process group."""
        from pagedpack.passes.tensor_parallel import count_all_reduces, set_group_name

        fmt, target = format_of(path)
        self.target = target.name
        program = target.load_exported(path, fmt, trust_file=trust_file, device=self.args.device,
                                       max_model_len=self.args.max_model_len, rank=self.rank)
        if fmt.world_size is not None:
            from pagedpack.runtime.tensor_parallel import group_name

            self._start_workers()
            set_group_name(program.run, group_name())
        elif getattr(program, "tensor_parallel", None) is not None or (
                isinstance(program.run, torch.fx.GraphModule) and count_all_reduces(program.run)):
            raise ValueError(f"path: {path!r} is one rank of a tensor-parallel export; serve its manifest")
        return program

    def capture(self) -> tuple[torch.nn.Module, ModelDescription, object]:
        """``(module, description, rewritten)``: the source loaded, captured and rewritten, not lowered
        (what ``pagedpack inspect`` prints); refused sites are in the report, not raised."""
        from pagedpack.models.aliases import checkpoint_stamp

        self.args.lowering_target.prepare_device(self.args.device)
        module, description, rewritten = capture_source(self.args)
        self._model, self._stamp = module, checkpoint_stamp(self.args.model)
        self._rewritten, self.report = rewritten, rewritten.report
        return module, description, rewritten

    def _capture_and_lower(self) -> StepProgram:
        args, target = self.args, self.args.lowering_target
        module, description, rewritten = self.capture()
        rewritten.raise_if_refused()
        if args.tensor_parallel_size > 1:
            rewritten = self._shard(module, rewritten)
        bounds = dataclasses.replace(args.step_bounds, max_model_len=args.max_model_len or description.max_model_len)
        target.check_limits(rewritten, block_size=args.block_size, bounds=bounds)
        if args.memory_budget is not None:  # before lowering, which may change the graph in place
            self.activation_peak()
        program = target.lower(rewritten, args.target_options, block_size=args.block_size, bounds=bounds,
                               device=args.device)
        program.description = description
        if program.note:
            rewritten.report.notes.append(program.note)
        # what serving holds, with the source kept and without: LLM.plan_memory(keep_source_model=...)
        self._weight_bytes = {kept: _serving_weight_bytes(program, rewritten, module, kept or not program.standalone)
                              for kept in (True, False)}
        if not (args.keep_source_model or not program.standalone):
            self._let_source_go(program)
        return program

    def _shard(self, module: torch.nn.Module, rewritten):
        """This rank's shard of ``rewritten`` (:mod:`pagedpack.passes.tensor_parallel`). Rank 0 checks
        the split on a sample first, then starts the other ranks (:mod:`pagedpack.runtime.tensor_parallel`)."""
        from pagedpack.passes.pipeline import RewrittenModel
        from pagedpack.passes.tensor_parallel import (
            check_shards,
            count_all_gathers,
            count_all_reduces,
            shard_step_graph,
        )
        from pagedpack.runtime.tensor_parallel import group_name

        tp_size = self.args.tensor_parallel_size
        if self.rank == 0:
            check_shards(rewritten.graph_module, rewritten.kv_cache_specs, module, tp_size=tp_size)
            self._start_workers()
        gm, specs = shard_step_graph(rewritten.graph_module, rewritten.kv_cache_specs, module, tp_size=tp_size,
                                     rank=self.rank, group_name=group_name())
        collectives = f"{count_all_reduces(gm)} all-reduces and {count_all_gathers(gm)} all-gathers"
        rewritten.report.notes.append(f"tensor_parallel: rank {self.rank} of {tp_size}, {specs[0].num_kv_heads} KV "
                                      f"heads per layer, {collectives} per step")
        return RewrittenModel(gm, rewritten.report, specs)

    def _start_workers(self) -> None:
        """Rank 0 spawns the other ranks, unless a launcher started each (``external_launcher``)."""
        from pagedpack.runtime.tensor_parallel import TensorParallelWorkers

        if self.rank == 0 and self.args.distributed_executor_backend == "mp":
            self.workers = TensorParallelWorkers(self.args, build_rank_program)

    def _from_compile_cache(self) -> StepProgram | None:
        """The program of the compile-cache entry of ``args``, with its report and weight counts as
        after a capture here; None where the cache does not apply or its entry does not load."""
        from pagedpack.compile_cache import compiled_step, forget

        compiled = compiled_step(self.args)
        for rebuild in (True, False):  # a damaged entry (its checksum) is built once more, then given up
            if compiled is None:
                return None
            try:
                program = self._load_file(compiled.path)
                break
            except ValueError as err:
                forget(compiled.path)
                then = "building it again" if rebuild else "capturing in this process"
                print(f"pagedpack: the compile cache's entry does not load ({err}); {then}", file=sys.stderr)
                compiled = compiled_step(self.args) if rebuild else None
        else:
            return None
        self._stamp, self.report = compiled.stamp, compiled.report
        self.report.notes.append(program.note)
        # kept, the source would share all but the prepacked copies with the program
        tensors = [*program.run.parameters(), *program.run.buffers()]
        packed = sum(t.numel() * t.element_size() for t in tensors if t.is_mkldnn)
        self._weight_bytes = {False: resident_weight_bytes(program.run), True: packed + compiled.source_weight_bytes}
        return program

    def _let_source_go(self, program: StepProgram) -> None:
        """Give the program copies of the tensors it shares with the model, then drop the rewritten
        model and, if the builder loaded it, the source model."""
        if isinstance(program.run, torch.fx.GraphModule):
            own_attrs(program.run)
        self._rewritten = None
        if not isinstance(self.args.model, torch.nn.Module):  # the caller's module stays theirs
            self._model = None

    def _load_again(self) -> torch.nn.Module:
        """The source model once let go, loaded again; ``ValueError`` if its checkpoint is gone or changed."""
        from pagedpack.models.aliases import checkpoint_stamp

        model = self.args.model
        stamp = checkpoint_stamp(self._stamp[0] if self._stamp else model)
        try:
            if stamp != self._stamp:
                raise ValueError("its files changed since or are gone")
            return load_source(self.args, model=stamp[0] if stamp else None)[0]
        except (ValueError, OSError) as err:
            raise ValueError(f"model: this LLM let its source model go once lowered and cannot load {model!r} "
                             f"again ({err}); build the LLM with keep_source_model=True to keep it") from err

    def _capture_again(self):
        """The rewritten model of the source model (kept or loaded again), captured again."""
        from pagedpack.models.capture import capture
        from pagedpack.passes.pipeline import rewrite

        module = self._model if self._model is not None else self._load_again()
        return rewrite(capture(module), extra_passes=self.args.extra_passes)

    @property
    def model(self) -> torch.nn.Module | None:
        """The ``transformers`` module (None when served from a file); loaded again if let go."""
        if self._model is None and not self.exported:
            self._model = self._load_again()
        return self._model

    @property
    def rewritten(self):
        """The :class:`~pagedpack.passes.pipeline.RewrittenModel` (None when served from a file);
        captured and rewritten again from ``model`` if let go."""
        if self._rewritten is None and not self.exported:
            self._rewritten = self._capture_again()
        return self._rewritten

    def source_graph(self):
        """The rewritten model for an export: the one kept, else captured again without keeping it.
        ``ValueError`` for a program served from a file."""
        if self.exported:
            raise ValueError("source: an LLM served from an exported file (LLM.from_exported) cannot be exported "
                             "again; export the original model")
        return self._rewritten if self._rewritten is not None else self._capture_again()

    def export(self, path, description: ModelDescription, *, format: str = "pt2",
               tensor_parallel_size: int | None = None, **options) -> str:
        """Write the rewritten step program with ``description`` to ``path`` as ``format`` (a registered
        export format, :func:`~pagedpack.lowering.targets.format_names`; ``options``: its own export
        options, e.g. ONNX's ``attention``) (``LLM.export``); split over ``tensor_parallel_size`` ranks
        (None: this LLM's) as the format's tensor-parallel manifest and one file per rank
        (:mod:`pagedpack.lowering.reference.tp`)."""
        fmt, _ = get_format(format)
        fmt.check_options(options)
        tp_size = self.args.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
        if tp_size != 1:
            manifest, _ = tensor_parallel_format(format)
            return manifest.export(self.source_graph(), path, description, model=self.model,
                                   tensor_parallel_size=tp_size, **options)
        return fmt.export(self.source_graph(), path, description, **options)

    def weight_bytes(self, keep_source_model: bool) -> int:
        """Bytes of weights serving holds, with the source model and the rewritten graph kept or not."""
        return self._weight_bytes[keep_source_model]

    def activation_peak(self):
        """The rewritten step graph's activation peak (:mod:`pagedpack.passes.activation_memory`),
        derived once: from the rewritten graph before lowering (captured again if it was let go or
        lowered in place). ``ValueError`` for a program served from a file."""
        if self.exported:
            raise ValueError("memory_budget: an LLM served from an exported file has no step graph to plan from; "
                             "give num_blocks or kv_cache_memory")
        if self._peak is None:
            lowered = self._program
            fresh = self._rewritten is not None and (lowered is None or lowered.standalone)
            rewritten = self._rewritten if fresh else self._capture_again()
            from pagedpack.passes.activation_memory import activation_peak

            self._peak = activation_peak(rewritten.graph_module, rewritten.kv_cache_specs)
        return self._peak


def build_rank_program(args: EngineArgs, rank: int) -> StepProgram:
    """Rank ``rank``'s program of a tensor-parallel ``args`` (what a worker process runs)."""
    return ProgramBuilder(args, rank=rank).build()[0]


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


def _serving_weight_bytes(program: StepProgram, rewritten, module: torch.nn.Module, keep: bool) -> int:
    """Bytes of weights an LLM holds while it serves: its program's (another runtime's session,
    such as onnxruntime's, counted as a copy of the rewritten graph's), with the rewritten graph's
    and the model's if it ``keep``s them (:func:`pagedpack.planner.resident_weight_bytes`)."""
    source = (rewritten.graph_module, module) if keep else ()
    if isinstance(program.run, torch.nn.Module) or not program.standalone:
        return resident_weight_bytes(*[m for m in (program.run, *source) if isinstance(m, torch.nn.Module)])
    return resident_weight_bytes(rewritten.graph_module) + (resident_weight_bytes(*source) if keep else 0)
