"""``torch.ops.pagedpack.varlen_attention``: attention over a packed batch, no KV cache.

Semantics of FlashAttention's ``flash_attn_varlen_func`` with ``cu_seqlens_q == cu_seqlens_k``:
each sequence attends only to its own tokens, causally (top-left = bottom-right here, as query
and key lengths are equal) or bidirectionally. Used by the ``torch.compile`` backend, where
padded forward passes are packed and no cache is kept. The per-call attention parameters are
those of ``paged_attention`` (:class:`pagedpack.kernels.attention_params.AttentionParams`).

On the CPU a causal call runs the native paged-attention kernel (:mod:`pagedpack.kernels.native`)
over the packed keys seen as a cache of one-token blocks, each sequence's block table pointing at
its own rows; the reference kernel below serves every other case.
"""
import torch
from torch import Tensor

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.attention_params import AttentionParams
from pagedpack.kernels.native import native_ops
from pagedpack.kernels.ops import (
    _check_activation,
    _check_dtype,
    _check_rank,
    _check_same_device,
    _require,
    causal_attention,
    check_attention_params,
)
from pagedpack.kernels.validation import check_cu_seqlens_q, validation_enabled

_OP = "varlen_attention"


def _check_args(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor) -> None:
    _check_same_device(_OP, query=query, key=key, value=value, cu_seqlens=cu_seqlens)
    _check_rank(_OP, "query", query, "[T, num_heads, head_dim]")
    _check_rank(_OP, "key", key, "[T, num_kv_heads, head_dim]")
    _check_rank(_OP, "value", value, "[T, num_kv_heads, head_dim_v]")
    _check_rank(_OP, "cu_seqlens", cu_seqlens, "[B + 1]")
    _check_dtype(_OP, "cu_seqlens", cu_seqlens, (torch.int32,))
    _check_activation(_OP, query=query, key=key, value=value)
    _require(key.shape[1] > 0, _OP, "key", "num_kv_heads >= 1", key.shape[1])
    for arg, t in (("key", key), ("value", value)):
        _require(t.shape[0] == query.shape[0], _OP, arg, f"T={query.shape[0]} rows like query", t.shape[0])
    _require(value.shape[1] == key.shape[1], _OP, "value", f"num_kv_heads={key.shape[1]} like key", value.shape[1])
    _require(key.shape[2] == query.shape[2], _OP, "key", f"head_dim={query.shape[2]} like query", key.shape[2])
    _require(query.shape[1] % key.shape[1] == 0, _OP, "query",
             f"num_heads divisible by num_kv_heads={key.shape[1]}", f"num_heads={query.shape[1]}")


@torch.library.custom_op("pagedpack::varlen_attention", mutates_args=())
def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float,
                     causal: bool, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
                     attention_chunk_size: int | None = None) -> Tensor:
    """Attention of each packed sequence over its own keys.

    Args:
        query: ``[T, num_heads, head_dim]``; key ``[T, num_kv_heads, head_dim]``; value
            ``[T, num_kv_heads, head_dim_v]`` (grouped-query: head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``).
        cu_seqlens: int32 ``[B + 1]``, rows of sequence ``b`` are ``cu_seqlens[b]:cu_seqlens[b+1]``
            (empty sequences allowed).
        scale: multiplier of ``q @ k^T``.
        causal: row ``i`` of a sequence sees its keys ``0..i``; else all its keys.
        sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size: as in ``paged_attention`` (query
            position ``i`` = key position ``i`` here); without ``causal`` a window bounds the left
            only (row ``i`` sees keys ``j >= i - sliding_window + 1``).

    Returns: ``[T, num_heads, head_dim_v]`` in ``query.dtype`` (softmax in fp32).

    Raises: ``ValueError`` on a rank, shape, dtype or device mismatch or a parameter out of range;
        on bad ``cu_seqlens`` values only with ``PAGEDPACK_VALIDATE=1``.
    """
    _check_args(query, key, value, cu_seqlens)
    check_attention_params(_OP, query, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    params = AttentionParams(scale, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    num_tokens, num_heads = query.shape[:2]
    head_dim_v = value.shape[2]
    if validation_enabled():
        check_cu_seqlens_q(cu_seqlens, num_tokens)
    native = native_ops() if causal and is_cpu(query) else None
    if native is not None:
        lens = cu_seqlens.diff()
        width = max(int(lens.max()), 1) if lens.numel() else 1
        block_table = (cu_seqlens[:-1, None] + torch.arange(width, dtype=torch.int32)).clamp(max=max(num_tokens - 1, 0))
        return native.paged_attention(query, key[:, None], value[:, None], block_table, cu_seqlens, lens, scale,
                                      sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    out = query.new_empty(num_tokens, num_heads, head_dim_v)
    cu = cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            out[start:end] = causal_attention(query[start:end], key[start:end], value[start:end], params,
                                              causal).to(out.dtype)
    return out


@varlen_attention.register_fake
def _(query, key, value, cu_seqlens, scale, causal, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
      sinks=None, attention_chunk_size=None):
    _check_args(query, key, value, cu_seqlens)
    check_attention_params(_OP, query, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    return query.new_empty(query.shape[0], query.shape[1], value.shape[2])
