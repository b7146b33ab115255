"""A stand-in for TorchAir's ``npugraph_ex`` ``torch.compile`` backend off an NPU.

What it keeps of the real one (Ascend/torchair @ fced8842, 2026-06-01: ``npugraph_ex/npugraph_ex/
npu_fx_compiler.py`` ``_npu_backend``, ``_compile_graph_with_aot``, ``_optimize_fx``;
``configs/npugraphex_config.py``):

- **Options**: ``torch.compile(..., backend=npugraph_ex_emulation_backend, options={...})``; a key
  outside npugraph_ex's :data:`ALLOWED_OPTIONS` is a ``ValueError``, as there. Only the two custom
  passes have an effect here; the other keys are accepted and ignored.
- **AOT**: the dynamo graph goes through ``aot_module_simplified(...,
  keep_inference_input_mutations=True)`` with the same forward and inference compiler, so the
  passes see the same post-grad graph kind: functional ATen, parameters lifted as inputs, custom
  ops that write their inputs as ``auto_functionalized_v2`` followed by ``copy_`` into the input.
- **Passes**: ``post_grad_custom_pre_pass(gm, example_inputs, config)`` first, then
  ``post_grad_custom_post_pass`` with the same arguments, their results ignored; ``config`` is a
  :class:`CompilerConfig` holding the options.

Not emulated: npugraph_ex's built-in passes between the two (``remove_noop_ops``,
``recover_view_inplace_pattern``, pattern fusion, ``view_to_reshape``), default decompositions,
and the ACL graph capture and replay (the graph runs eagerly, op by op: see
:mod:`pagedpack.kernels.npu_graph_emulation` for the capture stand-in).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._functorch.aot_autograd import aot_module_simplified

# npugraph_ex's _NpuGraphExConfig.OPTIONS_TO_CONFIG_MAP keys (configs/npugraphex_config.py).
ALLOWED_OPTIONS = frozenset({
    "static_kernel_compile", "inplace_pass", "input_inplace_pass", "remove_noop_ops", "remove_cat_ops",
    "force_eager", "pattern_fusion_pass", "clone_input", "frozen_parameter", "post_grad_custom_pre_pass",
    "post_grad_custom_post_pass", "use_graph_pool", "reuse_graph_pool_in_same_fx", "capture_limit",
    "clone_output", "dump_tensor_data", "data_dump_stage", "data_dump_dir",
})


@dataclass
class CompilerConfig:
    """The part of npugraph_ex's ``CompilerConfig`` a custom pass is given: the two passes and
    the other options as passed."""

    post_grad_custom_pre_pass: Callable | None = None
    post_grad_custom_post_pass: Callable | None = None
    options: dict = field(default_factory=dict)


def npugraph_ex_emulation_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """A dynamo backend standing in for ``backend="npugraph_ex"`` (module docstring); returns AOT
    autograd's compiled callable. ``ValueError`` for an option npugraph_ex does not know."""
    options = dict(options or {})
    unknown = sorted(set(options) - ALLOWED_OPTIONS)
    if unknown:
        raise ValueError(f"Invalid option {unknown[0]!r}, allowed options: {sorted(ALLOWED_OPTIONS)}")
    config = CompilerConfig(options.pop("post_grad_custom_pre_pass", None),
                            options.pop("post_grad_custom_post_pass", None), options)

    def compiler(aot_gm: torch.fx.GraphModule, aot_inputs):
        for custom_pass in (config.post_grad_custom_pre_pass, config.post_grad_custom_post_pass):
            if custom_pass is not None:
                custom_pass(aot_gm, aot_inputs, config)
        aot_gm.recompile()
        return aot_gm

    return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, inference_compiler=compiler,
                                 keep_inference_input_mutations=True)
