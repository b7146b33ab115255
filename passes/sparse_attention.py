"""The ``sparse_attention`` pass: each sparse-attention (DSA) layer's indexer and attention, as the
capture's seam recorded them (:mod:`pagedpack.models.seams`), over the packed, paged step.

An indexer (one per full DSA layer; GLM-MoE-DSA's "shared" layers reuse the previous one's top-k)::

    topk [S, K] = indexer_topk(q_idx [S, Hi, Di], weights [S, Hi], k_idx [S, Di], scale, K)
    ->  indexer_k_cache(k_idx, key_cache_j, slot_mapping)
        topk [T, K] = paged_indexer_topk(q_idx, weights, key_cache_j, block_table, cu_seqlens_q, seq_lens, scale, K)

its keys in a key-only cache pair ``j`` (:func:`~pagedpack.step.contract.indexer_cache_spec`), and an attention::

    o [S, H, Dv] = sparse_attention(q [S, H, D], k [S, Hkv, D], v [S, Hkv, Dv], topk, scale)
    ->  reshape_and_cache(k, v, key_cache_i, value_cache_i, slot_mapping)
        o [T, H, Dv] = sparse_paged_attention(q, key_cache_i, value_cache_i, topk, block_table, cu_seqlens_q,
                                              seq_lens, scale)

(:mod:`pagedpack.kernels.sparse_attention`). The cache pairs are added after those of the dense
attention sites, one per op in graph order, with a :class:`~pagedpack.step.contract.KVCacheSpec` each.
Every selection and read is within a sequence's own cached keys; ``sequence_independence`` checks the
packed step against the captured graph per sequence.
"""
from __future__ import annotations

import torch
from torch.fx import Node

import pagedpack.kernels.ops  # noqa: F401  (registers reshape_and_cache)
import pagedpack.kernels.sparse_attention  # noqa: F401  (registers the DSA ops)
from pagedpack.passes.attention_sites import layer_index
from pagedpack.passes.graph_edit import replace_with_call
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.report import SiteRecord
from pagedpack.step.contract import KVCacheSpec, cache_input_names, indexer_cache_spec

pagedpack = torch.ops.pagedpack
INDEXER_TOPK = pagedpack.indexer_topk.default
SPARSE_ATTENTION = pagedpack.sparse_attention.default
# the capture's one-sequence ops, which no step graph may keep (passes/postcondition.py)
PROMPT_OPS = (INDEXER_TOPK, SPARSE_ATTENTION)


class PagedSparseAttention(Pass):
    """``sparse_attention``: every capture-form DSA op -> its paged form (module docstring), each on a
    cache pair of its own; appends their :class:`KVCacheSpec` s to ``ctx.kv_cache_specs``. The paged
    ops take the captured ops' fake values (the same ``[T, ...]`` shapes).
    Counts: matched = rewritten = the ops."""

    name = "sparse_attention"
    requires = ("inputs", "kv_cache_specs")

    def __call__(self, ctx: PassContext) -> PassResult:
        graph = ctx.graph
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in PROMPT_OPS]
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        for node in nodes:
            index = len(ctx.kv_cache_specs)
            for name in cache_input_names(index + 1)[-2:]:
                with graph.inserting_after(last):
                    last = ctx.inputs[name] = graph.placeholder(name)
            caches = ctx.inputs[f"key_cache_{index}"], ctx.inputs[f"value_cache_{index}"]
            if node.target is INDEXER_TOPK:
                ctx.kv_cache_specs.append(_indexer(node, *caches, ctx.inputs))
            else:
                ctx.kv_cache_specs.append(_attention(node, *caches, ctx.inputs))
                ctx.report.sites.append(SiteRecord(node.name, "sparse", layer_index(node), rewritten=True,
                                                   params=f"sparse top-{_index_topk(node)}"))
            graph.erase_node(node)
        return PassResult(matched=len(nodes), rewritten=len(nodes))


def _index_topk(attention: Node) -> int:
    """The ``index_topk`` of the indexer whose top-k ``attention`` reads (through GLM's shared layers'
    reuse, the same node)."""
    return attention.args[3].meta["val"].shape[-1]


def _indexer(node: Node, key_cache: Node, value_cache: Node, meta: dict[str, Node]) -> KVCacheSpec:
    q, weights, k, scale, index_topk = node.args
    with node.graph.inserting_before(node):
        node.graph.call_function(pagedpack.indexer_k_cache.default, (k, key_cache, meta["slot_mapping"]))
    replace_with_call(node, pagedpack.paged_indexer_topk.default,
                      (q, weights, key_cache, meta["block_table"], meta["cu_seqlens_q"], meta["seq_lens"], scale,
                       index_topk))
    key = k.meta["val"]
    return indexer_cache_spec(key.shape[-1], key.dtype)


def _attention(node: Node, key_cache: Node, value_cache: Node, meta: dict[str, Node]) -> KVCacheSpec:
    query, key, value, topk, scale = node.args
    with node.graph.inserting_before(node):
        node.graph.call_function(pagedpack.reshape_and_cache.default,
                                 (key, value, key_cache, value_cache, meta["slot_mapping"]))
    replace_with_call(node, pagedpack.sparse_paged_attention.default,
                      (query, key_cache, value_cache, topk, meta["block_table"], meta["cu_seqlens_q"],
                       meta["seq_lens"], scale))
    key_val, value_val = key.meta["val"], value.meta["val"]
    return KVCacheSpec(num_kv_heads=key_val.shape[1], key_head_size=key_val.shape[2],
                       value_head_size=value_val.shape[2], dtype=key_val.dtype)
