"""A gated MLP's ``act(gate) * up`` in one native kernel (SiLU, or GELU's tanh form).

``transformers``' gated MLPs compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: with SiLU
(``LlamaMLP``: Llama, Mistral, Qwen2/3, SmolLM, ...) or with ``gelu_pytorch_tanh`` (Gemma's GeGLU,
``gelu(gate, approximate="tanh")``); after the linear merge (:mod:`pagedpack.passes.linear_merge`)
``gate`` and ``up`` are the two halves of one GEMM's output. ATen runs the activation and ``mul`` as
two kernels with an ``act(gate)`` temporary between them, each a pass over ``[T, I]`` values and a
dispatch. :func:`fuse_gated_activations` replaces each ``mul(act(gate), up)`` (either order) on two
tensors of one shape and dtype by ``torch.ops.pagedpack_cpu.silu_and_mul(gate, up)`` or
``gelu_tanh_and_mul(gate, up)`` (``kernels/csrc/silu_and_mul_cpu.cpp``, vLLM's kernels of those names
on the two halves), which round where ATen's two ops round. SiLU: a bf16 / fp16 step's values are the
graph's bit for bit; in fp32 a value may move by an ulp where ATen computes its exp with the scalar
function and the kernel with the vector one (the tails of ATen's per-thread shares). GELU (tanh): the
same, and ATen's own result moves with the layout the same way (``1 + tanh`` cancels where the
gate is very negative, so a scalar and a vector tanh there give, say, -0.0 and -2e-7). A product laid
out other than row-major (transposed operands: ATen's ``mul`` keeps their layout, the kernel writes
rows) is left alone, as are other activations (GELU's erf form). The reference target's CPU
lowering (:mod:`pagedpack.lowering.reference.cpu`) applies this before it chunks the MLPs and checks
the lowered step against the graph. Measurements: ``docs/cpu-kernels.md``.
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_edit import finish_rewrite, replace_with_call

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gated_activation_kernels(native) -> tuple:
    """The native ``act(gate) * up`` kernels (``silu_and_mul``, ``gelu_tanh_and_mul``) of ``native``."""
    return native.silu_and_mul.default, native.gelu_tanh_and_mul.default


def fuse_gated_activations(graph_module: torch.fx.GraphModule) -> int:
    """Replace each ``silu(gate) * up`` and ``gelu(gate, approximate="tanh") * up`` of
    ``graph_module`` by its native kernel's call (module docstring); returns how many (0 without the
    native kernels)."""
    native = native_ops()
    if native is None:
        return 0
    silu_and_mul, gelu_tanh_and_mul = gated_activation_kernels(native)
    replaced = 0
    for node in list(graph_module.graph.nodes):
        found = _match(node)
        if found is not None:
            activation, gate, up = found
            replace_with_call(node, silu_and_mul if activation == "silu" else gelu_tanh_and_mul, (gate, up))
            replaced += 1
    return finish_rewrite(graph_module, replaced)


def _activation(node) -> str | None:
    """``"silu"`` or ``"gelu_tanh"`` if ``node`` is that activation of one tensor, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if node.target is aten.silu.default and len(node.args) == 1 and not node.kwargs:
        return "silu"
    if node.target is aten.gelu.default and len(node.args) + len(node.kwargs) <= 2:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate == "tanh" and set(node.kwargs) <= {"approximate"}:
            return "gelu_tanh"
    return None


def _match(mul: torch.fx.Node) -> tuple[str, torch.fx.Node, torch.fx.Node] | None:
    """``(activation, gate, up)`` if ``mul`` is ``act(gate) * up`` or ``up * act(gate)``, the
    activation used by ``mul`` alone, the two operands and the product of one shape and of one dtype
    of :data:`_DTYPES` (no broadcast, no type promotion), the product row-major (as the kernel writes
    it), else None."""
    if mul.op != "call_function" or mul.target is not aten.mul.Tensor or len(mul.args) != 2 or mul.kwargs:
        return None
    for act, up in (mul.args, mul.args[::-1]):
        activation = _activation(act)
        if activation is None or len(act.users) != 1 or not isinstance(up, torch.fx.Node):
            continue
        gate = act.args[0]
        values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (mul, gate, up)]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        product = values[0]
        if (product.dtype in _DTYPES and product.is_contiguous()
                and all(v.dtype == product.dtype and v.shape == product.shape for v in values)):
            return activation, gate, up
        return None
    return None
