"""The project's ops: ``torch.ops.pagedpack.reshape_and_cache`` and ``paged_attention``.

Both are ``torch.library.custom_op`` definitions with a fake (meta) kernel, so a graph calling
them traces under ``torch.export`` with symbolic ``T`` (tokens), ``B`` (sequences) and
``max_blocks_per_seq``. The reference kernels here are plain PyTorch and run on any device.

Shape, dtype and device checks run in the fake kernel (through ``torch._check_value``, which
raises ``ValueError`` on concrete sizes and records a guard on symbolic ones) and in the real
kernels, except inside the runner's step (:func:`pagedpack.kernels.validation.checked_step`),
where they were done once for all layers. On the CPU the real kernels are the native ones
(:mod:`pagedpack.kernels.native`) when they build, else the PyTorch reference kernels here.
Checks on metadata *values* need a device sync; the reference kernels run them only when
``PAGEDPACK_VALIDATE=1`` (see :mod:`pagedpack.kernels.validation`); the native ones check block
ids and slots always (no sync on the CPU).

The attention ops take the per-call parameters of
:class:`pagedpack.kernels.attention_params.AttentionParams` as keyword arguments with defaults
(``sliding_window``, ``logits_soft_cap``, ``alibi_slopes``, ``sinks``, ``attention_chunk_size``), after the
arguments they had before, so positional calls and exported graphs of the older signature keep working. With no
parameter set the kernels take their fused fast paths (SDPA, batched decode); with any, one
explicit-score fp32 path (:func:`explicit_attention`) shared by every op.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.attention_params import AttentionParams
from pagedpack.kernels.kv_quant import dequantize_rows, head_size, is_scaled, quantize_rows
from pagedpack.kernels.native import native_ops
from pagedpack.kernels.validation import (
    arguments_checked,
    check_paged_metadata,
    check_slot_mapping,
    validation_enabled,
)
from pagedpack.step.contract import KV_SCALE_BYTES, SCALED_KV_DTYPES

_CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"


def _require(cond, op: str, arg: str, expected: str, got) -> None:
    """Raise ``ValueError("<op>: <arg>: expected <expected>, got <got>")`` unless ``cond``."""
    torch._check_value(cond, lambda: f"{op}: {arg}: expected {expected}, got {got}")


def _check_rank(op: str, arg: str, t: Tensor, layout: str) -> None:
    rank = layout.count(",") + 1
    _require(t.dim() == rank, op, arg, f"a rank-{rank} tensor {layout}", f"shape {tuple(t.shape)}")


def _check_dtype(op: str, arg: str, t: Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
    _require(t.dtype in allowed, op, arg, f"dtype {names}", str(t.dtype).removeprefix("torch."))


def _check_same_device(op: str, **tensors: Tensor) -> None:
    (first, ref), *rest = tensors.items()
    for arg, t in rest:
        _require(t.device == ref.device, op, arg, f"the device of {first} ({ref.device})", t.device)


_ACTIVATION_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_activation(op: str, **tensors: Tensor) -> None:
    """Queries, keys and values: a floating dtype that computes (not an fp8 storage dtype)."""
    for arg, t in tensors.items():
        _check_dtype(op, arg, t, _ACTIVATION_DTYPES)


def _check_caches(op: str, key_cache: Tensor, value_cache: Tensor) -> None:
    _check_rank(op, "key_cache", key_cache, _CACHE_LAYOUT)
    _check_rank(op, "value_cache", value_cache, _CACHE_LAYOUT)
    _check_dtype(op, "key_cache", key_cache, _ACTIVATION_DTYPES + SCALED_KV_DTYPES)
    _require(key_cache.dtype == value_cache.dtype, op, "value_cache", f"the dtype of key_cache ({key_cache.dtype})",
             value_cache.dtype)
    for arg, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(head_size(t) >= 1, op, arg, f"rows of head_size + {KV_SCALE_BYTES} scale bytes (a scaled dtype)",
                 f"shape {tuple(t.shape)}")
    _require(key_cache.shape[2] > 0, op, "key_cache", "num_kv_heads >= 1", key_cache.shape[2])
    k, v = tuple(key_cache.shape), tuple(value_cache.shape)
    _require(
        k[:3] == v[:3], op, "key_cache", f"shape {_CACHE_LAYOUT} matching value_cache", f"{k} vs {v}"
    )


def _check_reshape_and_cache_args(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    op = "reshape_and_cache"
    _check_same_device(
        op, key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping
    )
    _check_caches(op, key_cache, value_cache)
    for arg, t, cache in (("key", key, key_cache), ("value", value, value_cache)):
        _check_rank(op, arg, t, "[T, num_kv_heads, head_dim]")
        _check_activation(op, **{arg: t})
        heads = (cache.shape[2], head_size(cache))
        _require(
            tuple(t.shape[1:]) == heads, op, arg, f"(num_kv_heads, head_dim) = {heads} as in {arg}_cache",
            f"shape {tuple(t.shape)}",
        )
    _check_rank(op, "slot_mapping", slot_mapping, "[T]")
    _check_dtype(op, "slot_mapping", slot_mapping, (torch.int32, torch.int64))
    for arg, t in (("value", value), ("slot_mapping", slot_mapping)):
        _require(t.shape[0] == key.shape[0], op, arg, f"T={key.shape[0]} rows like key", t.shape[0])


def _check_paged_attention_args(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
) -> None:
    op = "paged_attention"
    _check_same_device(
        op, query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
        cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
    )
    _check_rank(op, "query", query, "[T, num_heads, head_dim]")
    _check_activation(op, query=query)
    _check_caches(op, key_cache, value_cache)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = key_cache.shape[2], head_size(key_cache)
    _require(
        num_heads % num_kv_heads == 0, op, "query",
        f"num_heads divisible by the cache's num_kv_heads={num_kv_heads}", f"num_heads={num_heads}",
    )
    _require(
        head_dim == cache_head_dim, op, "query",
        f"head_dim equal to key_cache's head_dim={cache_head_dim}", f"head_dim={head_dim}",
    )
    _check_rank(op, "block_table", block_table, "[B, max_blocks_per_seq]")
    _check_rank(op, "cu_seqlens_q", cu_seqlens_q, "[B + 1]")
    _check_rank(op, "seq_lens", seq_lens, "[B]")
    for arg, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        _check_dtype(op, arg, t, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    _require(
        cu_seqlens_q.shape[0] == num_seqs + 1, op, "cu_seqlens_q",
        f"B + 1 = {num_seqs + 1} entries (seq_lens has B={num_seqs})", cu_seqlens_q.shape[0],
    )
    _require(
        block_table.shape[0] == num_seqs, op, "block_table",
        f"B = {num_seqs} rows (one per seq_lens entry)", block_table.shape[0],
    )


def check_attention_params(op: str, query: Tensor, sliding_window, logits_soft_cap, alibi_slopes, sinks,
                           attention_chunk_size=None) -> None:
    """The per-call parameters' checks (:class:`~pagedpack.kernels.attention_params.AttentionParams`)
    against ``query [T, num_heads, head_dim]``: ``ValueError("<op>: <arg>: expected ..., got ...")``."""
    for arg, size in (("sliding_window", sliding_window), ("attention_chunk_size", attention_chunk_size)):
        if size is not None:
            _require(size >= 1, op, arg, "None or an int >= 1", size)
    if logits_soft_cap is not None:
        _require(math.isfinite(logits_soft_cap) and logits_soft_cap > 0, op, "logits_soft_cap",
                 "None or a finite float > 0", logits_soft_cap)
    num_heads = query.shape[1]
    for arg, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is None:
            continue
        _check_same_device(op, query=query, **{arg: t})
        _check_activation(op, **{arg: t})
        _require(t.dim() == 1 and t.shape[0] == num_heads, op, arg, f"shape [num_heads] = ({num_heads},) like query",
                 f"shape {tuple(t.shape)}")


@torch.library.custom_op("pagedpack::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write this step's keys and values into the paged KV cache, in place.

    Semantics of vLLM's ``reshape_and_cache`` (``reshape_and_cache_flash`` layout): token ``t``
    goes to block ``slot_mapping[t] // block_size``, offset ``slot_mapping[t] % block_size``;
    ``slot_mapping[t] == -1`` writes nothing. Keys and values are cast to the cache dtype, or for a
    scaled cache (int8, fp8) quantized per (token, KV head) with the scale in the row
    (:mod:`pagedpack.kernels.kv_quant`).

    Args:
        key: ``[T, num_kv_heads, head_dim]``, any floating dtype.
        value: ``[T, num_kv_heads, head_dim_v]``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), mutated; a scaled
            cache's rows are ``head_dim + 4`` long.
        value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim_v]``, mutated.
        slot_mapping: int32 or int64 ``[T]``, slots in ``[0, num_blocks * block_size)`` or -1.

    Raises:
        ValueError: a rank, shape, dtype or device mismatch (always); a slot outside the pool
            (only with ``PAGEDPACK_VALIDATE=1``).
    """
    if not arguments_checked():
        _check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    if validation_enabled():
        check_slot_mapping(slot_mapping, key_cache.shape[0], block_size)
    native = native_ops() if is_cpu(key_cache) else None
    if native is not None:
        native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    write = slot_mapping >= 0
    slots = slot_mapping[write].long()
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache in ((key, key_cache), (value, value_cache)):
        rows = quantize_rows(src[write], cache.dtype) if is_scaled(cache.dtype) else src[write].to(cache.dtype)
        cache[blocks, offsets] = rows


@reshape_and_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    _check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)


@torch.library.custom_op("pagedpack::paged_attention", mutates_args=())
def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    attention_chunk_size: int | None = None,
) -> Tensor:
    """Causal attention of a packed batch over a paged KV cache.

    Semantics of FlashAttention's varlen kernel with ``seqused_k`` and ``causal=True`` (vLLM's
    ``seq_lens``): the causal mask is aligned bottom-right per sequence, so query row ``i``
    (0-based within sequence ``b``'s ``q_len`` rows) sees keys ``0 .. seq_lens[b] - q_len + i``.
    Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Scores, softmax and the weighted sum run in fp32; the output is cast to ``query.dtype``.
    A sequence with ``q_len == 0`` produces no rows; a fully masked row (only possible when
    ``seq_lens[b] < q_len``, which validation rejects) produces zeros.

    Args:
        query: ``[T, num_heads, head_dim]``, all sequences' query rows packed.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD): floating, or a scaled
            dtype (int8, fp8) whose rows are ``head_dim + 4`` long (values, then their fp32 scale),
            read as ``values * scale`` (:mod:`pagedpack.kernels.kv_quant`).
        value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim_v]``, of key_cache's layout.
        block_table: int32 ``[B, max_blocks_per_seq]``, physical block ids of each sequence.
        cu_seqlens_q: int32 ``[B + 1]``, query rows of sequence ``b`` are
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
        seq_lens: int32 ``[B]``, KV length of each sequence in tokens, including this step's
            tokens (already written by ``reshape_and_cache``).
        scale: multiplier of ``q @ k^T`` (usually ``head_dim ** -0.5``).
        sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size: the per-call
            parameters, semantics in :class:`~pagedpack.kernels.attention_params.AttentionParams`
            (None: not applied).
            ``alibi_slopes`` / ``sinks`` are floating ``[num_heads]`` on the query's device.

    Returns:
        ``[T, num_heads, head_dim_v]`` in ``query.dtype``.

    Raises:
        ValueError: a rank, shape, dtype or device mismatch, or a parameter out of range (always);
            inconsistent metadata values (only with ``PAGEDPACK_VALIDATE=1``, see
            ``check_paged_metadata``).
    """
    if not arguments_checked():
        _check_paged_attention_args(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
        check_attention_params("paged_attention", query, sliding_window, logits_soft_cap, alibi_slopes, sinks,
                               attention_chunk_size)
    if validation_enabled():
        check_paged_metadata(
            num_tokens=query.shape[0], cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
            block_table=block_table, slot_mapping=None, num_blocks=key_cache.shape[0], block_size=key_cache.shape[1],
        )
    native = native_ops() if is_cpu(query) else None
    if native is not None:
        return native.paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale,
                                      sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    params = AttentionParams(scale, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    return reference_paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, params)


def reference_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                              cu_seqlens_q: Tensor, seq_lens: Tensor, params: AttentionParams) -> Tensor:
    """:func:`paged_attention` in plain PyTorch (any device): the semantics' reference kernel.

    Decode rows are batched (:func:`_decode_attention`); every other sequence's blocks are gathered
    and run through :func:`causal_attention`; scaled caches are read back whole first. Arguments as in
    :func:`paged_attention`, checked."""
    if is_scaled(key_cache.dtype):
        key_cache, value_cache = dequantize_rows(key_cache), dequantize_rows(value_cache)
    num_tokens, num_heads, _ = query.shape
    head_dim_v = value_cache.shape[3]
    block_size = key_cache.shape[1]
    out = query.new_zeros(num_tokens, num_heads, head_dim_v)
    cu, kv_lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    decodes = [b for b in range(len(kv_lens)) if cu[b + 1] - cu[b] == 1]
    if decodes:
        rows = [cu[b] for b in decodes]
        out[rows] = _decode_attention(query[rows], key_cache, value_cache, block_table[decodes],
                                      [kv_lens[b] for b in decodes], params).to(out.dtype)
    for b, kv_len in enumerate(kv_lens):
        start, end = cu[b], cu[b + 1]
        q_len, kv_len = end - start, max(kv_len, 0)
        if q_len <= 1:
            continue
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:kv_len]  # [kv_len, kv_heads, D], in token order
        v = value_cache[blocks].flatten(0, 1)[:kv_len]
        out[start:end] = causal_attention(query[start:end], k, v, params).to(out.dtype)
    return out


def causal_attention(q: Tensor, k: Tensor, v: Tensor, params: AttentionParams, causal: bool = True) -> Tensor:
    """One sequence, tokens first: ``q [q_len, H, D]``, ``k [kv_len, Hkv, D]``, ``v [kv_len,
    Hkv, D_v]`` -> ``[q_len, H, D_v]`` in fp32; causal aligned bottom-right (row ``i`` sees keys
    ``0 .. kv_len - q_len + i``), or every key if not ``causal``. Grouped-query via SDPA's
    ``enable_gqa`` (head ``h`` reads KV head ``h // (H // Hkv)``). 4-D inputs keep SDPA on its
    fused CPU kernel. ``params``: the call's :class:`AttentionParams`; with any
    parameter set, :func:`explicit_attention` computes the sequence (a non-causal window bounds
    the left only)."""
    scale = params.scale
    q_len, kv_len = q.shape[0], k.shape[0]
    q4, k4, v4 = (t.float().transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, len, D]
    if not params.is_default:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[None]  # [1, q_len]
        kv_lens = torch.tensor([kv_len], device=q.device)
        out = explicit_attention(q4, k4, v4, query_pos, kv_lens, params, causal)
    elif not causal or kv_len >= q_len:
        mask = _bottom_right_causal(q_len, kv_len, q.device) if causal and kv_len > q_len else None
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal and kv_len == q_len,
                                             scale=scale, enable_gqa=True)
    else:  # degenerate (seq_lens < q_len): the first rows see no key at all
        n_rep = q.shape[1] // k.shape[1]
        out = _attend(q4, k4.repeat_interleave(n_rep, 1), v4.repeat_interleave(n_rep, 1),
                      _bottom_right_causal(q_len, kv_len, q.device), scale)
    return out[0].transpose(0, 1)


def _bottom_right_causal(q_len: int, kv_len: int, device) -> Tensor:
    """``[q_len, kv_len]`` bool: row ``i`` sees keys ``0 .. kv_len - q_len + i`` (none where that is
    negative). What ``torch.nn.attention.bias.causal_lower_right`` materializes on the CPU, without
    importing that module (it imports ``torch._dynamo``, ~70 MiB in every process)."""
    return torch.arange(kv_len, device=device) <= torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """fp32 ``softmax(q k^T * scale)`` over the ``visible`` keys, times ``v``; a row with no
    visible key gives zeros (SDPA's fused CPU kernels would give NaN or garbage there)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return torch.where(visible.any(-1, keepdim=True), out, 0.0)


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, kv_lens: Tensor,
                       params: AttentionParams, causal: bool = True) -> Tensor:
    """Attention with the per-call parameters, scores written out in fp32 (every op's slow path).

    ``q [N, H, Q, D]``, ``k [N, Hkv, L, D]``, ``v [N, Hkv, L, D_v]`` (any floating dtype) ->
    ``[N, H, Q, D_v]`` fp32. ``query_pos [N, Q]``: each query row's absolute position; key ``j``
    sits at position ``j``, and only keys ``j < kv_lens[n]`` exist. Steps as in
    :mod:`pagedpack.kernels.attention_params`: scale, soft cap, ALiBi ``slope * (j - query_pos)``,
    mask (``j <= query_pos`` if ``causal``; ``j > query_pos - sliding_window``; ``j // c == query_pos // c``
    with ``attention_chunk_size = c``), softmax with the
    sink in the denominator; a row that sees no key gives zeros. Grouped-query: the ``H / Hkv``
    query heads of a group are matched against their KV head without copying K/V.
    """
    n, num_heads, q_rows, head_dim = q.shape
    num_kv_heads, width = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.float().reshape(n, num_kv_heads, group * q_rows, head_dim)
    scores = (grouped @ k.float().transpose(-1, -2)).view(n, num_heads, q_rows, width) * params.scale
    if params.logits_soft_cap is not None:
        scores = torch.tanh(scores / params.logits_soft_cap) * params.logits_soft_cap
    key_pos = torch.arange(width, device=q.device)
    offset = key_pos - query_pos[..., None]  # [N, Q, L]: key position - query position
    if params.alibi_slopes is not None:
        scores = scores + params.alibi_slopes.float()[:, None, None] * offset[:, None]
    visible = (key_pos < kv_lens[:, None, None]).expand(n, q_rows, width)
    if causal:
        visible = visible & (offset <= 0)
    if params.sliding_window is not None:
        visible = visible & (offset > -params.sliding_window)
    if params.attention_chunk_size is not None:
        chunk = params.attention_chunk_size
        visible = visible & (key_pos // chunk == (query_pos // chunk)[..., None])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if params.sinks is not None:
        sink = params.sinks.float()[:, None, None].expand(n, num_heads, q_rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1)[:, None, :, None], probs, 0.0)
    out = probs.view(n, num_kv_heads, group * q_rows, width) @ v.float()
    return out.view(n, num_heads, q_rows, -1)


def _decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                      kv_lens: list[int], params: AttentionParams) -> Tensor:
    """Sequences with one query row each, batched: ``query [N, H, D] -> [N, H, D_v]`` (fp32).

    The single row sees all ``kv_len`` keys of its sequence (or, with ``params``, what
    :func:`explicit_attention` lets it see from position ``kv_len - 1``); keys are gathered for
    the longest sequence and the tail of shorter ones is masked.
    """
    n, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, head_dim_v = value_cache.shape
    n_rep = num_heads // num_kv_heads
    lens = torch.tensor(kv_lens, device=query.device).clamp(min=0)
    width = -(-max(max(kv_lens), 1) // block_size)
    blocks = block_table[:, :width].long()
    # [N, kv_heads, width * block_size, D]
    k = key_cache[blocks].flatten(1, 2).transpose(1, 2).float()
    v = value_cache[blocks].flatten(1, 2).transpose(1, 2).float()
    if not params.is_default:
        out = explicit_attention(query[:, :, None], k, v, (lens - 1)[:, None], lens, params)
        return out.view(n, num_heads, head_dim_v)
    # The n_rep query heads sharing a KV head play the part of SDPA's query rows.
    q = query.float().view(n, num_kv_heads, n_rep, head_dim)
    visible = (torch.arange(k.shape[2], device=query.device) < lens[:, None]).view(n, 1, 1, -1)
    return _attend(q, k, v, visible, params.scale).view(n, num_heads, head_dim_v)


@paged_attention.register_fake
def _(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, sliding_window=None,
      logits_soft_cap=None, alibi_slopes=None, sinks=None, attention_chunk_size=None):
    _check_paged_attention_args(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
    check_attention_params("paged_attention", query, sliding_window, logits_soft_cap, alibi_slopes, sinks,
                           attention_chunk_size)
    return query.new_empty(query.shape[0], query.shape[1], head_size(value_cache))


@torch.library.custom_op("pagedpack::paged_attention_functional", mutates_args=())
def paged_attention_functional(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    slot_mapping: Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    attention_chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``reshape_and_cache`` then ``paged_attention``, without mutation: the caches are returned.

    The functional form of one rewritten attention site, for export formats that have no
    in-place update (ONNX, where the KV caches are model inputs *and* outputs). Arguments are
    those of the two ops (the attention parameters as in ``paged_attention``); the result is
    ``(out [T, num_heads, head_dim_v], key_cache_out, value_cache_out)``, the caches with this
    step's keys and values written. The inputs are left untouched, so each call copies both
    caches: use the in-place pair when running in PyTorch.
    """
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    out = paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale,
                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                          alibi_slopes=alibi_slopes, sinks=sinks, attention_chunk_size=attention_chunk_size)
    return out, key_cache, value_cache


@paged_attention_functional.register_fake
def _(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, scale,
      sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None, attention_chunk_size=None):
    _check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    _check_paged_attention_args(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens)
    check_attention_params("paged_attention", query, sliding_window, logits_soft_cap, alibi_slopes, sinks,
                           attention_chunk_size)
    out = query.new_empty(query.shape[0], query.shape[1], head_size(value_cache))
    return out, torch.empty_like(key_cache), torch.empty_like(value_cache)
