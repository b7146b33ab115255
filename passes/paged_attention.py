"""Rewrite one attention site to ``reshape_and_cache`` + ``paged_attention``.

Before (one sequence, batch 1): ``out [1, H, T, D] = attention(q [1, H, T, D], repeat_kv(k), repeat_kv(v), mask)``.
After (a packed step of many sequences)::

    reshape_and_cache(k [T, Hkv, D], v [T, Hkv, D], key_cache, value_cache, slot_mapping)
    out [T, H, D] = paged_attention(q [T, H, D], key_cache, value_cache, block_table,
                                    cu_seqlens_q, seq_lens, scale)

and ``out`` is viewed back to ``[1, H, T, D]`` for the unchanged code after the site.
"""
from __future__ import annotations

import torch
from torch.fx import Node

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.contract import KVCacheSpec
from pagedpack.passes.attention_sites import AttentionSite, default_scale
from pagedpack.passes.manager import PassContext, SiteRewritePass

aten = torch.ops.aten


def heads_first_to_tokens_first(graph: torch.fx.Graph, node: Node) -> Node:
    """``[1, heads, T, D] -> [T, heads, D]``."""
    squeezed = graph.call_function(aten.squeeze.dim, (node, 0))
    return graph.call_function(aten.transpose.int, (squeezed, 0, 1))


def rewrite_site(graph: torch.fx.Graph, site: AttentionSite, *, key_cache: Node, value_cache: Node,
                 metadata: dict[str, Node]) -> Node:
    """Replace ``site`` in ``graph``; returns the new ``paged_attention`` node."""
    with graph.inserting_before(site.output):
        query = heads_first_to_tokens_first(graph, site.query)
        key = heads_first_to_tokens_first(graph, site.key_source)
        value = heads_first_to_tokens_first(graph, site.value_source)
        graph.call_function(torch.ops.pagedpack.reshape_and_cache.default,
                            (key, value, key_cache, value_cache, metadata["slot_mapping"]))
        attention = graph.call_function(
            torch.ops.pagedpack.paged_attention.default,
            (query, key_cache, value_cache, metadata["block_table"], metadata["cu_seqlens_q"],
             metadata["seq_lens"], default_scale(site)),
        )
        heads_first = graph.call_function(aten.transpose.int, (attention, 0, 1))
        out = graph.call_function(aten.unsqueeze.default, (heads_first, 0))
    site.output.replace_all_uses_with(out)
    return attention


class PagedAttention(SiteRewritePass):
    """``paged_attention``: every site -> :func:`rewrite_site` on layer ``i``'s cache inputs; appends
    one :class:`~pagedpack.contract.KVCacheSpec` per site to ``ctx.kv_cache_specs``."""

    name = "paged_attention"

    def rewrite_one(self, ctx: PassContext, index: int, site: AttentionSite) -> None:
        rewrite_site(ctx.graph, site, key_cache=ctx.inputs[f"key_cache_{index}"],
                     value_cache=ctx.inputs[f"value_cache_{index}"], metadata=ctx.inputs)
        ctx.kv_cache_specs.append(_cache_spec(site))


def _cache_spec(site: AttentionSite) -> KVCacheSpec:
    """The cache pair of ``site``, read off its pre-repeat K/V tensors ``[1, kv_heads, T, head_size]``."""
    key, value = site.key_source.meta["val"], site.value_source.meta["val"]
    return KVCacheSpec(num_kv_heads=key.shape[1], key_head_size=key.shape[-1],
                       value_head_size=value.shape[-1], dtype=key.dtype)
