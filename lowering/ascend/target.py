"""The ``ascend`` target: what ties the Ascend parts together.

- limits: :mod:`pagedpack.lowering.ascend.limits` (each documented FIA limit with its source);
- lowering: :mod:`pagedpack.lowering.ascend.lower` (``pagedpack`` ops -> FIA + ``npu_scatter_nd_update_``);
- graph modes: :mod:`pagedpack.lowering.ascend.graphs` (vllm-ascend's ``full_and_piecewise``,
  the default: full ACL graphs of decode steps per batch-size bucket, the other steps in ACL-graph
  pieces split at the attention ops per token bucket; ``full_decode_only``; ``eager``; static
  TorchAir decode graphs per bucket, as until late 2025; or one dynamic TorchAir graph);
- running: on an ``npu`` device, ACL graphs through ``torch.npu.NPUGraph``, TorchAir graphs with
  its GE backend (:mod:`pagedpack.lowering.ascend.torchair`);
- emulation: elsewhere, the same graphs run on :mod:`pagedpack.kernels.ascend_emulation`, which
  implements the documented op contracts, ACL graphs on
  :mod:`pagedpack.kernels.npu_graph_emulation`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from pagedpack.host.devices import is_npu
from pagedpack.lowering.ascend.graphs import (
    BUCKET_MODES,
    DEFAULT_GRAPH_BATCH_SIZES,
    DEFAULT_GRAPH_MODE,
    DEFAULT_GRAPH_TOKEN_SIZES,
    EAGER_LOWERED_MODES,
    GRAPH_MODE_ALIASES,
    GRAPH_MODES,
    ACLGraphBuckets,
    DecodeBuckets,
    DynamicGraph,
    EagerSteps,
    PiecewiseGraphs,
    RecurrentSteps,
    check_sizes,
    copy_module,
    max_blocks_per_seq,
)
from pagedpack.lowering.ascend.limits import MAX_TND_SEQS, MAX_TND_TOKENS, AscendLoweringError, check_supported
from pagedpack.lowering.ascend.lower import (
    describe,
    emulated_ops,
    import_torchair,
    kv_lengths_argument,
    lower_rewritten,
    lower_to_ascend,
    npu_ops,
    site_shapes,
    step_example_inputs,
)
from pagedpack.lowering.ascend.recurrent import (
    MISSING_OPS,
    SUPPORTED_OPS,
    ascend_state_specs,
    emulated_recurrent_ops,
    lower_recurrent,
    npu_recurrent_ops,
    violations,
)
from pagedpack.lowering.ascend.torchair import compile_step, torchair_backend
from pagedpack.lowering.targets import StepBounds, Target, TargetOptions, recurrent_sites
from pagedpack.step.contract import LoweredStep


def npu_graph_api(emulated: bool):
    """What provides ``NPUGraph`` and ``graph``: ``torch.npu`` (torch_npu) on an NPU, else the stand-in."""
    if not emulated:
        return torch.npu
    import pagedpack.kernels.npu_graph_emulation as stand_in
    return stand_in


def emulation_backend(gm: torch.fx.GraphModule, example_inputs):
    """Stands for TorchAir's GE backend off an NPU: runs the graph dynamo captured, as captured,
    on the emulated ops (dynamo still specialises, guards and recompiles as it would there)."""
    return gm.forward


@dataclass(frozen=True)
class AscendOptions(TargetOptions):
    """``graph_mode``: which steps run in a graph, one of :data:`GRAPH_MODES` (vllm-ascend's names:
    ``full_and_piecewise``, the default: uniform decode steps replay a full ACL graph per batch-size
    bucket, the others ACL-graph pieces per token bucket with attention eager; ``full_decode_only``
    (alias ``aclgraph``, this option's former default): full decode graphs, the others eager;
    ``eager``: no graphs; ``decode_buckets``: a static TorchAir graph per decode bucket, as until
    late 2025; ``dynamic``: one dynamic TorchAir graph for every step);
    ``graph_batch_sizes``: the decode buckets (default 1, 2, 4, ..., 64; each at most the TND limit),
    bucket modes only; ``graph_token_sizes``: the piecewise token buckets (default vLLM's capture
    sizes 1, 2, 4, 8, 16, ..., 248, 256, 272, ..., 512), ``full_and_piecewise`` only.
    ``ValueError`` naming the option otherwise. :mod:`pagedpack.lowering.ascend.graphs`."""

    graph_mode: str = DEFAULT_GRAPH_MODE
    graph_batch_sizes: tuple[int, ...] | None = None
    graph_token_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        mode = GRAPH_MODE_ALIASES.get(self.graph_mode, self.graph_mode)
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode: expected one of {list(GRAPH_MODES)} (or {list(GRAPH_MODE_ALIASES)}), "
                             f"got {self.graph_mode!r}")
        object.__setattr__(self, "graph_mode", mode)
        if self.graph_batch_sizes is not None and mode not in BUCKET_MODES:
            raise ValueError(f"graph_batch_sizes: only the {', '.join(BUCKET_MODES)} graph modes take them, "
                             f"got graph_mode={mode!r}")
        if self.graph_token_sizes is not None and mode != "full_and_piecewise":
            raise ValueError(f"graph_token_sizes: only the full_and_piecewise graph mode takes them, "
                             f"got graph_mode={mode!r}")
        for name, default, limit in (("graph_batch_sizes", DEFAULT_GRAPH_BATCH_SIZES, MAX_TND_SEQS),
                                     ("graph_token_sizes", DEFAULT_GRAPH_TOKEN_SIZES, MAX_TND_TOKENS)):
            sizes = getattr(self, name)
            object.__setattr__(self, name, tuple(check_sizes(name, default if sizes is None else sizes,
                                                             limit=limit)))


@dataclass
class AscendTarget(Target):
    """torch_npu's FIA per attention site (TND, paged; ``sparse_mode=3``, or 4 with a sliding
    window); block size 128 by default (paged FIA takes multiples of 128). The built-in model is
    shaped for FIA's TND form (bf16, head_dim 128). Graph modes: :mod:`pagedpack.lowering.ascend.graphs`."""

    name: str = "ascend"
    default_block_size: int = 128
    description: str = "Ascend torch_npu ops through TorchAir (emulated off an NPU)"
    builtin_model: dict = field(default_factory=lambda: dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, dtype=torch.bfloat16))
    options_type: type = AscendOptions
    recurrent_ops: frozenset[str] = SUPPORTED_OPS

    def missing_recurrent_op(self, op: str) -> str:
        return MISSING_OPS.get(op) or super().missing_recurrent_op(op)

    def missing_sparse_attention(self) -> str:
        return ("no lowering to torch_npu's npu_lightning_indexer and npu_sparse_flash_attention (vllm-ascend's "
                "DeepSeek-V3.2 path) yet, and no emulation of them")

    def prepare_device(self, device: torch.device | str) -> None:
        """Import torch_npu before an ``npu`` device is used (``torch.device("npu")`` needs it)."""
        if is_npu(device):
            import_torchair()

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        """:class:`~pagedpack.lowering.ascend.limits.AscendLoweringError` citing each broken limit."""
        for shape in site_shapes(rewritten, block_size=block_size):
            check_supported(shape, bounds)
        broken = violations(rewritten.graph_module, rewritten.state_specs)
        if broken:
            raise AscendLoweringError("the Ascend recurrent ops cannot serve these layers:\n  " + "\n  ".join(broken))

    def lower(self, rewritten, options: AscendOptions, *, block_size: int, bounds: StepBounds,
              device: torch.device | str) -> LoweredStep:
        """Lower ``rewritten`` in place and wrap it in the graph mode of ``options``: the ACL graph
        modes and ``eager`` lower it with host lengths (torch_npu's ops, run eagerly, captured per
        bucket or in pieces); ``dynamic`` with TorchAir's tensor-length ops; ``decode_buckets`` both
        (a copy for eager steps). On an NPU, ACL graphs are ``torch.npu.NPUGraph`` and TorchAir graphs
        compile with its GE backend; elsewhere the emulations stand in (:func:`emulation_backend`,
        :mod:`pagedpack.kernels.npu_graph_emulation`). A model with recurrent state runs every step
        eagerly in the ACL graph modes and ``eager`` (:class:`~pagedpack.lowering.ascend.graphs.RecurrentSteps`,
        :mod:`pagedpack.lowering.ascend.recurrent`); the TorchAir modes are refused for it."""
        emulated = self.emulated(device)
        ops = emulated_ops() if emulated else npu_ops()
        mode, states = options.graph_mode, rewritten.state_specs
        if states and mode not in EAGER_LOWERED_MODES:
            raise ValueError(f"target_options: graph_mode={mode!r} compiles the step, and the recurrent layers' "
                             f"conv op (npu_causal_conv1d_custom) writes its state without declaring it in its "
                             f"schema, which compiled graphs would drop; the default graph_mode="
                             f"{DEFAULT_GRAPH_MODE!r} runs this model eagerly")
        buckets = dict(batch_sizes=list(options.graph_batch_sizes),
                       max_blocks_per_seq=max_blocks_per_seq(bounds.max_model_len, block_size)) \
            if mode in BUCKET_MODES and not states else {}
        if mode in EAGER_LOWERED_MODES:
            shapes = lower_rewritten(rewritten, block_size=block_size, ops=ops, bounds=bounds, device=device,
                                     eager=True)
            acl = dict(graph_api=npu_graph_api(emulated), **buckets,
                       kv_updates=[(kv_lengths_argument(s), s.sliding_window is not None) for s in shapes])
            if states:
                program, recurrent_note = self._recurrent_steps(rewritten, emulated, mode)
            elif mode == "eager":
                program = EagerSteps(rewritten.graph_module)
            elif mode == "full_decode_only":
                program = ACLGraphBuckets(rewritten.graph_module, **acl)
            else:
                program = PiecewiseGraphs(rewritten.graph_module, token_sizes=list(options.graph_token_sizes),
                                          ops=ops, **acl)
        else:
            eager = copy_module(rewritten.graph_module) if mode == "decode_buckets" else None
            shapes = lower_rewritten(rewritten, block_size=block_size, ops=ops, bounds=bounds, device=device)
            backend = emulation_backend if emulated else torchair_backend()
            if eager is None:
                program = DynamicGraph(rewritten.graph_module, backend, compile_step)
            else:
                lower_to_ascend(eager, step_example_inputs(rewritten, block_size, device), ops=ops, bounds=bounds,
                                eager=True)
                program = DecodeBuckets(rewritten.graph_module, eager, backend=backend, **buckets)
        note = f"{describe(shapes, ops)}; graph mode {mode}"
        note += f" {list(options.graph_batch_sizes)}" if buckets else ""
        if isinstance(program, PiecewiseGraphs):
            sizes = options.graph_token_sizes
            note += (f", {len(program.pieces)} pieces a step in {len(sizes)} token buckets "
                     f"({sizes[0]}..{sizes[-1]})")
        note += f"; {recurrent_note}" if states else ""
        note += f"; emulated on {device}" if emulated else ""
        return LoweredStep(program, rewritten.kv_cache_specs, note=note, graphs=program.stats,
                           padding_blocks=program.padding_blocks, state_specs=ascend_state_specs(states))

    @staticmethod
    def _recurrent_steps(rewritten, emulated: bool, mode: str) -> tuple[RecurrentSteps, str]:
        """The eager program of a model with recurrent state (already lowered for attention), the
        recurrent sites lowered in the form of steps with a prefill and in a copy in the decode form,
        and its line for the note."""
        recurrent = emulated_recurrent_ops() if emulated else npu_recurrent_ops()
        ops = {op for op, _ in recurrent_sites(rewritten)}
        prefill, states = rewritten.graph_module, rewritten.state_specs
        decode = copy_module(prefill)
        sites = lower_recurrent(prefill, states, recurrent)
        lower_recurrent(decode, states, recurrent, decode=True)
        for gm in (prefill, decode):
            gm.recompile()
        program = RecurrentSteps(prefill, decode, mode=mode, num_caches=sum(len(spec.cache_shapes(1, 1))
                                                                            for spec in rewritten.kv_cache_specs))
        forms = [(f"{recurrent.causal_conv1d} (run_mode=0)", "run_mode=1")] if "causal_conv1d_varlen" in ops else []
        if "gated_delta_rule_varlen" in ops:
            forms.append((str(recurrent.chunk_gated_delta_rule), str(recurrent.recurrent_gated_delta_rule)))
        prefill_ops, decode_ops = (" and ".join(form) for form in zip(*forms))
        return program, (f"{sites} recurrent site(s) -> {prefill_ops}; decode-only steps: {decode_ops}; every step "
                         "eager (no decode graphs: their padding rows would have no state slot)")

    def emulated(self, device: torch.device | str) -> bool:
        return not is_npu(device)
