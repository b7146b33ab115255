"""The rotary embedding in one kernel instead of seven.

``transformers`` applies a rotary embedding (RoPE, the "neox" / rotate-half form: Llama, Mistral,
Qwen, Gemma, Phi-3, GPT-NeoX, ...) as ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
cat(-x[..., D/2:], x[..., :D/2])`` (``modeling_llama.apply_rotary_pos_emb``): seven ops (two slices,
neg, cat, two muls, add) and four temporaries the size of ``x`` for each of q and k, each layer.
:func:`fuse_rotary` replaces each such subgraph by the native kernel
``torch.ops.pagedpack_cpu.rotate_half_rope`` (``kernels/csrc/rotary_cpu.cpp``: fp32, bf16, fp16,
each product and the sum rounded to the dtype where the graph rounds them, so a bf16 step's values
are the graph's bit for bit), or, without the native kernels, an fp32 subgraph by
:func:`rotate_half_rope`: ``x * cos``, then the two halves' ``sin`` terms added in place with
``addcmul_`` (three kernels, no temporaries). In fp32 either may fuse a multiply and an add (on
values of order 1, at most a few 1e-7 apart; the CPU lowering's check and the family tests hold the
tokens to the unmodified model's). Every other form (GPT-J's interleaved pairs, Cohere's, ...) is
left alone. On W1 (fp32, 8 layers, 2048-token prefill steps) the three-kernel form took a whole
generation 0.94x the time (1.49-1.54 s against 1.60-1.63 s).
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_edit import call_arg, finish_rewrite, replace_with_call

aten = torch.ops.aten


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + cat(-x2, x1) * sin`` with ``x1, x2`` the halves of ``x``'s last dimension
    (``D``, even); ``cos`` broadcasts against ``x``, ``sin`` (last dimension ``D``) into ``x * cos``."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def fuse_rotary(graph_module: torch.fx.GraphModule) -> int:
    """Replace each rotate-half rotary subgraph of ``graph_module`` by a call of the native kernel
    or, without it, each fp32 one by :func:`rotate_half_rope` (module docstring); returns how many
    were replaced."""
    native = native_ops()
    target = native.rotate_half_rope.default if native is not None else rotate_half_rope
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if native is not None else (torch.float32,)
    replaced = 0
    for node in list(graph_module.graph.nodes):
        found = _match(node, dtypes)
        if found is not None:
            replace_with_call(node, target, found)
            replaced += 1
    return finish_rewrite(graph_module, replaced)


def _match(add: torch.fx.Node, dtypes) -> tuple[torch.fx.Node, ...] | None:
    """``(x, cos, sin)`` if ``add`` is ``x * cos + cat(-x2, x1) * sin`` on tensors of one of
    ``dtypes``, else None."""
    if add.op != "call_function" or add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    for first, second in (add.args, add.args[::-1]):
        rotated = _operands(second, aten.mul.Tensor)
        plain = _operands(first, aten.mul.Tensor)
        if rotated is None or plain is None:
            continue
        for cat, sin in (rotated, rotated[::-1]):
            x = _rotate_half_of(cat)
            if x is not None and x in plain:
                cos = plain[1] if plain[0] is x else plain[0]
                return (x, cos, sin) if _fits(add, x, cos, sin, dtypes) else None
    return None


def _fits(add: torch.fx.Node, x: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node, dtypes) -> bool:
    """``x``, ``cos``, ``sin`` and the sum share a dtype of ``dtypes``; ``cos`` and ``sin`` (the
    latter of ``x``'s last dimension: its halves are sliced) broadcast to ``x``'s shape, the
    shape of the sum."""
    values = [node.meta.get("val") for node in (add, x, cos, sin)]
    if not all(isinstance(v, torch.Tensor) for v in values) or values[3].dim() < 1:
        return False
    total, x_val, cos_val, sin_val = values
    if total.dtype not in dtypes or any(v.dtype != total.dtype for v in values):
        return False
    try:
        return (sin_val.shape[-1] == x_val.shape[-1] and total.shape == x_val.shape
                and all(torch.broadcast_shapes(x_val.shape, v.shape) == x_val.shape for v in (cos_val, sin_val)))
    except RuntimeError:  # shapes that do not broadcast (or symbolic sizes it cannot decide)
        return False


def _operands(node, target) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    if not isinstance(node, torch.fx.Node) or node.target is not target or len(node.args) != 2 or node.kwargs:
        return None
    if len(node.users) != 1 or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    return node.args


def _rotate_half_of(cat: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` if ``cat`` is ``cat([-x[..., D/2:], x[..., :D/2]], -1)``, else None."""
    if cat.target is not aten.cat.default or len(cat.users) != 1:
        return None
    parts, dim = cat.args[0], call_arg(cat, 1, "dim", 0)
    if len(parts) != 2 or not isinstance(parts[0], torch.fx.Node) or parts[0].target is not aten.neg.default:
        return None
    upper, lower = parts[0].args[0], parts[1]
    if not all(isinstance(s, torch.fx.Node) and s.target is aten.slice.Tensor for s in (upper, lower)):
        return None
    x = lower.args[0]
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if upper.args[0] is not x or not isinstance(value, torch.Tensor) or dim not in (-1, value.dim() - 1):
        return None
    size = value.shape[-1]
    if not isinstance(size, int) or size % 2:
        return None
    half, last = size // 2, (-1, value.dim() - 1)
    return x if _slice(lower, last, 0, half, size) and _slice(upper, last, half, size, size) else None


def _slice(node: torch.fx.Node, dims, start: int, end: int, size: int) -> bool:
    """``node`` is ``x[..., start:end]`` (``end`` may be any value >= the dimension's ``size``)."""
    dim, lo, hi = call_arg(node, 1, "dim", 0), call_arg(node, 2, "start") or 0, call_arg(node, 3, "end")
    hi, step = size if hi is None else hi, call_arg(node, 4, "step", 1)
    to_the_end = end == size and isinstance(hi, int) and hi >= size
    return dim in dims and lo == start and step == 1 and (hi == end or to_the_end)
