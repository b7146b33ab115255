"""Rewrite one attention site to ``reshape_and_cache`` + ``paged_attention``.

Before (one sequence, batch 1): ``out = attention(q, repeat_kv(k), repeat_kv(v), mask)``, all in the
site's layout (``[1, H, T, D]``, or BLOOM's ``[H, T, D]``). After (a packed step of many sequences)::

    reshape_and_cache(k [T, Hkv, D], v [T, Hkv, D], key_cache, value_cache, slot_mapping)
    out [T, H, D] = paged_attention(q [T, H, D], key_cache, value_cache, block_table,
                                    cu_seqlens_q, seq_lens, scale, sliding_window=, logits_soft_cap=,
                                    alibi_slopes=)

and ``out`` is put back in the site's layout for the unchanged code after the site. A site that
reads an earlier site's cache (:mod:`pagedpack.passes.kv_sharing`) gets the ``paged_attention``
alone, on the owner's caches. Tensor
parameters (ALiBi slopes) become buffers of the graph module, read with ``get_attr``, so that the
``.pt2`` and ONNX exports carry them.
"""
from __future__ import annotations

import torch
from torch.fx import Node

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.passes.attention_sites import AttentionSite, from_tokens_first
from pagedpack.passes.graph_edit import set_fake_empty, set_fake_value
from pagedpack.passes.manager import PassContext, SiteRewritePass
from pagedpack.step.contract import KVCacheSpec


def params_kwargs(graph: torch.fx.Graph, site: AttentionSite) -> dict:
    """``site.params().op_kwargs()`` for a call emitted into ``graph``: each tensor (the ALiBi
    slopes) registered as a buffer ``<site>_<parameter>`` of the graph's module and passed as the
    ``get_attr`` node that reads it."""
    kwargs = site.params().op_kwargs()
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            target = f"{site.name}_{name}"
            graph.owning_module.register_buffer(target, value)
            kwargs[name] = graph.get_attr(target)
    return kwargs


def rewrite_site(graph: torch.fx.Graph, site: AttentionSite, *, key_cache: Node, value_cache: Node,
                 metadata: dict[str, Node], write: bool = True) -> Node:
    """Replace ``site`` in ``graph``; returns the new ``paged_attention`` node. ``write``: the site writes
    its K/V to the caches first (False: it reads caches an earlier site wrote). The views it adds
    and the attention output carry fake values (``meta["val"]``) as export's nodes do, so that the
    CPU lowering reads the fresh graph as it reads a loaded ``.pt2``."""

    def call(op, args):
        node = graph.call_function(op, args)
        set_fake_value(node)
        return node

    with graph.inserting_before(site.output):
        query, key, value = site.tokens_first(call=call)  # key and value unused without the write: dead code
        if write:
            graph.call_function(torch.ops.pagedpack.reshape_and_cache.default,
                                (key, value, key_cache, value_cache, metadata["slot_mapping"]))
        attention = graph.call_function(
            torch.ops.pagedpack.paged_attention.default,
            (query, key_cache, value_cache, metadata["block_table"], metadata["cu_seqlens_q"], metadata["seq_lens"]),
            params_kwargs(graph, site),  # scale and the per-call parameters, by name
        )
        if "val" in query.meta and "val" in value.meta:  # [T, H, Dv]
            set_fake_empty(attention, query, (*query.meta["val"].shape[:-1], value.meta["val"].shape[-1]))
        out = from_tokens_first(attention, site.layout, call)
    site.output.replace_all_uses_with(out)
    return attention


class PagedAttention(SiteRewritePass):
    """``paged_attention``: every site -> :func:`rewrite_site`. A site owning its cache
    (``ctx.cache_owners``) writes and reads the next cache pair, ``key_cache_<n>`` / ``value_cache_<n>``,
    and appends its :class:`~pagedpack.step.contract.KVCacheSpec` to ``ctx.kv_cache_specs``; a site
    sharing an earlier site's cache only reads that pair."""

    name = "paged_attention"
    requires = (*SiteRewritePass.requires, "cache_owners")
    provides = ("kv_cache_specs",)

    def rewrite_one(self, ctx: PassContext, index: int, site: AttentionSite) -> None:
        owner = ctx.cache_owners[index]
        number = sorted(set(ctx.cache_owners)).index(owner)
        rewrite_site(ctx.graph, site, key_cache=ctx.inputs[f"key_cache_{number}"],
                     value_cache=ctx.inputs[f"value_cache_{number}"], metadata=ctx.inputs, write=owner == index)
        if owner == index:
            ctx.kv_cache_specs.append(_cache_spec(site))


def _cache_spec(site: AttentionSite) -> KVCacheSpec:
    """The cache pair of ``site``, read off its pre-repeat K/V tensors (``[..., kv_heads, T, head_size]``
    in either layout)."""
    key, value = site.key_in_layout(site.key_source.meta["val"]), site.value_source.meta["val"]
    return KVCacheSpec(num_kv_heads=key.shape[-3], key_head_size=key.shape[-1],
                       value_head_size=value.shape[-1], dtype=key.dtype)
