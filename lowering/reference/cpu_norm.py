"""RMSNorm in one native kernel, fused with the residual add before it.

``transformers`` computes an RMSNorm (``LlamaRMSNorm``: Llama, Mistral, Qwen2/3, SmolLM, Phi-3, ...)
as ``weight * (h * rsqrt(mean(h ** 2, -1, keepdim=True) + eps))``: six kernels, each a dispatch from
the step's Python code and, but for the mean, a temporary the size of ``h``; twice a layer. In a
decode step those dispatches, not the arithmetic, are the cost (SmolLM2, 30 layers: 360 calls a
step). :func:`fuse_rms_norms` replaces each such fp32 subgraph by
``torch.ops.pagedpack_cpu.rms_norm(h, weight, eps)`` (``kernels/csrc/rms_norm_cpu.cpp``) and, where
``h`` is itself ``x + residual``, by ``fused_add_rms_norm(x, residual, weight, eps)``, which returns
the norm and the sum (the next residual) from one pass over the rows, as vLLM's kernel of that name
does in place. The results differ from the graph's by rounding alone (the sum of squares is
accumulated in vector lanes); the CPU lowering's check holds the step's logits to the graph's.
The weight may be computed (Gemma's ``1 + weight``); it is fused with the residual add only when
it is computed before that add. Other dtypes (where the graph casts to fp32 and back) and other
formulas (LayerNorm, a sum of squares) are left alone.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_attrs import attr_tensor
from pagedpack.passes.graph_edit import finish_rewrite, is_fp32, replace_with_call

aten = torch.ops.aten


def fuse_rms_norms(graph_module: torch.fx.GraphModule) -> tuple[int, int]:
    """Replace each fp32 RMSNorm subgraph of ``graph_module`` (module docstring) by a native call;
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
    fp32 tensors, ``weight`` of shape ``[D]`` for ``h`` of ``[..., D]``; else None."""
    if not _call(node, aten.mul.Tensor) or not is_fp32(node):
        return None
    for weight, scaled in (node.args, node.args[::-1]):
        if not (_call(scaled, aten.mul.Tensor) and len(scaled.users) == 1 and isinstance(weight, torch.fx.Node)):
            continue
        for h, rsqrt in (scaled.args, scaled.args[::-1]):
            eps = _inverse_rms_of(rsqrt, h)
            if eps is not None and _weight_fits(gm, weight, h):
                return h, weight, eps
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
    """``(x, residual)`` if ``h`` is ``x + residual`` of two fp32 tensors of ``h``'s shape and
    ``weight`` is defined before it (the fused call takes ``h``'s place), else None."""
    if not (_call(h, aten.add.Tensor) and len(h.args) == 2 and not h.kwargs and order[weight] < order[h]):
        return None
    values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in h.args]
    total = h.meta.get("val")
    if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.shape == total.shape for v in values):
        return None
    return h.args


def _weight_fits(gm: torch.fx.GraphModule, weight: torch.fx.Node, h: torch.fx.Node) -> bool:
    w, x = weight.meta.get("val", attr_tensor(gm, weight)), h.meta.get("val")
    return (isinstance(w, torch.Tensor) and isinstance(x, torch.Tensor) and w.dtype == x.dtype == torch.float32
            and w.dim() == 1 and x.dim() >= 1 and w.shape[0] == x.shape[-1])


def _is_last_dim(dims, h: torch.fx.Node) -> bool:
    value = h.meta.get("val")
    return (isinstance(dims, (list, tuple)) and len(dims) == 1 and isinstance(value, torch.Tensor)
            and dims[0] in (-1, value.dim() - 1))


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
