"""RMSNorm in one native kernel, fused with the residual add before it.

``transformers`` computes an RMSNorm (``LlamaRMSNorm``: Llama, Mistral, Qwen2/3, SmolLM, Phi-3, ...)
as ``weight * (h * rsqrt(mean(h ** 2, -1, keepdim=True) + eps))``: six kernels, each a dispatch from
the step's Python code and, but for the mean, a temporary the size of ``h``; twice a layer. In a
decode step those dispatches, not the arithmetic, are the cost (SmolLM2, 30 layers: 360 calls a
step). :func:`fuse_rms_norms` replaces each such subgraph by
``torch.ops.pagedpack_cpu.rms_norm(h, weight, eps)`` (``kernels/csrc/rms_norm_cpu.cpp``) and, where
``h`` is itself ``x + residual``, by ``fused_add_rms_norm(x, residual, weight, eps)``, which returns
the norm and the sum (the next residual) from one pass over the rows, as vLLM's kernel of that name
does in place. In an fp32 graph the norm is those six ops; in a bf16 / fp16 one ``LlamaRMSNorm``
casts ``h`` to fp32, computes the norm there, casts it back and multiplies by the weight in ``h``'s
dtype (eight ops), and the kernel rounds where those casts do. The results differ from the graph's
by the sum of squares' rounding alone (accumulated in vector lanes); the CPU lowering's check
holds the step's logits to the graph's. The weight may be computed (Gemma's ``1 + weight``); it is
fused with the residual add only when it is computed before that add. Other forms (Gemma's, which
multiplies by the weight in fp32 before casting back, matches as an fp32 norm of the cast input;
LayerNorm; a sum of squares) are left alone.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_attrs import attr_tensor
from pagedpack.passes.graph_edit import finish_rewrite, replace_with_call

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CASTS = (aten.to.dtype, aten._to_copy.default)


def fuse_rms_norms(graph_module: torch.fx.GraphModule) -> tuple[int, int]:
    """Replace each RMSNorm subgraph of ``graph_module`` (module docstring) by a native call;
    returns ``(norms replaced, of them fused with their residual add)``; ``(0, 0)`` without the
    native kernels."""
    native = native_ops()
    if native is None:
        return 0, 0
    order = {node: i for i, node in enumerate(graph_module.graph.nodes)}
    norms = fused = 0
    for node in list(graph_module.graph.nodes):
        found = _match(graph_module, node)
        if found is None:
            continue
        h, weight, eps = found
        residual_add = _residual_add(h, weight, order)
        if residual_add is None:
            replace_with_call(node, native.rms_norm.default, (h, weight, eps))
        else:
            graph = graph_module.graph
            with graph.inserting_after(h):
                both = graph.call_function(native.fused_add_rms_norm.default, (*residual_add, weight, eps))
            with graph.inserting_after(both):
                normed = graph.call_function(operator.getitem, (both, 0))
            with graph.inserting_after(normed):
                total = graph.call_function(operator.getitem, (both, 1))
            normed.meta.update(node.meta)
            total.meta.update(h.meta)
            node.replace_all_uses_with(normed)
            h.replace_all_uses_with(total)
            fused += 1
        norms += 1
    finish_rewrite(graph_module, norms)
    return norms, fused


def _match(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, float] | None:
    """``(h, weight, eps)`` if ``node`` is ``weight * (h * rsqrt(mean(h ** 2, -1, True) + eps))`` on
    fp32 tensors, or ``weight * to(to(h, fp32) * rsqrt(...), dtype)`` on bf16 / fp16 ones, ``weight``
    of shape ``[D]`` and ``h``'s dtype for ``h`` of ``[..., D]``; else None."""
    value = node.meta.get("val")
    if not (_call(node, aten.mul.Tensor) and isinstance(value, torch.Tensor) and value.dtype in _DTYPES):
        return None
    low_precision = value.dtype != torch.float32
    for weight, scaled in (node.args, node.args[::-1]):
        if not isinstance(weight, torch.fx.Node) or len(getattr(scaled, "users", ())) != 1:
            continue
        if low_precision:  # the norm in fp32 cast back to the weight's dtype
            scaled = _cast_source(scaled, value.dtype)
        if not (_call(scaled, aten.mul.Tensor) and len(scaled.users) == 1):
            continue
        for x, rsqrt in (scaled.args, scaled.args[::-1]):
            h = _cast_source(x, torch.float32) if low_precision else x
            eps = _inverse_rms_of(rsqrt, x)
            if h is not None and eps is not None and _weight_fits(gm, weight, h, value.dtype):
                return h, weight, eps
    return None


def _cast_source(node, dtype: torch.dtype) -> torch.fx.Node | None:
    """``x`` if ``node`` is a conversion ``to(x, dtype)`` of a tensor of another dtype, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _CASTS and node.args):
        return None
    source, value = node.args[0], node.meta.get("val")
    before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) and value.dtype == dtype != before.dtype:
        return source
    return None


def _inverse_rms_of(rsqrt, h) -> float | None:
    """``eps`` if ``rsqrt`` is ``rsqrt(mean(h ** 2, -1, keepdim=True) + eps)``, else None."""
    if not (_call(rsqrt, aten.rsqrt.default) and len(rsqrt.users) == 1):
        return None
    add = rsqrt.args[0]
    if not (_call(add, aten.add.Tensor) and len(add.users) == 1 and len(add.args) == 2 and not add.kwargs):
        return None
    mean, eps = add.args
    if not isinstance(eps, float) or not (_call(mean, aten.mean.dim) and len(mean.users) == 1):
        return None
    if mean.kwargs or len(mean.args) != 3 or mean.args[2] is not True or not _is_last_dim(mean.args[1], h):
        return None
    square = mean.args[0]
    if not (_call(square, aten.pow.Tensor_Scalar) and len(square.users) == 1 and square.args[0] is h):
        return None
    return eps if square.args[1] == 2 else None


def _residual_add(h: torch.fx.Node, weight: torch.fx.Node, order) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(x, residual)`` if ``h`` is ``x + residual`` of two tensors of ``h``'s shape and dtype and
    ``weight`` is defined before it (the fused call takes ``h``'s place), else None."""
    if not (_call(h, aten.add.Tensor) and len(h.args) == 2 and not h.kwargs and order[weight] < order[h]):
        return None
    values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in h.args]
    total = h.meta.get("val")
    if not all(isinstance(v, torch.Tensor) and v.dtype == total.dtype and v.shape == total.shape for v in values):
        return None
    return h.args


def _weight_fits(gm: torch.fx.GraphModule, weight: torch.fx.Node, h: torch.fx.Node, dtype: torch.dtype) -> bool:
    w, x = weight.meta.get("val", attr_tensor(gm, weight)), h.meta.get("val")
    return (isinstance(w, torch.Tensor) and isinstance(x, torch.Tensor) and w.dtype == x.dtype == dtype
            and w.dim() == 1 and x.dim() >= 1 and w.shape[0] == x.shape[-1])


def _is_last_dim(dims, h: torch.fx.Node) -> bool:
    value = h.meta.get("val")
    return (isinstance(dims, (list, tuple)) and len(dims) == 1 and isinstance(value, torch.Tensor)
            and dims[0] in (-1, value.dim() - 1))


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
