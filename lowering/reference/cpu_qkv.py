"""An attention layer's QKV split, rotary embedding and cache write in one native call.

After the other CPU passes a Llama-style layer still goes from its merged QKV GEMM to its attention
kernel through ~20 calls: three slices of the GEMM's output, a view and a transpose for each of q,
k, v, two ``rotate_half_rope`` calls (with their ``cos`` / ``sin`` unsqueezed each layer), a squeeze
and a transpose for each of the three, and ``reshape_and_cache``. Each is a dispatch: in a decode
step of SmolLM2-135M (30 layers) they were ~600 of the step's ~1,500 Python-level calls.
:func:`fuse_qkv_rope_cache` replaces them by ``torch.ops.pagedpack_cpu.rope_qkv_and_cache``
(``kernels/csrc/rotary_cpu.cpp``: the same rotary roundings as ``rotate_half_rope``, the cache
write of ``reshape_and_cache``), which returns q, rotated, as ``paged_attention`` reads it.

It fuses only what it proves: the chains from the QKV output to the rotary inputs, to the cache
write's value, and from the rotary outputs to the cache write's key and the attention's query are
read as index maps (:func:`pagedpack.passes.view_chains.evaluate_views`) and must select, per token,
whole heads of consecutive columns, as the kernel reads them; ``cos`` / ``sin`` must hold one row
of ``D`` values per token. Anything else (a norm on q or k, as Qwen3's and Gemma-3's; another
rotary form; a cache of a second attention) stays as it is. The CPU lowering's example step then
checks the logits against the graph.
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_edit import finish_rewrite, set_fake_empty
from pagedpack.passes.view_chains import evaluate_views, index_tensor, view_source

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fuse_qkv_rope_cache(graph_module: torch.fx.GraphModule) -> int:
    """Replace each provable QKV-split / rotary / cache-write subgraph of ``graph_module`` (which
    calls the native kernels: after ``fuse_rotary`` and ``use_native_kernels``) by one
    ``rope_qkv_and_cache`` call (module docstring); returns how many."""
    native = native_ops()
    if native is None:
        return 0
    fused = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target is native.reshape_and_cache.default:
            found = _match(node, native.rotate_half_rope.default, native.paged_attention.default)
            if found is not None:
                attention, args = found
                with graph_module.graph.inserting_before(node):
                    query = graph_module.graph.call_function(native.rope_qkv_and_cache.default, args)
                qkv, num_heads, head_dim = args[0], args[4], args[6]
                value = qkv.meta["val"]
                set_fake_empty(query, qkv, (value.numel() // value.shape[-1], num_heads, head_dim))
                attention.replace_input_with(attention.args[0], query)
                graph_module.graph.erase_node(node)
                fused += 1
    return finish_rewrite(graph_module, fused)


def _match(cache_write: torch.fx.Node, rope, attention_op) -> tuple[torch.fx.Node, tuple] | None:
    """``(attention node, args of rope_qkv_and_cache)`` for the cache write ``cache_write``, or None."""
    if len(cache_write.args) != 5 or cache_write.kwargs:
        return None
    key, value, key_cache, value_cache, slot_mapping = cache_write.args
    readers = [n for n in key_cache.users if n.target is attention_op and n.args[1:3] == (key_cache, value_cache)]
    if len(readers) != 1:
        return None
    attention = readers[0]
    key_rope, query_rope = view_source(key), view_source(attention.args[0])
    if not all(isinstance(n, torch.fx.Node) and n.target is rope and len(n.args) == 3 and not n.kwargs
               for n in (key_rope, query_rope)):
        return None
    if query_rope is key_rope or key_rope.args[1:] != query_rope.args[1:]:
        return None
    qkv = view_source(query_rope.args[0])
    if view_source(key_rope.args[0]) is not qkv or view_source(value) is not qkv:
        return None
    qkv_value = qkv.meta.get("val")
    if not isinstance(qkv_value, torch.Tensor) or qkv_value.dtype not in _DTYPES:
        return None
    indices = index_tensor(qkv)
    if indices is None or indices.dim() < 1:
        return None
    width = indices.shape[-1]
    heads = []
    for rotary, out in ((query_rope, attention.args[0]), (key_rope, key), (None, value)):
        selected = _through_rotary(rotary, out, qkv, indices) if rotary is not None else \
            evaluate_views(out, qkv, indices)
        found = _heads(selected, width)
        if found is None:
            return None
        heads.append(found)
    (q_offset, num_heads, head_dim), (k_offset, num_kv_heads, k_dim), (v_offset, v_heads, v_dim) = heads
    if not (head_dim == k_dim == v_dim and num_kv_heads == v_heads and head_dim % 2 == 0):
        return None
    cos, sin = query_rope.args[1:]
    for rotary, offset in ((query_rope, q_offset), (key_rope, k_offset)):
        if not all(_per_token_rows(rotary, table, qkv, indices, offset, head_dim) for table in (cos, sin)):
            return None
    cos, sin = (_without_unsqueezes(t) for t in (cos, sin))
    return attention, (qkv, q_offset, k_offset, v_offset, num_heads, num_kv_heads, head_dim, cos, sin,
                       key_cache, value_cache, slot_mapping)


def _through_rotary(rotary: torch.fx.Node, out: torch.fx.Node, qkv: torch.fx.Node,
                    indices: torch.Tensor) -> torch.Tensor | None:
    """The QKV elements ``out`` holds (rotated), following the views into ``rotary`` and out of it:
    the rotary keeps each element where it is, pairing values only within the last dimension, which
    both chains must keep whole (checked: the rotary's input rows are runs of consecutive columns)."""
    inner = evaluate_views(rotary.args[0], qkv, indices)
    if inner is None or inner.dim() < 1 or not _consecutive_rows(inner):
        return None
    rows = index_tensor(rotary)
    outer = evaluate_views(out, rotary, rows) if rows is not None and rows.shape == inner.shape else None
    if outer is None or outer.dim() < 1 or outer.shape[-1] != inner.shape[-1] or not _consecutive_rows(outer):
        return None
    return inner.flatten()[outer]


def _heads(selected: torch.Tensor | None, width: int) -> tuple[int, int, int] | None:
    """``(offset, heads, head_dim)`` if ``selected`` (QKV element indices) is ``[T, heads, head_dim]``
    holding, for each token ``t``, the columns ``offset .. offset + heads * head_dim`` of row ``t``."""
    if selected is None or selected.dim() != 3 or selected.numel() == 0:
        return None
    tokens, heads, head_dim = selected.shape
    offset = int(selected[0, 0, 0])
    if offset >= width or offset + heads * head_dim > width:
        return None
    expected = (torch.arange(tokens)[:, None] * width + offset + torch.arange(heads * head_dim)).view(selected.shape)
    return (offset, heads, head_dim) if torch.equal(selected, expected) else None


def _per_token_rows(rotary: torch.fx.Node, table, qkv: torch.fx.Node, indices: torch.Tensor, offset: int,
                    head_dim: int) -> bool:
    """``table`` (``cos`` or ``sin``), broadcast to ``rotary``'s input (whose heads start at column
    ``offset``), gives each element the entry ``[token, column within its head]`` of ``table`` read
    as ``[T, head_dim]`` rows, as the kernel reads it."""
    value = table.meta.get("val") if isinstance(table, torch.fx.Node) else None
    x = rotary.args[0].meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(x, torch.Tensor) or value.dtype != x.dtype:
        return False
    width = indices.shape[-1]
    entries, inner = index_tensor(table), evaluate_views(rotary.args[0], qkv, indices)
    if entries is None or inner is None or entries.numel() != indices.numel() // width * head_dim:
        return False
    try:
        broadcast = entries.expand(inner.shape)
    except RuntimeError:
        return False
    return torch.equal(broadcast, inner // width * head_dim + (inner % width - offset) % head_dim)


def _consecutive_rows(t: torch.Tensor) -> bool:
    """Each row of ``t``'s last dimension is a run of consecutive indices."""
    return torch.equal(t - t[..., :1], torch.arange(t.shape[-1]).expand(t.shape))


def _without_unsqueezes(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` before any ``unsqueeze`` calls (the kernel reads ``cos`` / ``sin`` as ``[T, D]`` rows)."""
    while isinstance(node, torch.fx.Node) and node.target is aten.unsqueeze.default:
        node = node.args[0]
    return node
