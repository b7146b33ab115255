"""The ``ascend`` target: what ties the Ascend parts together.

- limits: :mod:`pagedpack.lowering.ascend.limits` (each documented FIA limit with its source);
- lowering: :mod:`pagedpack.lowering.ascend.lower` (``pagedpack`` ops -> FIA + ``npu_scatter_nd_update_``);
- graph modes: :mod:`pagedpack.lowering.ascend.graphs` (static decode graphs per batch-size
  bucket and eager prefill, as production runs; or one dynamic graph);
- running: on an ``npu`` device, graphs compile with TorchAir's GE backend
  (:mod:`pagedpack.lowering.ascend.torchair`);
- emulation: elsewhere, the same graphs run on :mod:`pagedpack.kernels.ascend_emulation`, which
  implements the documented op contracts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from pagedpack.devices import is_npu
from pagedpack.lowering.ascend.graphs import (
    DEFAULT_GRAPH_BATCH_SIZES,
    DEFAULT_GRAPH_MODE,
    GRAPH_MODES,
    DecodeBuckets,
    DynamicGraph,
    check_graph_batch_sizes,
    copy_module,
    max_blocks_per_seq,
)
from pagedpack.lowering.ascend.limits import MAX_TND_SEQS, check_supported
from pagedpack.lowering.ascend.lower import (
    describe,
    emulated_ops,
    import_torchair,
    lower_rewritten,
    lower_to_ascend,
    npu_ops,
    site_shapes,
    step_example_inputs,
)
from pagedpack.lowering.ascend.torchair import compile_step, torchair_backend
from pagedpack.lowering.targets import LoweredStep, StepBounds, Target, TargetOptions


def emulation_backend(gm: torch.fx.GraphModule, example_inputs):
    """Stands for TorchAir's GE backend off an NPU: runs the graph dynamo captured, as captured,
    on the emulated ops (dynamo still specialises, guards and recompiles as it would there)."""
    return gm.forward


@dataclass(frozen=True)
class AscendOptions(TargetOptions):
    """``graph_mode``: which steps run in a compiled graph, one of :data:`GRAPH_MODES`
    (``decode_buckets``, the default: decode steps in a static graph per batch-size bucket, the
    others eager, as production runs; ``dynamic``: one dynamic graph for every step);
    ``graph_batch_sizes``: the decode buckets (default 1, 2, 4, ..., 64; each at most the TND limit),
    ``decode_buckets`` only. :mod:`pagedpack.lowering.ascend.graphs`."""

    graph_mode: str = DEFAULT_GRAPH_MODE
    graph_batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode: expected one of {list(GRAPH_MODES)}, got {self.graph_mode!r}")
        if self.graph_batch_sizes is not None and self.graph_mode != "decode_buckets":
            raise ValueError(f"graph_batch_sizes: only the decode_buckets graph mode takes them, "
                             f"got graph_mode={self.graph_mode!r}")
        sizes = DEFAULT_GRAPH_BATCH_SIZES if self.graph_batch_sizes is None else self.graph_batch_sizes
        object.__setattr__(self, "graph_batch_sizes", tuple(check_graph_batch_sizes(sizes, limit=MAX_TND_SEQS)))


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

    def prepare_device(self, device: torch.device | str) -> None:
        """Import torch_npu before an ``npu`` device is used (``torch.device("npu")`` needs it)."""
        if is_npu(device):
            import_torchair()

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        """:class:`~pagedpack.lowering.ascend.limits.AscendLoweringError` citing each broken limit."""
        for shape in site_shapes(rewritten, block_size=block_size):
            check_supported(shape, bounds)

    def lower(self, rewritten, options: AscendOptions, *, block_size: int, bounds: StepBounds,
              device: torch.device | str) -> LoweredStep:
        """Lower ``rewritten`` in place (TorchAir's tensor-length ops) and wrap it in the graph mode
        of ``options``; ``decode_buckets`` also lowers a copy for eager steps (torch_npu's host-length
        ops). On an NPU graphs compile with TorchAir's GE backend, elsewhere with
        :func:`emulation_backend` over the emulated ops."""
        emulated = self.emulated(device)
        ops = emulated_ops() if emulated else npu_ops()
        eager = copy_module(rewritten.graph_module) if options.graph_mode == "decode_buckets" else None
        shapes = lower_rewritten(rewritten, block_size=block_size, ops=ops, bounds=bounds, device=device)
        backend = emulation_backend if emulated else torchair_backend()
        if eager is None:
            program = DynamicGraph(rewritten.graph_module, backend, compile_step)
        else:
            lower_to_ascend(eager, step_example_inputs(rewritten, block_size, device), ops=ops, bounds=bounds,
                            eager=True)
            program = DecodeBuckets(rewritten.graph_module, eager, batch_sizes=list(options.graph_batch_sizes),
                                    max_blocks_per_seq=max_blocks_per_seq(bounds.max_model_len, block_size),
                                    backend=backend)
        buckets = f" {list(options.graph_batch_sizes)}" if eager is not None else ""
        note = f"{describe(shapes, ops)}; graph mode {options.graph_mode}{buckets}"
        note += f"; emulated on {device}" if emulated else ""
        return LoweredStep(program, rewritten.kv_cache_specs, note=note, graphs=program.stats,
                           padding_blocks=program.padding_blocks)

    def emulated(self, device: torch.device | str) -> bool:
        return not is_npu(device)
