"""Sparse attention with a lightning indexer (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-MoE-DSA).

Each DSA layer scores every visible key with a small *indexer* and attends only to the
``index_topk`` best-scoring ones. With ``q_idx [T, Hi, Di]``, ``weights [T, Hi]`` (the indexer's
per-head weights, already times ``Hi ** -0.5``) and the index keys ``k_idx [L, Di]`` of the query's
own sequence, a query row's score of key ``j`` is (transformers' ``DeepseekV32Indexer.forward``,
the DeepSeek-V3.2 reference's ``Indexer`` without its Hadamard rotation and fp8 rounding)::

    index_score[j] = sum_h weights[h] * relu(scale * q_idx[h] . k_idx[j])

over the keys the row sees (causal, aligned bottom-right as in ``paged_attention``: row ``i`` of a
sequence with ``q_len`` new tokens and ``seq_len`` keys sees ``0 .. seq_len - q_len + i``). The row's
top-k are the positions (within its sequence) of its ``min(index_topk, visible)`` best keys, in
descending score, the rest of the ``index_topk`` entries ``-1`` (vLLM's padding). Keys of equal score
are taken earliest first (a stable sort), so the choice is the same however a prompt is chunked;
transformers' ``torch.topk`` breaks exact ties its own way, which can change with the row's length
(a tiny random indexer with few heads ties often, every head's ReLU at zero; a trained one rarely).
Attention then reads only the selected keys: ``softmax(q k_sel^T * scale) v_sel``.

The ops, named after vLLM's DeepSeek-V3.2 path (``indexer_k_quant_and_cache``, the paged top-k
indexer, ``flash_mla_sparse_fwd``) without its fp8 quantization:

* ``indexer_k_cache(k [T, Di], index_cache [num_blocks, block_size, 1, Di], slot_mapping [T])``:
  write this step's index keys by ``slot_mapping`` (-1: nothing), as ``reshape_and_cache`` writes K/V.
* ``paged_indexer_topk(q [T, Hi, Di], weights [T, Hi], index_cache, block_table, cu_seqlens_q,
  seq_lens, scale, index_topk) -> int32 [T, index_topk]``: each row's top-k over its own
  sequence's cached index keys only.
* ``sparse_paged_attention(query [T, H, D], key_cache, value_cache, topk_indices [T, K],
  block_table, cu_seqlens_q, seq_lens, scale) -> [T, H, Dv]``: attention over each row's selected
  keys of its own sequence (grouped-query: head ``h`` reads KV head ``h // (H // Hkv)``).
* ``indexer_topk`` and ``sparse_attention``: the same for one sequence of ``S`` tokens without a
  cache (every key visible to the rows after it), the form the capture records
  (:mod:`pagedpack.models.seams`) and the ``sparse_attention`` pass rewrites
  (:mod:`pagedpack.passes.sparse_attention`).

The caches are those of :class:`~pagedpack.step.contract.KVCacheSpec` (the index cache a key-only
one, :func:`~pagedpack.step.contract.indexer_cache_spec`), in a floating dtype or a scaled one
(``kv_cache_dtype`` int8 / fp8: rows quantized as ``reshape_and_cache`` quantizes them,
:mod:`pagedpack.kernels.kv_quant`). Scores and attention are computed in fp32 (fp64 stays fp64),
outputs in the query's dtype. Reference kernels in plain PyTorch, one sequence at a time; argument
shapes and dtypes are checked by the fake and real kernels, metadata values where read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedpack.kernels.kv_quant import dequantize_rows, head_size, is_scaled, quantize_rows
from pagedpack.kernels.ops import _bottom_right_causal, _check_dtype, _check_rank, _require
from pagedpack.step.contract import SCALED_KV_DTYPES

_INDEX_CACHE_LAYOUT = "[num_blocks, block_size, 1, index_head_dim]"
_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CACHE_DTYPES = _FLOATS + SCALED_KV_DTYPES


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_metadata(op: str, block_table: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor) -> None:
    for arg, t, layout in (("block_table", block_table, "[B, max_blocks_per_seq]"),
                           ("cu_seqlens_q", cu_seqlens_q, "[B + 1]"), ("seq_lens", seq_lens, "[B]")):
        _check_rank(op, arg, t, layout)
        _check_dtype(op, arg, t, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    _require(cu_seqlens_q.shape[0] == num_seqs + 1, op, "cu_seqlens_q", f"B + 1 = {num_seqs + 1} entries",
             cu_seqlens_q.shape[0])
    _require(block_table.shape[0] == num_seqs, op, "block_table", f"B = {num_seqs} rows", block_table.shape[0])


def _check_indexer(op: str, q: Tensor, weights: Tensor, key_dim: int, index_topk: int) -> None:
    _check_rank(op, "q", q, "[T, index_n_heads, index_head_dim]")
    _check_rank(op, "weights", weights, "[T, index_n_heads]")
    _check_dtype(op, "q", q, _FLOATS)
    _check_dtype(op, "weights", weights, _FLOATS)
    _require(tuple(weights.shape) == tuple(q.shape[:2]), op, "weights", f"shape {tuple(q.shape[:2])} like q[:, :, 0]",
             tuple(weights.shape))
    _require(q.shape[2] == key_dim, op, "q", f"index_head_dim = {key_dim} like the index keys", q.shape[2])
    _require(index_topk >= 1, op, "index_topk", "an int >= 1", index_topk)


def _check_sparse(op: str, query: Tensor, key_heads: int, key_dim: int, topk_indices: Tensor) -> None:
    _check_rank(op, "query", query, "[T, num_heads, head_dim]")
    _check_dtype(op, "query", query, _FLOATS)
    _require(query.shape[1] % key_heads == 0, op, "query", f"num_heads divisible by num_kv_heads={key_heads}",
             query.shape[1])
    _require(query.shape[2] == key_dim, op, "query", f"head_dim = {key_dim} like the keys", query.shape[2])
    _check_rank(op, "topk_indices", topk_indices, "[T, index_topk]")
    _check_dtype(op, "topk_indices", topk_indices, (torch.int32,))
    _require(topk_indices.shape[0] == query.shape[0], op, "topk_indices", f"T = {query.shape[0]} rows like query",
             topk_indices.shape[0])


def topk_rows(q: Tensor, weights: Tensor, k: Tensor, scale: float, index_topk: int) -> Tensor:
    """One sequence's rows: ``q [n, Hi, Di]``, ``weights [n, Hi]`` and the sequence's index keys
    ``k [L, Di]`` (the rows are its last ``n`` tokens) -> int32 ``[n, index_topk]`` (module docstring)."""
    n, length = q.shape[0], k.shape[0]
    dtype = _compute_dtype(q)
    scores = F.relu(torch.matmul(q.to(dtype), k.to(dtype).T) * scale)  # [n, Hi, L]
    index_scores = torch.matmul(weights.to(dtype)[:, None, :], scores)[:, 0]  # [n, L]
    visible = _bottom_right_causal(n, length, q.device)
    index_scores = index_scores.masked_fill(~visible, float("-inf"))
    values, indices = index_scores.sort(dim=-1, descending=True, stable=True)  # ties: the earlier key
    values, indices = values[:, :index_topk], indices[:, :index_topk]
    indices = torch.where(values == float("-inf"), -1, indices).to(torch.int32)
    return F.pad(indices, (0, index_topk - indices.shape[1]), value=-1)


def sparse_rows(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor, scale: float) -> Tensor:
    """One sequence's rows: ``query [n, H, D]`` over its keys ``key [L, Hkv, D]``, ``value [L, Hkv,
    Dv]``, each row reading only the keys ``topk_indices [n, K]`` names (-1: none) -> ``[n, H, Dv]``
    in the query's dtype; a row that names no key gives zeros."""
    length = key.shape[0]
    slots = torch.where(topk_indices < 0, length, topk_indices).long()  # -1 -> a column dropped below
    selected = torch.zeros(query.shape[0], length + 1, dtype=torch.bool, device=query.device)
    selected = selected.scatter(1, slots, True)[:, :length]
    dtype = _compute_dtype(query)
    n_rep = query.shape[1] // key.shape[1]
    q, k, v = (t.to(dtype).transpose(0, 1) for t in (query, key.repeat_interleave(n_rep, 1),
                                                       value.repeat_interleave(n_rep, 1)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=selected, scale=scale)  # [H, n, Dv]
    out = torch.where(selected.any(-1)[:, None], out, 0.0)
    return out.transpose(0, 1).contiguous().to(query.dtype)


def _sequence_rows(cu_seqlens_q: Tensor, seq_lens: Tensor, op: str, num_tokens: int):
    """``(b, start, end, seq_len)`` per sequence, after checking the values."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    _require(cu[0] == 0 and cu[-1] == num_tokens and all(a <= b for a, b in zip(cu, cu[1:])), op, "cu_seqlens_q",
             f"non-decreasing offsets from 0 to T={num_tokens}", cu)
    for b, seq_len in enumerate(lens):
        _require(seq_len >= cu[b + 1] - cu[b], op, "seq_lens", f"seq_lens[{b}] >= its q_len", seq_len)
        yield b, cu[b], cu[b + 1], seq_len


def _gather(cache: Tensor, block_table: Tensor, b: int, seq_len: int) -> Tensor:
    """Sequence ``b``'s first ``seq_len`` rows of ``cache`` ``[num_blocks, block_size, heads, row]``, in
    token order (a scaled cache's dequantized to fp32)."""
    block_size = cache.shape[1]
    blocks = block_table[b, : -(-seq_len // block_size)].long()
    rows = cache[blocks].flatten(0, 1)[:seq_len]
    return dequantize_rows(rows) if is_scaled(cache.dtype) else rows


@torch.library.custom_op("pagedpack::indexer_k_cache", mutates_args=("index_cache",))
def indexer_k_cache(k: Tensor, index_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``k [T, index_head_dim]`` into ``index_cache`` ``[num_blocks, block_size, 1,
    index_head_dim]`` at ``slot_mapping [T]`` (int32 or int64; -1 writes nothing); vLLM's
    ``indexer_k_quant_and_cache`` without the fp8 quantization. ``ValueError`` for a bad shape or dtype."""
    _check_indexer_k_cache(k, index_cache, slot_mapping)
    keep = slot_mapping >= 0
    flat = index_cache.view(-1, index_cache.shape[-1])
    rows = k[keep]
    flat[slot_mapping[keep].long()] = quantize_rows(rows, flat.dtype) if is_scaled(flat.dtype) else rows.to(flat.dtype)


def _check_indexer_k_cache(k: Tensor, index_cache: Tensor, slot_mapping: Tensor) -> None:
    op = "indexer_k_cache"
    _check_rank(op, "k", k, "[T, index_head_dim]")
    _check_rank(op, "index_cache", index_cache, _INDEX_CACHE_LAYOUT)
    _check_rank(op, "slot_mapping", slot_mapping, "[T]")
    _check_dtype(op, "k", k, _FLOATS)
    _check_dtype(op, "index_cache", index_cache, _CACHE_DTYPES)
    _check_dtype(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    _require(index_cache.shape[2] == 1, op, "index_cache", "one head (dim 2 of size 1)", tuple(index_cache.shape))
    _require(head_size(index_cache) == k.shape[1], op, "k",
             f"index_head_dim = {head_size(index_cache)} like the cache", k.shape[1])
    _require(slot_mapping.shape[0] == k.shape[0], op, "slot_mapping", f"T = {k.shape[0]} entries like k",
             slot_mapping.shape[0])


@indexer_k_cache.register_fake
def _(k, index_cache, slot_mapping) -> None:
    _check_indexer_k_cache(k, index_cache, slot_mapping)


@torch.library.custom_op("pagedpack::paged_indexer_topk", mutates_args=())
def paged_indexer_topk(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                       seq_lens: Tensor, scale: float, index_topk: int) -> Tensor:
    """Each row's top-k keys over its own sequence's cached index keys (module docstring): ``q [T,
    Hi, Di]``, ``weights [T, Hi]``, ``index_cache`` as :func:`indexer_k_cache` writes it, the paged
    metadata (docs/design.md, "Terms") -> int32 ``[T, index_topk]``, positions within the sequence,
    -1 past its visible keys. ``ValueError`` for a bad shape, dtype or metadata value."""
    _check_paged_indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, index_topk)
    out = torch.full((q.shape[0], index_topk), -1, dtype=torch.int32, device=q.device)
    for b, start, end, seq_len in _sequence_rows(cu_seqlens_q, seq_lens, "paged_indexer_topk", q.shape[0]):
        if end > start:
            keys = _gather(index_cache, block_table, b, seq_len)[:, 0]
            out[start:end] = topk_rows(q[start:end], weights[start:end], keys, scale, index_topk)
    return out


def _check_paged_indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, index_topk) -> None:
    op = "paged_indexer_topk"
    _check_rank(op, "index_cache", index_cache, _INDEX_CACHE_LAYOUT)
    _check_dtype(op, "index_cache", index_cache, _CACHE_DTYPES)
    _check_indexer(op, q, weights, head_size(index_cache), index_topk)
    _check_metadata(op, block_table, cu_seqlens_q, seq_lens)


@paged_indexer_topk.register_fake
def _(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, scale, index_topk):
    _check_paged_indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, index_topk)
    return q.new_empty((q.shape[0], index_topk), dtype=torch.int32)


@torch.library.custom_op("pagedpack::sparse_paged_attention", mutates_args=())
def sparse_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, topk_indices: Tensor,
                           block_table: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """Attention of each row of ``query [T, H, D]`` over the keys of its own sequence that
    ``topk_indices [T, K]`` (int32, positions within the sequence, -1: none; :func:`paged_indexer_topk`)
    selects, read from ``key_cache`` / ``value_cache`` (``[num_blocks, block_size, Hkv, D or Dv]``)
    through the paged metadata -> ``[T, H, Dv]`` (vLLM's sparse MLA attention over the indexer's
    top-k, on the expanded per-head K/V). ``ValueError`` for a bad shape, dtype or metadata value."""
    _check_sparse_paged_attention(query, key_cache, value_cache, topk_indices, block_table, cu_seqlens_q, seq_lens)
    out = query.new_zeros(query.shape[0], query.shape[1], head_size(value_cache))
    for b, start, end, seq_len in _sequence_rows(cu_seqlens_q, seq_lens, "sparse_paged_attention", query.shape[0]):
        if end > start:
            key, value = _gather(key_cache, block_table, b, seq_len), _gather(value_cache, block_table, b, seq_len)
            out[start:end] = sparse_rows(query[start:end], key, value, topk_indices[start:end], scale)
    return out


def _check_sparse_paged_attention(query, key_cache, value_cache, topk_indices, block_table, cu_seqlens_q,
                                  seq_lens) -> None:
    op = "sparse_paged_attention"
    _check_rank(op, "key_cache", key_cache, _CACHE_LAYOUT)
    _check_rank(op, "value_cache", value_cache, _CACHE_LAYOUT)
    _check_dtype(op, "key_cache", key_cache, _CACHE_DTYPES)
    _require(value_cache.dtype == key_cache.dtype and tuple(value_cache.shape[:3]) == tuple(key_cache.shape[:3]), op,
             "value_cache", f"the dtype and first three sizes of key_cache ({key_cache.dtype}, "
             f"{tuple(key_cache.shape[:3])})", (value_cache.dtype, tuple(value_cache.shape)))
    _check_sparse(op, query, key_cache.shape[2], head_size(key_cache), topk_indices)
    _check_metadata(op, block_table, cu_seqlens_q, seq_lens)


@sparse_paged_attention.register_fake
def _(query, key_cache, value_cache, topk_indices, block_table, cu_seqlens_q, seq_lens, scale):
    _check_sparse_paged_attention(query, key_cache, value_cache, topk_indices, block_table, cu_seqlens_q, seq_lens)
    return query.new_empty((query.shape[0], query.shape[1], head_size(value_cache)))


@torch.library.custom_op("pagedpack::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, weights: Tensor, k: Tensor, scale: float, index_topk: int) -> Tensor:
    """:func:`paged_indexer_topk` for one sequence of ``S`` tokens without a cache: ``q [S, Hi, Di]``,
    ``weights [S, Hi]``, ``k [S, Di]`` -> int32 ``[S, index_topk]`` (causal: row ``i`` sees keys
    ``0 .. i``). The capture's form (:mod:`pagedpack.models.seams`)."""
    _check_indexer_topk(q, weights, k, index_topk)
    return topk_rows(q, weights, k, scale, index_topk)


def _check_indexer_topk(q, weights, k, index_topk) -> None:
    _check_rank("indexer_topk", "k", k, "[S, index_head_dim]")
    _check_indexer("indexer_topk", q, weights, k.shape[1], index_topk)
    _require(k.shape[0] == q.shape[0], "indexer_topk", "k", f"S = {q.shape[0]} rows like q", k.shape[0])


@indexer_topk.register_fake
def _(q, weights, k, scale, index_topk):
    _check_indexer_topk(q, weights, k, index_topk)
    return q.new_empty((q.shape[0], index_topk), dtype=torch.int32)


@torch.library.custom_op("pagedpack::sparse_attention", mutates_args=())
def sparse_attention(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor, scale: float) -> Tensor:
    """:func:`sparse_paged_attention` for one sequence of ``S`` tokens without a cache: ``query [S, H,
    D]``, ``key [S, Hkv, D]``, ``value [S, Hkv, Dv]``, ``topk_indices [S, K]`` -> ``[S, H, Dv]``. The
    capture's form (:mod:`pagedpack.models.seams`)."""
    _check_sparse_attention(query, key, value, topk_indices)
    return sparse_rows(query, key, value, topk_indices, scale)


def _check_sparse_attention(query, key, value, topk_indices) -> None:
    op = "sparse_attention"
    _check_rank(op, "key", key, "[S, num_kv_heads, head_dim]")
    _check_rank(op, "value", value, "[S, num_kv_heads, v_head_dim]")
    _require(tuple(value.shape[:2]) == tuple(key.shape[:2]), op, "value", f"(S, num_kv_heads) = "
             f"{tuple(key.shape[:2])} like key", tuple(value.shape))
    _check_sparse(op, query, key.shape[1], key.shape[2], topk_indices)
    _require(key.shape[0] == query.shape[0], op, "key", f"S = {query.shape[0]} rows like query", key.shape[0])


@sparse_attention.register_fake
def _(query, key, value, topk_indices, scale):
    _check_sparse_attention(query, key, value, topk_indices)
    return query.new_empty((query.shape[0], query.shape[1], value.shape[2]))


def sparse_attention_layers(graph) -> list[str]:
    """The module path of each layer of the FX ``graph`` that calls a sparse-attention op (the capture's
    ``sparse_attention`` or the step's ``sparse_paged_attention``), read off export's ``nn_module_stack``,
    once each, in graph order: for reports and refusals (a node without a stack: its name)."""
    ops = (torch.ops.pagedpack.sparse_attention.default, torch.ops.pagedpack.sparse_paged_attention.default)
    layers = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in ops:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            layers.append(stack[-1][0].removeprefix("model.") if stack else node.name)
    return list(dict.fromkeys(layers))
