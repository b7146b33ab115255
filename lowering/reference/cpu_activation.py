"""A gated MLP's ``silu(gate) * up`` in one native kernel.

``transformers``' gated MLPs with SiLU (``LlamaMLP``: Llama, Mistral, Qwen2/3, SmolLM, ...) compute
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; after the linear merge (:mod:`pagedpack.passes.linear_merge`)
``gate`` and ``up`` are the two halves of one GEMM's output. ATen runs ``silu`` and ``mul`` as two
kernels with a ``silu(gate)`` temporary between them, each a pass over ``[T, I]`` values and a
dispatch. :func:`fuse_silu_and_mul` replaces each ``mul(silu(gate), up)`` (either order) on two
tensors of one shape and dtype by ``torch.ops.pagedpack_cpu.silu_and_mul(gate, up)``
(``kernels/csrc/silu_and_mul_cpu.cpp``, vLLM's ``silu_and_mul`` on the two halves), which rounds
where ATen's two ops round: a bf16 / fp16 step's values are the graph's bit for bit; in fp32 a
value may move by an ulp where ATen computes its exp with the scalar function and the kernel with
the vector one (the tails of ATen's per-thread shares). A product laid out other than row-major
(transposed operands: ATen's ``mul`` keeps their layout, the kernel writes rows) is left alone, as
are other activations (GELU,
Gemma's ``gelu_pytorch_tanh``). The reference target's CPU lowering
(:mod:`pagedpack.lowering.reference.cpu`) applies this before it chunks the MLPs and checks the
lowered step against the graph. Measurements: ``docs/cpu-kernels.md``.
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_edit import finish_rewrite, replace_with_call

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fuse_silu_and_mul(graph_module: torch.fx.GraphModule) -> int:
    """Replace each ``silu(gate) * up`` of ``graph_module`` by a native ``silu_and_mul`` call
    (module docstring); returns how many (0 without the native kernels)."""
    native = native_ops()
    if native is None:
        return 0
    replaced = 0
    for node in list(graph_module.graph.nodes):
        found = _match(node)
        if found is not None:
            replace_with_call(node, native.silu_and_mul.default, found)
            replaced += 1
    return finish_rewrite(graph_module, replaced)


def _match(mul: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(gate, up)`` if ``mul`` is ``silu(gate) * up`` or ``up * silu(gate)``, ``silu`` used by
    ``mul`` alone, the two operands and the product of one shape and of one dtype of
    :data:`_DTYPES` (no broadcast, no type promotion), the product row-major (as the kernel writes
    it), else None."""
    if mul.op != "call_function" or mul.target is not aten.mul.Tensor or len(mul.args) != 2 or mul.kwargs:
        return None
    for silu, up in (mul.args, mul.args[::-1]):
        if not (isinstance(silu, torch.fx.Node) and silu.op == "call_function" and silu.target is aten.silu.default
                and len(silu.users) == 1 and len(silu.args) == 1 and not silu.kwargs and isinstance(up, torch.fx.Node)):
            continue
        gate = silu.args[0]
        values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (mul, gate, up)]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        product = values[0]
        if (product.dtype in _DTYPES and product.is_contiguous()
                and all(v.dtype == product.dtype and v.shape == product.shape for v in values)):
            return gate, up
        return None
    return None
