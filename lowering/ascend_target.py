"""The ``ascend`` target: what ties the Ascend parts together.

- limits: :mod:`pagedpack.lowering.ascend_limits` (each documented FIA limit with its source);
- lowering: :mod:`pagedpack.lowering.ascend` (``pagedpack`` ops -> FIA + ``npu_scatter_nd_update_``);
- running: on an ``npu`` device, TorchAir's GE backend (:mod:`pagedpack.lowering.ascend_torchair`);
- emulation: elsewhere, the same lowered graph runs eagerly on
  :mod:`pagedpack.kernels.ascend_emulation`, which implements the documented op contracts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedpack.lowering.ascend import describe, emulated_ops, import_torchair, lower_rewritten, npu_ops, site_shapes
from pagedpack.lowering.ascend_limits import check_supported
from pagedpack.lowering.ascend_torchair import compile_step, torchair_backend
from pagedpack.lowering.targets import LoweredStep, StepBounds, Target


def is_npu(device: torch.device | str) -> bool:
    return str(device).split(":")[0] == "npu"


@dataclass
class AscendTarget(Target):
    """torch_npu's FIA per attention site (TND, paged; ``sparse_mode=3``, or 4 with a sliding
    window); block size 128 by default (paged FIA takes multiples of 128). The built-in model is
    shaped for FIA's TND form (bf16, head_dim 128)."""

    name: str = "ascend"
    default_block_size: int = 128
    description: str = "Ascend torch_npu ops through TorchAir (emulated off an NPU)"
    builtin_model: dict = field(default_factory=lambda: dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, dtype=torch.bfloat16))

    def prepare_device(self, device: torch.device | str) -> None:
        """Import torch_npu before an ``npu`` device is used (``torch.device("npu")`` needs it)."""
        if is_npu(device):
            import_torchair()

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        """:class:`~pagedpack.lowering.ascend_limits.AscendLoweringError` citing each broken limit."""
        for shape in site_shapes(rewritten, block_size=block_size):
            check_supported(shape, bounds)

    def lower(self, rewritten, *, block_size: int, bounds: StepBounds, device: torch.device | str) -> LoweredStep:
        """Lower ``rewritten`` in place: on an NPU the real ops compiled by TorchAir, elsewhere the
        emulation ops run eagerly (same graph, same arguments)."""
        ops = emulated_ops() if self.emulated(device) else npu_ops()
        shapes = lower_rewritten(rewritten, block_size=block_size, ops=ops, bounds=bounds, device=device)
        note = describe(shapes, ops)
        if self.emulated(device):
            return LoweredStep(rewritten.graph_module, rewritten.kv_cache_specs, note=f"{note}; emulated on {device}")
        step = compile_step(rewritten.graph_module, torchair_backend())
        return LoweredStep(step, rewritten.kv_cache_specs, note=note)

    def emulated(self, device: torch.device | str) -> bool:
        return not is_npu(device)
