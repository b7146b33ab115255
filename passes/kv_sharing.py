"""The ``kv_sharing`` pass: an attention site that attends over an earlier site's keys and values
reads that site's KV cache instead of keeping its own.

Gemma-3n and Gemma-4 (``num_kv_shared_layers`` in their configs) compute K/V in their first layers
only: each later layer attends over the K/V of the last earlier layer of its type (``transformers``
hands them over in ``shared_kv_states``). In the captured graph such a site's key and value before
``repeat_kv`` are the very nodes an earlier site's are (or views of them that change nothing), so the
cache the earlier site writes already holds them, written with the same ``slot_mapping``. The later
site (the *sharing* site) then gets no cache inputs, no :class:`~pagedpack.step.contract.KVCacheSpec`
and no ``reshape_and_cache``; its ``paged_attention`` reads the *owner*'s caches through the same
``block_table`` / ``seq_lens``, with its own parameters (scale, window, soft-cap).

Sharing is read off the graph, never off config names: two sites share only if their K/V are the
same values in the same layout, which is what makes skipping the second write exact.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from pagedpack.passes.attention_sites import AttentionSite
from pagedpack.passes.manager import Pass, PassContext, PassResult

aten = torch.ops.aten
# ops whose output holds the values of their first argument when its shape is unchanged
_SAME_VALUES = {aten.alias.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                aten.expand.default, aten.contiguous.default, aten.clone.default, aten.detach.default}


class ShareKVCache(Pass):
    """``kv_sharing``: fill ``ctx.cache_owners`` (:func:`cache_owners`) and say in the report which
    site reads whose cache. Counts: matched = sites reading an earlier site's cache."""

    name = "kv_sharing"
    mutates = False
    requires = ("sites", "records")
    provides = ("cache_owners",)

    def __call__(self, ctx: PassContext) -> PassResult:
        ctx.cache_owners = cache_owners(ctx.sites)
        shared = [(i, owner) for i, owner in enumerate(ctx.cache_owners) if owner != i]
        for i, owner in shared:
            ctx.records[i].kv_cache_of = _where(ctx.sites[owner])
        if shared:
            pairs = ", ".join(f"{_where(ctx.sites[i])} -> {_where(ctx.sites[owner])}" for i, owner in shared)
            ctx.report.notes.append(f"kv sharing: {len(shared)} site(s) read an earlier site's KV cache (same K/V "
                                    f"values), {len(ctx.sites) - len(shared)} cache pair(s) for "
                                    f"{len(ctx.sites)} sites: {pairs}")
        return PassResult(matched=len(shared))


def cache_owners(sites: list[AttentionSite]) -> list[int]:
    """For each of ``sites`` (in graph order), the index of the site whose cache it reads: its own
    index if it owns one, else the first earlier site whose key and value before ``repeat_kv`` are the
    same values (:func:`value_root`) in the same layout."""
    owners, first = [], {}
    for i, site in enumerate(sites):
        key = (value_root(site.key_source), value_root(site.value_source), site.layout, site.key_transposed)
        owners.append(first.setdefault(key, i))
    return owners


def value_root(node: Node) -> Node:
    """``node``, or the node it is a copy or a same-shape view of (through any chain of them)."""
    while (node.op == "call_function" and node.target in _SAME_VALUES and node.args
           and isinstance(node.args[0], Node) and _shape(node) is not None and _shape(node) == _shape(node.args[0])):
        node = node.args[0]
    return node


def _shape(node: Node):
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _where(site: AttentionSite) -> str:
    return f"layer {site.layer} ({site.name})" if site.layer is not None else site.name
