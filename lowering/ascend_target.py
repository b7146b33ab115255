"""The ``ascend`` target: what ties the Ascend parts together.

- limits: :mod:`pagedpack.lowering.ascend_limits` (each documented FIA limit with its source);
- lowering: :mod:`pagedpack.lowering.ascend` (``pagedpack`` ops -> FIA + ``npu_scatter_nd_update_``);
- graph modes: :mod:`pagedpack.lowering.ascend_graphs` (static decode graphs per batch-size
  bucket and eager prefill, as production runs; or one dynamic graph);
- running: on an ``npu`` device, graphs compile with TorchAir's GE backend
  (:mod:`pagedpack.lowering.ascend_torchair`);
- emulation: elsewhere, the same graphs run on :mod:`pagedpack.kernels.ascend_emulation`, which
  implements the documented op contracts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from pagedpack.devices import is_npu
from pagedpack.lowering.ascend import (
    describe,
    emulated_ops,
    import_torchair,
    lower_rewritten,
    lower_to_ascend,
    npu_ops,
    site_shapes,
    step_example_inputs,
)
from pagedpack.lowering.ascend_graphs import (
    DEFAULT_GRAPH_BATCH_SIZES,
    DEFAULT_GRAPH_MODE,
    GRAPH_MODES,
    DecodeBuckets,
    DynamicGraph,
    check_graph_batch_sizes,
    copy_module,
    max_blocks_per_seq,
)
from pagedpack.lowering.ascend_limits import MAX_TND_SEQS, check_supported
from pagedpack.lowering.ascend_torchair import compile_step, torchair_backend
from pagedpack.lowering.targets import GraphConfig, LoweredStep, StepBounds, Target


def emulation_backend(gm: torch.fx.GraphModule, example_inputs):
    """Stands for TorchAir's GE backend off an NPU: runs the graph dynamo captured, as captured,
    on the emulated ops (dynamo still specialises, guards and recompiles as it would there)."""
    return gm.forward


@dataclass
class AscendTarget(Target):
    """torch_npu's FIA per attention site (TND, paged; ``sparse_mode=3``, or 4 with a sliding
    window); block size 128 by default (paged FIA takes multiples of 128). The built-in model is
    shaped for FIA's TND form (bf16, head_dim 128). Graph modes: :mod:`pagedpack.lowering.ascend_graphs`."""

    name: str = "ascend"
    default_block_size: int = 128
    description: str = "Ascend torch_npu ops through TorchAir (emulated off an NPU)"
    builtin_model: dict = field(default_factory=lambda: dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, dtype=torch.bfloat16))
    graph_modes: tuple[str, ...] = GRAPH_MODES

    def graph_config(self, mode: str | None = None, batch_sizes=None) -> GraphConfig:
        """``mode`` in :data:`GRAPH_MODES` (default ``decode_buckets``); ``batch_sizes``: the decode
        buckets (default 1, 2, 4, ..., 64), each at most the TND limit of 4096 sequences."""
        mode = DEFAULT_GRAPH_MODE if mode is None else mode
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode: expected one of {list(GRAPH_MODES)}, got {mode!r}")
        if batch_sizes is not None and mode != "decode_buckets":
            raise ValueError(f"graph_batch_sizes: only the decode_buckets graph mode takes them, "
                             f"got graph_mode={mode!r}")
        sizes = DEFAULT_GRAPH_BATCH_SIZES if batch_sizes is None else batch_sizes
        return GraphConfig(mode, tuple(check_graph_batch_sizes(sizes, limit=MAX_TND_SEQS)))

    def prepare_device(self, device: torch.device | str) -> None:
        """Import torch_npu before an ``npu`` device is used (``torch.device("npu")`` needs it)."""
        if is_npu(device):
            import_torchair()

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        """:class:`~pagedpack.lowering.ascend_limits.AscendLoweringError` citing each broken limit."""
        for shape in site_shapes(rewritten, block_size=block_size):
            check_supported(shape, bounds)

    def lower(self, rewritten, *, block_size: int, bounds: StepBounds, device: torch.device | str,
              graph: GraphConfig = GraphConfig()) -> LoweredStep:
        """Lower ``rewritten`` in place (TorchAir's tensor-length ops) and wrap it in the graph mode
        (``graph`` from :meth:`graph_config`); ``decode_buckets`` also lowers a copy for eager steps
        (torch_npu's host-length ops). On an NPU graphs compile with TorchAir's GE backend, elsewhere
        with :func:`emulation_backend` over the emulated ops."""
        graph = graph if graph.mode else self.graph_config()
        emulated = self.emulated(device)
        ops = emulated_ops() if emulated else npu_ops()
        eager = copy_module(rewritten.graph_module) if graph.mode == "decode_buckets" else None
        shapes = lower_rewritten(rewritten, block_size=block_size, ops=ops, bounds=bounds, device=device)
        backend = emulation_backend if emulated else torchair_backend()
        if eager is None:
            program = DynamicGraph(rewritten.graph_module, backend, compile_step)
        else:
            lower_to_ascend(eager, step_example_inputs(rewritten, block_size, device), ops=ops, bounds=bounds,
                            eager=True)
            program = DecodeBuckets(rewritten.graph_module, eager, batch_sizes=list(graph.batch_sizes),
                                    max_blocks_per_seq=max_blocks_per_seq(bounds.max_model_len, block_size),
                                    backend=backend)
        buckets = f" {list(graph.batch_sizes)}" if eager is not None else ""
        note = f"{describe(shapes, ops)}; graph mode {graph.mode}{buckets}"
        note += f"; emulated on {device}" if emulated else ""
        return LoweredStep(program, rewritten.kv_cache_specs, note=note, graphs=program.stats,
                           padding_blocks=program.padding_blocks)

    def emulated(self, device: torch.device | str) -> bool:
        return not is_npu(device)
