"""Emulation of the Ascend ops the ``ascend`` lowering emits: ``torch.ops.pagedpack_air.*`` and
``torch.ops.pagedpack_npu.*``, standing for ``torch.ops.air.*`` and ``torch.ops.npu.*``.

Each op has the schema of the op it stands for (same argument names and defaults, restricted to
the arguments the lowering uses) and the semantics the torch-npu 2.13.0 wheel documents:

- ``pagedpack_air.npu_fused_infer_attention_score`` ("FIA") stands for TorchAir's tensor-length
  form ``torch.ops.air.npu_fused_infer_attention_score`` (schema:
  ``torchair/ops/_npu_fused_infer_attention_score.py``), the one compiled graphs call;
  ``pagedpack_npu.npu_fused_infer_attention_score`` for torch_npu's eager op, which takes the
  lengths as host int lists (``SymInt[]``). Semantics and limits: ``_op_plugin_docs.py`` entry
  "npu_fused_infer_attention_score"; for TND also entry "npu_fused_infer_attention_score_v2"
  (both entries lower to the same GE op, FusedInferAttentionScore). Output shapes:
  ``op_plugin/meta/_meta_registrations.py``.
- ``..._v2`` in both namespaces stands for FIA v2 (``npu_fused_infer_attention_score_v2``: the same
  kernel, arguments renamed, plus ``learnable_sink``; ``_op_plugin_docs.py`` entry
  "npu_fused_infer_attention_score_v2"; schema: TorchAir's ``_npu_fused_infer_attention_score_v2.py``
  and op-plugin's ``op_plugin_functions.yaml``).
- ``pagedpack_npu.npu_scatter_nd_update_`` stands for ``torch.ops.npu.npu_scatter_nd_update_``
  (``_op_plugin_docs.py`` entry "npu_scatter_nd_update_"), ``npu_scatter_nd_update`` for its
  functional twin. Functionalisation (``torch.func.functionalize``, AOT compilation) turns the
  in-place op into the functional one plus a ``copy_`` of its result back into the input, the
  graph TorchAir's recover-inplace pass matches (``torchair/patterns/_recover_view_inplace_pattern.py``).

A call the docs reject raises ``ValueError`` naming the limit. What the docs leave undefined
(query rows past the actual lengths, rows that see no key while row-invalid correction is off,
see ``inner_precise``) comes out as NaN, so a caller that relies on it fails loudly.
Not emulated: quantisation, pse_shift, rope, shared prefixes, left padding, tensor lists, the
NZ cache format, layouts other than BSH/BSND/BNSD/TND.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

FIA = "npu_fused_infer_attention_score"
SCATTER = "npu_scatter_nd_update_"
COMPRESSED_MASK_SIZE = 2048  # sparse_mode 2/3/4 take this (2048, 2048) strictly upper-triangular mask
_INT_MAX = 2147483647
_LAYOUT_RANK = {"BSH": 3, "BSND": 4, "BNSD": 4, "TND": 3}
_FLOATS = (torch.float16, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_SCATTER_DTYPES = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)

_FIA_ARGS = (
    "(Tensor query, Tensor key, Tensor value, *, Tensor? atten_mask=None, "
    "{lengths}? actual_seq_lengths=None, {lengths}? actual_seq_lengths_kv=None, Tensor? block_table=None, "
    "int num_heads=1, float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, "
    'str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, '
    "int block_size=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"
)
# FIA v2: v1's arguments renamed (actual_seq_qlen / actual_seq_kvlen, num_query_heads, softmax_scale,
# return_softmax_lse), plus learnable_sink.
FIA_V2 = "npu_fused_infer_attention_score_v2"
_FIA_V2_ARGS = (
    "(Tensor query, Tensor key, Tensor value, *, Tensor? atten_mask=None, "
    "{lengths}? actual_seq_qlen=None, {lengths}? actual_seq_kvlen=None, Tensor? block_table=None, "
    "Tensor? learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, "
    'int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, '
    "int block_size=0, int inner_precise=0, bool return_softmax_lse=False) -> (Tensor, Tensor)"
)
_AIR = torch.library.Library("pagedpack_air", "DEF")
_NPU = torch.library.Library("pagedpack_npu", "DEF")
for _library, _lengths_type in ((_AIR, "Tensor"), (_NPU, "SymInt[]")):
    _library.define(FIA + _FIA_ARGS.format(lengths=_lengths_type))
    _library.define(FIA_V2 + _FIA_V2_ARGS.format(lengths=_lengths_type))
_NPU.define(f"{SCATTER}(Tensor(a!) input, Tensor indices, Tensor updates) -> Tensor(a!)")
_NPU.define("npu_scatter_nd_update(Tensor input, Tensor indices, Tensor updates) -> Tensor")


def _require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {message}")


# ---------------------------------------------------------------- npu_scatter_nd_update_


def _check_scatter(input: Tensor, indices: Tensor, updates: Tensor) -> int:
    """Shape/dtype rules of the doc's constraints; returns ``a = indices.shape[-1]``."""
    _require(input.dtype == updates.dtype, SCATTER,
             f"updates dtype {updates.dtype} must equal input dtype {input.dtype}")
    _require(input.dtype in _SCATTER_DTYPES, SCATTER, f"input dtype {input.dtype} not supported (A2/A3 list)")
    _require(indices.dtype in (torch.int32, torch.int64), SCATTER, f"indices dtype {indices.dtype}: int32 or int64")
    _require(1 <= input.dim() <= 8, SCATTER, f"input must have 1..8 dims, got {input.dim()}")
    _require(indices.dim() >= 2, SCATTER, f"indices must have at least 2 dims, got shape {tuple(indices.shape)}")
    a = indices.shape[-1]
    _require(a <= input.dim(), SCATTER, f"indices.shape[-1]={a} exceeds input rank {input.dim()}")
    expected = (*indices.shape[:-1], *input.shape[a:])
    _require(tuple(updates.shape) == tuple(expected), SCATTER,
             f"updates shape {tuple(updates.shape)}, expected indices.shape[:-1] + input.shape[{a}:] = {expected}")
    return a


@torch.library.impl(f"pagedpack_npu::{SCATTER}", "CompositeExplicitAutograd")
def npu_scatter_nd_update_(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """``input[indices[i]] = updates[i]`` in place; indices out of range are rejected (the doc:
    out-of-range indices are not supported, so ``-1`` is no "skip" here)."""
    a = _check_scatter(input, indices, updates)
    index = indices.reshape(-1, a).long()
    bounds = torch.tensor(input.shape[:a], device=index.device)
    bad = ((index < 0) | (index >= bounds)).any(-1).nonzero()
    _require(bad.numel() == 0, SCATTER,
             f"index {index[bad[0, 0]].tolist() if bad.numel() else None} out of range for input shape "
             f"{tuple(input.shape)} (out-of-range indices are not supported)")
    input[tuple(index.T)] = updates.reshape(-1, *input.shape[a:])
    return input


@torch.library.register_fake(f"pagedpack_npu::{SCATTER}")
def _(input, indices, updates):
    _check_scatter(input, indices, updates)
    return input


@torch.library.impl("pagedpack_npu::npu_scatter_nd_update", "CompositeExplicitAutograd")
def npu_scatter_nd_update(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """The functional form: a copy of ``input`` with the rows of ``npu_scatter_nd_update_``."""
    return torch.ops.pagedpack_npu.npu_scatter_nd_update_(input.clone(), indices, updates)


@torch.library.register_fake("pagedpack_npu::npu_scatter_nd_update")
def _(input, indices, updates):
    _check_scatter(input, indices, updates)
    return torch.empty_like(input)


@torch.library.impl(f"pagedpack_npu::{SCATTER}", "Functionalize")
def _functionalize_scatter(input: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """Under functionalisation: the functional op on the unwrapped tensors, its result made the
    new value of ``input`` (and so of the tensor ``input`` views, written back by a ``copy_``)."""
    unwrapped = [torch._from_functional_tensor(t) for t in (input, indices, updates)]
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        out = torch.ops.pagedpack_npu.npu_scatter_nd_update(*unwrapped)
    torch._functionalize_replace(input, out)
    torch._functionalize_commit_update(input)
    torch._functionalize_sync(input)
    return input


# ---------------------------------------------------------------- npu_fused_infer_attention_score


@dataclass
class _Dims:
    """Static facts of one FIA call, read off the shapes."""

    layout: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    paged: bool


def _value_head_dim(value: Tensor, layout: str, num_kv_heads: int, paged: bool) -> int:
    """Value's D as the meta registration infers it (``get_value_d``)."""
    if paged:
        return value.shape[2] // num_kv_heads if value.dim() == 3 else value.shape[3]
    return value.shape[2] // num_kv_heads if layout == "BSH" else value.shape[-1]


def _check_static(query, key, value, block_table, num_heads, num_key_value_heads, input_layout) -> _Dims:
    """Layout, dtype, head and paged-cache rules that need no tensor values."""
    _require(input_layout in _LAYOUT_RANK, FIA, f"input_layout {input_layout!r} not emulated (BSH, BSND, BNSD, TND)")
    rank = _LAYOUT_RANK[input_layout]
    _require(query.dim() == rank, FIA, f"{input_layout} query must have {rank} dims, got {tuple(query.shape)}")
    _require(query.dtype in _FLOATS, FIA, f"query dtype {query.dtype}: float16 or bfloat16 (int8 needs quantisation)")
    for name, t in (("key", key), ("value", value)):
        _require(t.dtype == query.dtype, FIA, f"{name} dtype {t.dtype} must equal query dtype {query.dtype}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require(t.is_contiguous(), FIA, f"{name} is not contiguous (non-contiguous tensors are not supported)")
    _require(num_heads > 0, FIA, f"num_heads must be > 0, got {num_heads}")
    kv_heads = num_key_value_heads or num_heads
    _require(num_heads % kv_heads == 0, FIA,
             f"num_heads={num_heads} must be divisible by num_key_value_heads={kv_heads}")
    _require(num_heads // kv_heads <= 64, FIA, f"num_heads / num_key_value_heads = {num_heads // kv_heads} exceeds 64")
    if input_layout == "BSH":
        _require(query.shape[2] % num_heads == 0, FIA, f"BSH query H={query.shape[2]} not divisible by num_heads")
        head_dim = query.shape[2] // num_heads
    else:
        n_axis = 1 if input_layout in ("BNSD", "TND") else 2
        _require(query.shape[n_axis] == num_heads, FIA,
                 f"{input_layout} query N={query.shape[n_axis]} must equal num_heads={num_heads}")
        head_dim = query.shape[-1]
    _require(num_heads <= 256, FIA, f"N={num_heads} exceeds 256")
    _require(head_dim <= 512, FIA, f"D={head_dim} exceeds 512")
    paged = block_table is not None
    if not paged:  # key/value in the query's layout, with KV_N heads of the query's D
        _require(key.dim() == rank and tuple(key.shape[:-1]) == tuple(value.shape[:-1]), FIA,
                 f"{input_layout} key/value must share the query's layout, got {tuple(key.shape)} / "
                 f"{tuple(value.shape)}")
        kv_shape = tuple(key.shape[1:] if input_layout == "TND" else _to_bsnd(key, input_layout, kv_heads).shape[-2:])
        _require(kv_shape == (kv_heads, head_dim), FIA,
                 f"key must have num_key_value_heads={kv_heads} heads of D={head_dim}, got {tuple(key.shape)}")
    if paged:
        _require(block_table.dtype == torch.int32 and block_table.dim() == 2, FIA,
                 f"block_table must be a 2-D int32 tensor, got {block_table.dtype} {tuple(block_table.shape)}")
        _require(tuple(key.shape) == tuple(value.shape), FIA,
                 f"paged key and value must have the same shape, got {tuple(key.shape)} vs {tuple(value.shape)}")
        if key.dim() == 3:  # (blocknum, blocksize, KV_N*D)
            _require(key.shape[2] == kv_heads * head_dim, FIA,
                     f"paged cache (blocknum, blocksize, H) needs H = KV_N*D = {kv_heads * head_dim}, "
                     f"got {key.shape[2]}")
            _require(key.shape[2] <= 65535, FIA, f"paged cache (blocknum, blocksize, H) with H={key.shape[2]} > 65535")
        else:
            _require(key.dim() == 4 and input_layout in ("BNSD", "TND"), FIA,
                     f"paged cache must be (blocknum, blocksize, H), or (blocknum, KV_N, blocksize, D) for BNSD/TND "
                     f"queries; got {tuple(key.shape)} with {input_layout}")
            _require(key.shape[1] == kv_heads and key.shape[3] == head_dim, FIA,
                     f"paged cache (blocknum, KV_N, blocksize, D) needs KV_N={kv_heads}, D={head_dim}, "
                     f"got {tuple(key.shape)}")
    value_head_dim = _value_head_dim(value, input_layout, kv_heads, paged)
    dims = _Dims(input_layout, num_heads, kv_heads, head_dim, value_head_dim, paged)
    if input_layout == "TND":
        _check_tnd(query, dims)
    return dims


def _check_tnd(query: Tensor, dims: _Dims) -> None:
    """TND limits (FIA doc and FIA v2 doc, "TND ... 综合限制")."""
    _require(query.dtype == torch.bfloat16, FIA, f"TND supports bfloat16 only, got {query.dtype}")
    d, dv = dims.head_dim, dims.value_head_dim
    mha = dims.num_heads == dims.num_kv_heads
    # 64 with MHA: vllm-ascend #9632; V_D 192 not with paging or GQA: the v2 doc's newest revision
    _require((d, dv) == (128, 128) or ((d, dv) == (64, 64) and mha) or (d == 192 and dv == 128)
             or ((d, dv) == (192, 192) and mha and not dims.paged), FIA,
             f"TND needs Q_D=K_D=V_D=128, 64 without GQA, or Q_D=K_D=192 with V_D 128 (V_D 192 only unpaged "
             f"without GQA); got D={d}, V_D={dv}, {dims.num_heads} query / {dims.num_kv_heads} KV heads, "
             f"{'paged' if dims.paged else 'not paged'}")
    _require(query.shape[0] <= 65536, FIA, f"TND needs T <= 65536, got {query.shape[0]}")


def _lengths(t: Tensor | list[int] | None, name: str) -> list[int] | None:
    if t is None or isinstance(t, list):  # the eager op's host lists
        return t
    _require(t.dtype == torch.int64 and t.dim() == 1, FIA,
             f"{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
    return t.tolist()


def _per_batch(values: list[int] | None, batch: int, limit: int, name: str) -> list[int]:
    """B-layout lengths: none = the shape's S; one value for every batch; else the first B."""
    if values is None:
        return [limit] * batch
    _require(len(values) == 1 or len(values) >= batch, FIA,
             f"{name} must have 1 or >= B={batch} entries, got {len(values)}")
    values = values * batch if len(values) == 1 else values[:batch]
    _require(all(0 <= v <= limit for v in values), FIA, f"{name} entries must lie in 0..{limit}, got {values}")
    return values


def _cumulative(values: list[int] | None, total: int, name: str) -> tuple[list[int], list[int]]:
    """TND cumulative lengths -> ``(starts, lengths)`` per batch."""
    _require(values is not None, FIA, f"TND requires {name}")
    starts = [0, *values[:-1]]
    _require(all(v >= 0 for v in values) and all(b >= a for a, b in zip(starts, values)), FIA,
             f"TND {name} must be cumulative (non-negative, non-decreasing), got {values}")
    _require(not values or values[-1] <= total, FIA, f"TND {name} ends at {values[-1] if values else 0} > {total} rows")
    return starts, [b - a for a, b in zip(starts, values)]


def _to_bsnd(t: Tensor, layout: str, heads: int) -> Tensor:
    """A ``[B, S, heads, D]`` view of a BSH/BSND/BNSD tensor (writes through it reach ``t``)."""
    if layout == "BSH":
        return t.view(t.shape[0], t.shape[1], heads, -1)
    return t.transpose(1, 2) if layout == "BNSD" else t


def _paged_rows(cache: Tensor, block_table: Tensor, kv_lens: list[int], block_size: int, dims: _Dims) -> list[Tensor]:
    """Each batch's first ``kv_len`` tokens, read through its block-table row: ``[kv_len, KV_N, D]``."""
    _require(cache.shape[1 if cache.dim() == 3 else 2] == block_size, FIA,
             f"cache blocksize axis {tuple(cache.shape)} does not match block_size={block_size}")
    blocks = [-(-n // block_size) for n in kv_lens]
    _require(block_table.shape[0] == len(kv_lens), FIA,
             f"block_table first dim must equal B={len(kv_lens)}, got {block_table.shape[0]}")
    _require(block_table.shape[1] >= max(blocks, default=0), FIA,
             f"block_table has {block_table.shape[1]} columns, fewer than the {max(blocks, default=0)} blocks of the "
             "longest sequence")
    _require(cache.shape[0] >= sum(blocks), FIA,
             f"blocknum={cache.shape[0]} is less than the {sum(blocks)} blocks the batches need together")
    ids = [block_table[b, :n].long() for b, n in enumerate(blocks)]
    _require(all(bool(((i >= 0) & (i < cache.shape[0])).all()) for i in ids), FIA,
             f"block_table holds ids outside [0, {cache.shape[0]}) (the kernel does not check them)")
    if cache.dim() == 3:  # (blocknum, blocksize, KV_N*D)
        tokens = cache.view(cache.shape[0], block_size, dims.num_kv_heads, -1)
    else:  # (blocknum, KV_N, blocksize, D)
        tokens = cache.transpose(1, 2)
    return [tokens[i].flatten(0, 1)[:n] for i, n in zip(ids, kv_lens)]


def _check_block_size(block_size: int, decode: bool) -> None:
    if decode:  # Q_S == 1, page attention: non-zero, <= 512, 16-aligned for float16/bfloat16
        _require(0 < block_size <= 512 and block_size % 16 == 0, FIA,
                 f"paged with Q_S == 1 needs block_size in 16..512, a multiple of 16; got {block_size}")
    else:  # Q_S > 1, page attention: 128..512, a multiple of 128
        _require(128 <= block_size <= 512 and block_size % 128 == 0, FIA,
                 f"paged with Q_S > 1 needs block_size in 128..512, a multiple of 128; got {block_size}")


def _check_compressed_mask(mask: Tensor | None, sparse_mode: int) -> None:
    _require(mask is not None, FIA, f"sparse_mode={sparse_mode} requires the compressed atten_mask")
    size = COMPRESSED_MASK_SIZE
    _require(tuple(mask.shape) in ((size, size), (1, size, size), (1, 1, size, size)), FIA,
             f"sparse_mode={sparse_mode} needs atten_mask of shape ({size}, {size}), got {tuple(mask.shape)}")
    _require(mask.dtype in _MASK_DTYPES, FIA, f"atten_mask dtype {mask.dtype}: bool, int8 or uint8")
    _require(torch.equal(mask.reshape(size, size).bool(), _compressed_mask(str(mask.device))), FIA,
             f"sparse_mode={sparse_mode} needs the compressed mask: strictly upper triangular, 1 = masked")


@functools.cache
def _compressed_mask(device: str) -> Tensor:
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def _full_mask(mask: Tensor, batch: int, q_width: int, kv_width: int, decode: bool) -> Tensor:
    """A sparse_mode 0/1 mask as ``[B or 1, >= q_width, >= kv_width]`` bool (True = masked)."""
    _require(mask.dtype in _MASK_DTYPES, FIA, f"atten_mask dtype {mask.dtype}: bool, int8 or uint8")
    if mask.dim() == 2:  # (Q_S, KV_S) when Q_S > 1, (B, KV_S) when Q_S == 1
        mask = mask[:, None, :] if decode else mask[None]
    elif mask.dim() == 4:  # (B, 1, Q_S, KV_S) or (1, 1, Q_S, KV_S)
        _require(mask.shape[1] == 1, FIA, f"atten_mask (B, 1, Q_S, KV_S) expected, got {tuple(mask.shape)}")
        mask = mask[:, 0]
    _require(mask.dim() == 3 and mask.shape[0] in (1, batch), FIA,
             f"atten_mask shape {tuple(mask.shape)} not supported")
    _require(mask.shape[1] >= q_width and mask.shape[2] >= kv_width, FIA,
             f"atten_mask {tuple(mask.shape)} smaller than the Q_S x KV_S = {q_width} x {kv_width} it must cover")
    return mask.bool()


def _visible(q_len, kv_len, *, sparse_mode, mask, pre_tokens, next_tokens, decode, device) -> Tensor:
    """``[q_len, kv_len]``: may query row ``i`` attend key ``j`` (``mask``: this batch's full mask)."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    everything = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if mask is not None:  # sparse_mode 0/1 with a full mask
        everything = ~mask[:q_len, :kv_len]
    if decode or sparse_mode == 1 or (sparse_mode == 0 and mask is None):
        return everything  # Q_S == 1: sparse_mode, pre_tokens and next_tokens have no effect
    if sparse_mode == 0:  # the full mask plus the pre/next band, origin top-left
        return everything & (j >= i - pre_tokens) & (j <= i + next_tokens)
    if sparse_mode == 2:  # leftUpCausal
        return j <= i
    offset = kv_len - q_len  # origin bottom-right
    if sparse_mode == 3:  # rightDownCausal
        return j <= i + offset
    return (j >= i + offset - pre_tokens) & (j <= i + offset + next_tokens)  # 4: band


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, row_invalid_correction: bool,
            sink: Tensor | None = None):
    """One batch entry in fp32: ``q [sq, N, D]``, ``k``/``v [skv, KV_N, D]`` -> ``([sq, N, Dv], lse [sq, N])``.
    GQA: query head ``h`` reads KV head ``h // (N / KV_N)``. ``sink`` ``[N]``: a logit per head
    that joins each row's softmax denominator and weighs no value (FIA v2's ``learnable_sink``,
    gpt-oss's sinks), so a row without a visible key gives zeros. Otherwise rows without a
    visible key: zeros with row-invalid correction, else NaN."""
    sq, num_heads, _ = q.shape
    kv_heads = k.shape[1]
    q = q.float().view(sq, kv_heads, num_heads // kv_heads, -1)
    scores = torch.einsum("qgrd,kgd->grqk", q, k.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [KV_N, rep, sq]
    if sink is not None:
        lse = torch.logaddexp(lse, sink.float().view(kv_heads, num_heads // kv_heads, 1))
    out = torch.einsum("grqk,kgd->qgrd", torch.exp(scores - lse[..., None]), v.float()).reshape(sq, num_heads, -1)
    if sink is None:
        seen = visible.any(-1)[:, None, None]
        out = torch.where(seen, out, 0.0 if row_invalid_correction else float("nan"))
    return out, lse.reshape(num_heads, sq).T


def _output_shapes(query: Tensor, dims: _Dims, softmax_lse_flag: bool):
    """``(attention_out shape, softmax_lse shape)`` as the meta registration infers them."""
    if dims.layout == "TND":
        out, lse = (query.shape[0], dims.num_heads, dims.value_head_dim), (query.shape[0], dims.num_heads, 1)
    else:
        out = ((*query.shape[:2], dims.num_heads * dims.value_head_dim) if dims.layout == "BSH"
               else (*query.shape[:3], dims.value_head_dim))
        lse = (query.shape[0], dims.num_heads, query.shape[2 if dims.layout == "BNSD" else 1], 1)
    # The doc says an unrequested softmax_lse is a [1] zero tensor; the meta registration (what a
    # graph sees) says [0]. The emulation follows the meta registration.
    return out, lse if softmax_lse_flag else (0,)


@dataclass
class _Queries:
    """Each batch entry's query rows ``[q_len, N, D]`` and where they sit in the query tensor:
    rows ``start .. start + q_len`` (TND) or batch ``b``, rows ``0 .. q_len`` (B-layouts)."""

    rows: list[Tensor]
    starts: list[int] | None
    width: int  # the query's S (B-layouts) or the longest q_len (TND)
    decode: bool  # query S == 1: the incremental (decode) branch


def _queries(query: Tensor, lengths: list[int] | None, dims: _Dims, sparse_mode: int, has_mask: bool) -> _Queries:
    if dims.layout == "TND":
        starts, q_lens = _cumulative(lengths, query.shape[0], "actual_seq_lengths")
        # CANN 8.5: "queryT(8) must be equal to the last element of actualSequenceLengthQ(5)"
        # (vllm-ascend issue #6076): no trailing query rows past the last sequence in TND.
        last = lengths[-1] if lengths else 0
        _require(last == query.shape[0], FIA, f"TND query T={query.shape[0]} must equal the last "
                                              f"actual_seq_lengths entry, got {last} (vllm-ascend #6076)")
        _require(len(q_lens) <= 4096, FIA, f"TND takes at most 4096 lengths, got {len(q_lens)}")
        _require(sparse_mode in (3, 4) or (sparse_mode == 0 and not has_mask), FIA,
                 f"TND supports sparse_mode 0 without a mask, 3 or 4; got sparse_mode={sparse_mode}"
                 f"{' with a mask' if has_mask else ''}")
        width = max(q_lens, default=0)
        return _Queries([query[s:s + n] for s, n in zip(starts, q_lens)], starts, width, width <= 1)
    batch, width = query.shape[0], query.shape[2 if dims.layout == "BNSD" else 1]
    decode = width == 1
    if not decode:
        _require(dims.head_dim % 16 == 0, FIA, f"Q_S > 1 needs D 16-aligned for float16/bfloat16, got {dims.head_dim}")
        _require(dims.layout == "BNSD" or dims.num_heads * dims.head_dim < 65535, FIA,
                 f"BSH/BSND with Q_S > 1 needs N*D < 65535, got {dims.num_heads * dims.head_dim}")
    _require(batch <= 65536, FIA, f"B={batch} exceeds 65536")
    # Q_S == 1: actual_seq_lengths has no effect.
    q_lens = [1] * batch if decode else _per_batch(lengths, batch, width, "actual_seq_lengths")
    q = _to_bsnd(query, dims.layout, dims.num_heads)
    return _Queries([q[b, :n] for b, n in enumerate(q_lens)], None, width, decode)


def _keys_values(key, value, lengths, block_table, block_size, dims: _Dims, queries: _Queries):
    """``(keys, values, kv_lens)``: each batch entry's ``[kv_len, KV_N, D]`` rows, read the way the
    layout and paging say."""
    batch = len(queries.rows)
    if dims.paged:
        _check_block_size(block_size, queries.decode)
        if dims.layout == "TND":  # per batch with a block table
            _require(len(lengths) == batch, FIA,
                     f"paged TND actual_seq_lengths_kv needs B={batch} per-batch entries, got {len(lengths)}")
        # Bounded by the block table's width, which _paged_rows checks.
        kv_lens = _per_batch(lengths, batch, _INT_MAX, "actual_seq_lengths_kv")
        keys, values = (_paged_rows(t, block_table, kv_lens, block_size, dims) for t in (key, value))
    elif dims.layout == "TND":  # cumulative without a block table
        starts, kv_lens = _cumulative(lengths, key.shape[0], "actual_seq_lengths_kv")
        _require(len(kv_lens) == batch, FIA, f"TND actual_seq_lengths_kv needs B={batch} entries, got {len(kv_lens)}")
        keys, values = ([t[s:s + n] for s, n in zip(starts, kv_lens)] for t in (key, value))
    else:
        kv_lens = _per_batch(lengths, batch, key.shape[2 if dims.layout == "BNSD" else 1], "actual_seq_lengths_kv")
        keys, values = ([_to_bsnd(t, dims.layout, dims.num_kv_heads)[b, :n] for b, n in enumerate(kv_lens)]
                        for t in (key, value))
    if queries.decode:
        _require(max(kv_lens, default=0) <= 262144, FIA,
                 f"Q_S == 1 supports KV S <= 262144, got {max(kv_lens, default=0)}")
    return keys, values, kv_lens


def _mask(atten_mask, sparse_mode, block_table, block_size, queries: _Queries, kv_width: int) -> Tensor | None:
    """The full mask of sparse_mode 0/1 as ``[B or 1, >= width, >= kv_width]``; checks the compressed one."""
    if queries.decode and sparse_mode in (2, 3, 4):
        return None  # Q_S == 1: sparse_mode has no effect
    if sparse_mode in (2, 3, 4):
        _check_compressed_mask(atten_mask, sparse_mode)
        return None
    if atten_mask is None:
        _require(sparse_mode == 0, FIA, "sparse_mode=1 requires the full atten_mask")
        return None
    if block_table is not None:
        _require(atten_mask.shape[-1] >= block_table.shape[1] * block_size, FIA,
                 f"paged atten_mask last dim {atten_mask.shape[-1]} < block_table columns * block_size")
    return _full_mask(atten_mask, len(queries.rows), queries.width, kv_width, queries.decode)


def npu_fused_infer_attention_score(
    query: Tensor, key: Tensor, value: Tensor, *, atten_mask: Tensor | None = None,
    actual_seq_lengths: Tensor | list[int] | None = None, actual_seq_lengths_kv: Tensor | list[int] | None = None,
    block_table: Tensor | None = None, num_heads: int = 1, scale: float = 1.0, pre_tokens: int = _INT_MAX,
    next_tokens: int = _INT_MAX, input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
    inner_precise: int = 0, block_size: int = 0, softmax_lse_flag: bool = False, learnable_sink: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``softmax(scale * q k^T + mask) v`` per batch, with the doc's reading of every argument.

    Layouts: BSH ``[B, S, N*D]``, BSND ``[B, S, N, D]``, BNSD ``[B, N, S, D]``, TND ``[T, N, D]``.
    Lengths (int64 tensors; host int lists in the ``pagedpack_npu`` eager form): for B-layouts per
    batch; for TND ``actual_seq_lengths`` is cumulative (its length is B) and
    ``actual_seq_lengths_kv`` is cumulative without ``block_table`` and per batch with it. Paged KV:
    ``block_table`` int32 ``[B, >= max blocks]`` into a cache
    ``(blocknum, blocksize, KV_N*D)`` or, for BNSD/TND, ``(blocknum, KV_N, blocksize, D)``.
    ``sparse_mode``: 0 = ``atten_mask`` as given (none: full attention), 1 = full mask, 2 = causal
    top-left, 3 = causal bottom-right, 4 = band ``[i + off - pre_tokens, i + off + next_tokens]``
    with ``off = kv_len - q_len``; 2/3/4 take the compressed 2048x2048 mask. Query S == 1 is the
    decode branch: sparse_mode, pre/next tokens and ``actual_seq_lengths`` have no effect.
    GQA: query head ``h`` reads KV head ``h // (num_heads // num_key_value_heads)``.

    ``learnable_sink`` (FIA v2 only, :func:`npu_fused_infer_attention_score_v2`): see :func:`_attend`.

    Returns ``(attention_out, softmax_lse)``: the query's shape with value's D in query's dtype;
    the fp32 log-sum-exp ``[B, N, S, 1]`` / ``[T, N, 1]`` if ``softmax_lse_flag``, else shape ``[0]``.
    Raises ``ValueError`` on a call the docs reject.
    """
    dims = _check_static(query, key, value, block_table, num_heads, num_key_value_heads, input_layout)
    if learnable_sink is not None:
        _check_sink(learnable_sink, dims)
    _require(sparse_mode in (0, 1, 2, 3, 4), FIA, f"sparse_mode={sparse_mode} not supported (0, 1, 2, 3, 4)")
    kv_values = _lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv")
    _require(not dims.paged or kv_values is not None, FIA, "page attention requires actual_seq_lengths_kv")
    queries = _queries(query, _lengths(actual_seq_lengths, "actual_seq_lengths"), dims, sparse_mode,
                       atten_mask is not None)
    keys, values, kv_lens = _keys_values(key, value, kv_values, block_table, block_size, dims, queries)
    q_lens = [r.shape[0] for r in queries.rows]
    if dims.layout == "TND" and sparse_mode == 3:
        # The TND limits ask each batch's q length to stay below its kv length; equality (a prefill
        # without cached prefix) is what production stacks pass, so only q_len > kv_len is refused.
        _require(all(a <= b for a, b in zip(q_lens, kv_lens)), FIA,
                 f"TND sparse_mode=3 needs per-batch q_len <= kv_len, got {q_lens} vs {kv_lens}")
    if dims.layout == "TND" and sparse_mode == 4:
        _require(pre_tokens + next_tokens >= 0 and all(pre_tokens >= -a and next_tokens >= -b
                                                      for a, b in zip(q_lens, kv_lens)), FIA,
                 "TND sparse_mode=4 needs pre_tokens >= -q_len, next_tokens >= -kv_len, pre_tokens + next_tokens >= 0")
    mask = _mask(atten_mask, sparse_mode, block_table, block_size, queries, max(kv_lens, default=0))
    # An empty key/value gives zeros (doc: 入参为空的处理); other keyless rows need inner_precise bit 1.
    corrected = bool(inner_precise & 2) or key.numel() == 0
    results = [_attend(q, k, v, _visible(len(q), len(k), sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                                         next_tokens=next_tokens, decode=queries.decode, device=query.device,
                                         mask=None if mask is None else mask[b if mask.shape[0] > 1 else 0]),
                       scale, corrected, learnable_sink)
               for b, (q, k, v) in enumerate(zip(queries.rows, keys, values))]
    return _assemble(query, results, queries, dims, softmax_lse_flag)


def _assemble(query: Tensor, results, queries: _Queries, dims: _Dims, softmax_lse_flag: bool):
    """Per-batch ``(out, lse)`` back into the layout; rows past the actual lengths are NaN."""
    out_shape, lse_shape = _output_shapes(query, dims, softmax_lse_flag)
    attention_out = query.new_full(out_shape, float("nan"))
    softmax_lse = torch.full(lse_shape, float("nan"), device=query.device)
    if dims.layout == "TND":
        for start, (out, lse) in zip(queries.starts, results):
            attention_out[start:start + len(out)] = out
            if softmax_lse_flag:
                softmax_lse[start:start + len(out), :, 0] = lse
    else:
        canonical = _to_bsnd(attention_out, dims.layout, dims.num_heads)  # a view: writes land in attention_out
        for b, (out, lse) in enumerate(results):
            canonical[b, : len(out)] = out
            if softmax_lse_flag:
                softmax_lse[b, :, : len(out), 0] = lse.T
    return attention_out, softmax_lse if softmax_lse_flag else softmax_lse.zero_()


def _fake_fia(query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
              block_table=None, num_heads=1, scale=1.0, pre_tokens=_INT_MAX, next_tokens=_INT_MAX, input_layout="BSH",
              num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0, softmax_lse_flag=False):
    dims = _check_static(query, key, value, block_table, num_heads, num_key_value_heads, input_layout)
    out_shape, lse_shape = _output_shapes(query, dims, softmax_lse_flag)
    return query.new_empty(out_shape), query.new_empty(lse_shape, dtype=torch.float32)


def _check_sink(sink: Tensor, dims: _Dims) -> None:
    """The v2 doc's learnable_sink constraints (the quantisation, pse, left padding and shared
    prefix it excludes are not emulated at all)."""
    _require(dims.layout == "TND", FIA_V2, f"learnable_sink supports the TND layout only, got {dims.layout}")
    _require(dims.value_head_dim <= 128, FIA_V2, f"learnable_sink needs value D <= 128, got {dims.value_head_dim}")
    _require(sink.dtype == torch.bfloat16 and tuple(sink.shape) == (dims.num_heads,), FIA_V2,
             f"learnable_sink must be bfloat16 of shape (Q_N,) = ({dims.num_heads},), got {sink.dtype} "
             f"{tuple(sink.shape)}")


def _v1_arguments(actual_seq_qlen=None, actual_seq_kvlen=None, num_query_heads=1, softmax_scale=1.0,
                  return_softmax_lse=False, **same) -> dict:
    """FIA v2's keyword arguments under v1's names (the v2 doc: the same operator, renamed arguments)."""
    return dict(same, actual_seq_lengths=actual_seq_qlen, actual_seq_lengths_kv=actual_seq_kvlen,
                num_heads=num_query_heads, scale=softmax_scale, softmax_lse_flag=return_softmax_lse)


def npu_fused_infer_attention_score_v2(query: Tensor, key: Tensor, value: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
    """``npu_fused_infer_attention_score_v2`` (``_op_plugin_docs.py`` / torch_npu's
    ``npu_fused_infer_attention_score_v2`` doc): :func:`npu_fused_infer_attention_score` with the
    v2 argument names and ``learnable_sink`` (bfloat16 ``(Q_N,)``, TND only, value D <= 128)."""
    return npu_fused_infer_attention_score(query, key, value, **_v1_arguments(**kwargs))


def _fake_fia_v2(query, key, value, **kwargs):
    arguments = _v1_arguments(**kwargs)
    arguments.pop("learnable_sink", None)
    return _fake_fia(query, key, value, **arguments)


for _namespace in ("pagedpack_air", "pagedpack_npu"):
    torch.library.impl(f"{_namespace}::{FIA}", "CompositeExplicitAutograd")(npu_fused_infer_attention_score)
    torch.library.register_fake(f"{_namespace}::{FIA}")(_fake_fia)
    torch.library.impl(f"{_namespace}::{FIA_V2}", "CompositeExplicitAutograd")(npu_fused_infer_attention_score_v2)
    torch.library.register_fake(f"{_namespace}::{FIA_V2}")(_fake_fia_v2)


# ---------------------------------------------------------------- the recurrent layers' ops
#
# vllm-ascend main @ 182b75ea (2026-08-22) runs Qwen3-Next / Qwen3.5 gated DeltaNets
# (vllm_ascend/ops/gdn.py, AscendGatedDeltaNetAttention._forward_core) with
# - its own AscendC causal conv, ``torch.ops._C_ascend.npu_causal_conv1d_custom`` (schema:
#   csrc/torch_binding.cpp; kernel aclnnCausalConv1d, csrc/moe/causal_conv1d), ``run_mode=0`` over
#   every sequence of a step with prefills, ``run_mode=1`` for decode-only steps;
# - torch_npu's ``npu_chunk_gated_delta_rule`` (CANN's ChunkGatedDeltaRule; schema: op-plugin's
#   ``op_plugin_functions.yaml`` as TorchAir's converter ``_npu_chunk_gated_delta_rule.py`` quotes
#   it) for the prefills when a probe call succeeds (PR #12647), else a Triton kernel, and its own
#   ``npu_recurrent_gated_delta_rule`` for decodes.
# ``pagedpack_C_ascend.*`` stands for ``torch.ops._C_ascend.*``.

CAUSAL_CONV = "npu_causal_conv1d_custom"
CHUNK_GDR = "npu_chunk_gated_delta_rule"
PAD_SLOT_ID = -1  # vLLM's PAD_SLOT_ID, what vllm-ascend passes as pad_slot_id
_C_ASCEND = torch.library.Library("pagedpack_C_ascend", "DEF")
# As production registers it: ``output`` and ``conv_state`` are written in place, which the schema
# does not declare (no ``(a!)``), so a functionalising compiler would not see the writes.
_C_ASCEND.define(
    f"{CAUSAL_CONV}(Tensor output, Tensor x, Tensor weight, Tensor conv_state, Tensor? bias_opt, "
    "Tensor? query_start_loc_opt, Tensor? cache_indices_opt, Tensor? initial_state_mode_opt, "
    "Tensor? num_accepted_tokens_opt, int activation_mode, int pad_slot_id, int run_mode) -> Tensor output")
_NPU.define(f"{CHUNK_GDR}(Tensor query, Tensor key, Tensor value, *, Tensor? beta=None, Tensor? initial_state=None, "
            "Tensor? actual_seq_lengths=None, float? scale=None, Tensor? g=None) -> (Tensor, Tensor)")


def _check_conv(output, x, weight, conv_state, bias, query_start_loc, cache_indices, initial_state_mode,
                num_accepted_tokens, activation_mode, run_mode) -> None:
    """aclnnCausalConv1d's input rules (csrc/moe/causal_conv1d/op_host/causal_conv1d_def.cpp: float16 or
    bfloat16 tensors, int32/int64 metadata) as far as the emulation goes."""
    for name, t in (("x", x), ("weight", weight), ("conv_state", conv_state), ("bias_opt", bias), ("output", output)):
        if t is not None:
            _require(t.dtype in _FLOATS, CAUSAL_CONV, f"{name} must be float16 or bfloat16, got {t.dtype}")
    _require(x.dim() == 2 and weight.dim() == 2 and conv_state.dim() == 3, CAUSAL_CONV,
             f"x [T, dim], weight [width, dim] and conv_state [slots, width - 1, dim] expected, got shapes "
             f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(conv_state.shape)}")
    width, dim = weight.shape
    _require(x.shape[1] == dim and tuple(conv_state.shape[1:]) == (width - 1, dim), CAUSAL_CONV,
             f"x [T, {dim}] and conv_state [slots, {width - 1}, {dim}] for weight [{width}, {dim}] (a longer state "
             f"is not emulated), got {tuple(x.shape)} and {tuple(conv_state.shape)}")
    _require(tuple(output.shape) == tuple(x.shape) and output.dtype == x.dtype, CAUSAL_CONV,
             "output must have x's shape and dtype")
    _require(bias is None or tuple(bias.shape) == (dim,), CAUSAL_CONV, f"bias_opt must be ({dim},)")
    for name, t in (("query_start_loc_opt", query_start_loc), ("cache_indices_opt", cache_indices)):
        _require(t is not None and t.dtype in (torch.int32, torch.int64), CAUSAL_CONV,
                 f"{name}: an int32/int64 tensor (the emulation needs it)")
    _require(cache_indices.shape[0] == query_start_loc.shape[0] - 1, CAUSAL_CONV,
             "cache_indices_opt needs one entry per sequence (query_start_loc_opt has B + 1)")
    _require(run_mode in (0, 1), CAUSAL_CONV, f"run_mode 0 (prefill, causal_conv1d_fn) or 1 (update), got {run_mode}")
    _require(activation_mode in (0, 1), CAUSAL_CONV, f"activation_mode 0 (none) or 1 (silu), got {activation_mode}")
    _require(num_accepted_tokens is None, CAUSAL_CONV, "num_accepted_tokens_opt (speculative decoding) is not emulated")
    _require(initial_state_mode is None or initial_state_mode.dtype == torch.bool, CAUSAL_CONV,
             "initial_state_mode_opt: the emulation takes the bool has_initial_state form")


@torch.library.impl(f"pagedpack_C_ascend::{CAUSAL_CONV}", "CompositeExplicitAutograd")
def npu_causal_conv1d_custom(output: Tensor, x: Tensor, weight: Tensor, conv_state: Tensor, bias_opt: Tensor | None,
                             query_start_loc_opt: Tensor | None, cache_indices_opt: Tensor | None,
                             initial_state_mode_opt: Tensor | None, num_accepted_tokens_opt: Tensor | None,
                             activation_mode: int, pad_slot_id: int, run_mode: int) -> Tensor:
    """vllm-ascend's causal depthwise conv1d over packed sequences, writing ``output`` and the conv
    states in place and returning ``output``.

    Token-major layouts (vllm-ascend's ``[dim, T]`` vLLM tensors transposed back): ``x, output
    [T, dim]``, ``weight [width, dim]`` (the conv weight transposed), ``conv_state [slots, width - 1,
    dim]``; ``query_start_loc_opt [B + 1]``, ``cache_indices_opt [B]`` (each sequence's state slot),
    ``initial_state_mode_opt [B]`` bool (vLLM's ``has_initial_state``).

    Semantics (vLLM's ``causal_conv1d_fn`` / ``causal_conv1d_update``, the references vllm-ascend's
    tests hold the kernel to: tests/e2e/nightly/.../triton/test_causal_conv1d.py): sequence ``b``'s
    window is its slot's state (``run_mode=0``: zeros unless ``initial_state_mode_opt[b]``, zeros for all
    without it;
    ``run_mode=1``: always the slot) followed by its rows of ``x``; ``output[t, c] = bias[c] + sum_j
    weight[j, c] * window[t + j, c]``, SiLU-ed when ``activation_mode == 1``; the slot then holds the
    window's last ``width - 1`` rows. A sequence whose slot is ``pad_slot_id`` is skipped (its output
    rows are left as they are). Accumulates in fp32 and rounds to ``x``'s dtype.
    """
    _check_conv(output, x, weight, conv_state, bias_opt, query_start_loc_opt, cache_indices_opt,
                initial_state_mode_opt, num_accepted_tokens_opt, activation_mode, run_mode)
    width, dim = weight.shape
    w = weight.float().T[:, None, :]  # [dim, 1, width]
    b = None if bias_opt is None else bias_opt.float()
    starts, slots = query_start_loc_opt.tolist(), cache_indices_opt.tolist()
    if run_mode == 1 or initial_state_mode_opt is None:  # causal_conv1d_fn without has_initial_state: zeros
        initial = [run_mode == 1] * len(slots)
    else:
        initial = initial_state_mode_opt.tolist()
    for seq, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        _require(0 <= slot < conv_state.shape[0], CAUSAL_CONV, f"cache index {slot} outside [0, {conv_state.shape[0]})")
        start, end = starts[seq], starts[seq + 1]
        state = conv_state[slot].float() if initial[seq] else x.new_zeros(width - 1, dim, dtype=torch.float32)
        window = torch.cat([state, x[start:end].float()])  # [width - 1 + L, dim]
        y = torch.nn.functional.conv1d(window.T[None], w, b, groups=dim)[0].T  # [L, dim]
        output[start:end] = (torch.nn.functional.silu(y) if activation_mode == 1 else y).to(output.dtype)
        conv_state[slot] = window[window.shape[0] - (width - 1):].to(conv_state.dtype)
    return output


@torch.library.register_fake(f"pagedpack_C_ascend::{CAUSAL_CONV}")
def _(output, x, weight, conv_state, bias_opt, query_start_loc_opt, cache_indices_opt, initial_state_mode_opt,
      num_accepted_tokens_opt, activation_mode, pad_slot_id, run_mode):
    return torch.empty_like(output)


def _gdr_operands(query: Tensor, key: Tensor, value: Tensor, beta: Tensor, scale: float, g: Tensor | None):
    """``(q, k, v, beta, decay)`` in fp32 as both gated-delta-rule ops compute them: q and k repeated to
    the value heads (key head ``h // (N_v // N_k)``), q scaled, ``decay = exp(g)`` (1 without ``g``)."""
    group = value.shape[1] // query.shape[1]
    q, k = (t.float().repeat_interleave(group, dim=1) for t in (query, key))
    write = beta.float()
    return q * scale, k, value.float(), write, torch.ones_like(write) if g is None else g.float().exp()


def _check_chunk_gdr(query, key, value, beta, initial_state, actual_seq_lengths, scale, g) -> None:
    """ChunkGatedDeltaRule's rules: bfloat16 query/key/value/beta, float32 ``g``, int32 lengths
    (ops-transformer's REG_OP(ChunkGatedDeltaRule)); a bfloat16 ``initial_state`` (vllm-ascend casts to
    it: "the fused op only supports a bfloat16 initial_state"); ``D_k == D_v == 128`` and ``N_v`` a
    multiple of ``N_k`` (vllm-ascend's probe: "matching the op constraints")."""
    for name, t in (("query", query), ("key", key), ("value", value), ("beta", beta), ("initial_state", initial_state)):
        _require(t is not None and t.dtype == torch.bfloat16, CHUNK_GDR, f"{name} must be bfloat16")
    _require(g is None or g.dtype == torch.float32, CHUNK_GDR, "g must be float32")
    _require(actual_seq_lengths is not None and actual_seq_lengths.dtype == torch.int32, CHUNK_GDR,
             "actual_seq_lengths must be int32 [B]")
    _require(scale is not None, CHUNK_GDR, "scale is required")
    _require(query.dim() == key.dim() == value.dim() == 3 and query.shape == key.shape, CHUNK_GDR,
             "TND layout: query/key [T, N_k, D_k], value [T, N_v, D_v]")
    tokens, num_k, dk = query.shape
    num_v, dv = value.shape[1:]
    _require(dk == dv == 128, CHUNK_GDR, f"D_k == D_v == 128, got {dk} and {dv}")
    _require(num_v % num_k == 0, CHUNK_GDR, f"N_v={num_v} must be a multiple of N_k={num_k}")
    _require(tuple(beta.shape) == (tokens, num_v) and (g is None or tuple(g.shape) == (tokens, num_v)), CHUNK_GDR,
             f"beta and g are [T, N_v] = ({tokens}, {num_v})")
    batch = actual_seq_lengths.shape[0]
    _require(tuple(initial_state.shape) == (batch, num_v, dv, dk), CHUNK_GDR,
             f"initial_state is [B, N_v, D_v, D_k] = ({batch}, {num_v}, {dv}, {dk}), got {tuple(initial_state.shape)}")


@torch.library.impl(f"pagedpack_npu::{CHUNK_GDR}", "CompositeExplicitAutograd")
def npu_chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, *, beta: Tensor | None = None,
                               initial_state: Tensor | None = None, actual_seq_lengths: Tensor | None = None,
                               scale: float | None = None, g: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """torch_npu's chunked gated delta rule over packed sequences: ``(out [T, N_v, D_v], final_state
    [B, N_v, D_v, D_k])``.

    ``query, key [T, N_k, D_k]``, ``value [T, N_v, D_v]``, ``beta, g [T, N_v]`` (``g`` the log decay),
    ``initial_state [B, N_v, D_v, D_k]`` (value-major: vllm-ascend's ``ssm_state`` layout),
    ``actual_seq_lengths [B]`` per-sequence token counts (sequence ``b`` owns the next
    ``actual_seq_lengths[b]`` rows). Per token and value head (key head ``h // (N_v // N_k)``), the
    aclnnChunkGatedDeltaRule formula: ``S = exp(g) S``; ``S = S + beta (v - S k) k^T``; ``o = S (scale q)``
    with ``S [D_v, D_k]``. No L2 norm inside (vllm-ascend normalises q and k before the call). fp32
    accumulation; ``out`` in bfloat16, ``final_state`` in ``initial_state``'s dtype.
    """
    _check_chunk_gdr(query, key, value, beta, initial_state, actual_seq_lengths, scale, g)
    lengths = actual_seq_lengths.tolist()
    _require(min(lengths, default=0) >= 0 and sum(lengths) == query.shape[0], CHUNK_GDR,
             f"actual_seq_lengths must be >= 0 and sum to T={query.shape[0]}, got {lengths}")
    q, k, v, write, decay = _gdr_operands(query, key, value, beta, scale, g)
    out = torch.empty(value.shape, dtype=torch.bfloat16, device=value.device)
    final = torch.empty_like(initial_state)
    start = 0
    for seq, length in enumerate(lengths):
        state = initial_state[seq].float()  # [N_v, D_v, D_k]
        for t in range(start, start + length):
            state = state * decay[t, :, None, None]
            delta = (v[t] - torch.einsum("hvk,hk->hv", state, k[t])) * write[t, :, None]
            state = state + delta[:, :, None] * k[t, :, None, :]
            out[t] = torch.einsum("hvk,hk->hv", state, q[t]).to(out.dtype)
        final[seq] = state.to(final.dtype)
        start += length
    return out, final


@torch.library.register_fake(f"pagedpack_npu::{CHUNK_GDR}")
def _(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None, scale=None, g=None):
    _check_chunk_gdr(query, key, value, beta, initial_state, actual_seq_lengths, scale, g)
    return value.new_empty(value.shape, dtype=torch.bfloat16), torch.empty_like(initial_state)


RECURRENT_GDR = "npu_recurrent_gated_delta_rule"
MAX_MTP = 16  # csrc/attention/recurrent_gated_delta_rule: past 16 rows a sequence the kernel returns, computing nothing
_C_ASCEND.define(
    f"{RECURRENT_GDR}(Tensor query, Tensor key, Tensor value, Tensor(a!) state, *, Tensor? beta=None, "
    "float? scale=None, Tensor? actual_seq_lengths=None, Tensor? ssm_state_indices=None, "
    "Tensor? num_accepted_tokens=None, Tensor? g=None, Tensor? gk=None) -> Tensor")


def _check_recurrent_gdr(query, key, value, state, beta, scale, actual_seq_lengths, ssm_state_indices,
                         num_accepted_tokens, g, gk) -> None:
    """The tiling's rules (recurrent_gated_delta_rule_tiling.cpp: bfloat16 query/key/value/beta, a
    bfloat16 or float32 state, float32 g, int32 lengths and indices, N <= 256, D <= 512; the adapter:
    scale required), as far as the emulation goes."""
    for name, t in (("query", query), ("key", key), ("value", value), ("beta", beta)):
        _require(t is not None and t.dtype == torch.bfloat16, RECURRENT_GDR, f"{name} must be bfloat16")
    _require(state.dtype in (torch.bfloat16, torch.float32), RECURRENT_GDR, "state must be bfloat16 or float32")
    _require(g is None or g.dtype == torch.float32, RECURRENT_GDR, "g must be float32")
    _require(scale is not None, RECURRENT_GDR, "scale cannot be empty")
    for name, t in (("actual_seq_lengths", actual_seq_lengths), ("ssm_state_indices", ssm_state_indices)):
        _require(t is not None and t.dtype == torch.int32, RECURRENT_GDR, f"{name} must be int32")
    _require(num_accepted_tokens is None and gk is None, RECURRENT_GDR,
             "num_accepted_tokens (speculative decoding) and gk (a decay per key channel) are not emulated")
    _require(query.dim() == key.dim() == value.dim() == 3 and query.shape == key.shape and state.dim() == 4,
             RECURRENT_GDR, "query/key [T, N_k, D_k], value [T, N_v, D_v], state [slots, N_v, D_v, D_k]")
    tokens, num_k, dk = query.shape
    num_v, dv = value.shape[1:]
    _require(num_k <= 256 and num_v <= 256 and dk <= 512 and dv <= 512 and num_v % num_k == 0, RECURRENT_GDR,
             f"N_k, N_v <= 256, D_k, D_v <= 512, N_v a multiple of N_k; got {num_k}, {num_v}, {dk}, {dv}")
    _require(tuple(state.shape[1:]) == (num_v, dv, dk), RECURRENT_GDR,
             f"state is [slots, N_v, D_v, D_k] = [slots, {num_v}, {dv}, {dk}], got {tuple(state.shape)}")
    _require(tuple(beta.shape) == (tokens, num_v) and (g is None or tuple(g.shape) == (tokens, num_v)),
             RECURRENT_GDR, f"beta and g are [T, N_v] = ({tokens}, {num_v})")
    _require(tuple(ssm_state_indices.shape) == (tokens,), RECURRENT_GDR, f"ssm_state_indices is [T] = ({tokens},)")


@torch.library.impl(f"pagedpack_C_ascend::{RECURRENT_GDR}", "CompositeExplicitAutograd")
def npu_recurrent_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, state: Tensor, *,
                                   beta: Tensor | None = None, scale: float | None = None,
                                   actual_seq_lengths: Tensor | None = None, ssm_state_indices: Tensor | None = None,
                                   num_accepted_tokens: Tensor | None = None, g: Tensor | None = None,
                                   gk: Tensor | None = None) -> Tensor:
    """vllm-ascend's token-by-token gated delta rule (decodes, speculative rows): ``out [T, N_v, D_v]``
    in bfloat16, ``state [slots, N_v, D_v, D_k]`` written in place.

    ``actual_seq_lengths [B + 1]``: the first row's offset, then each sequence's row count
    (gdn_attn_builder.py, ``_build_actual_seq_lengths``); ``ssm_state_indices [T]``: a slot per row.
    Semantics (the kernel, op_kernel/recurrent_gated_delta_rule.h, and the golden of vllm-ascend's
    test_recurrent_gated_delta_rule.py): a sequence starts from the slot of its first row, and after
    each row ``t`` writes its state to slot ``ssm_state_indices[t]``; per row and value head
    ``S = exp(g) S``; ``S = S + beta (v - S k) k^T``; ``o = S (scale q)``, ``S [D_v, D_k]``, fp32
    accumulation. A sequence of more than 16 rows (``MAX_MTP``) makes the kernel return without
    computing the rest: refused here.
    """
    _check_recurrent_gdr(query, key, value, state, beta, scale, actual_seq_lengths, ssm_state_indices,
                         num_accepted_tokens, g, gk)
    start, *lengths = actual_seq_lengths.tolist()
    _require(all(0 <= n <= MAX_MTP for n in lengths) and start + sum(lengths) <= query.shape[0], RECURRENT_GDR,
             f"sequences of 0..{MAX_MTP} rows within T={query.shape[0]}, got offset {start}, lengths {lengths}")
    slots = ssm_state_indices.tolist()
    _require(all(0 <= s < state.shape[0] for s in slots[start:start + sum(lengths)]), RECURRENT_GDR,
             f"state indices in [0, {state.shape[0]})")
    q, k, v, write, decay = _gdr_operands(query, key, value, beta, scale, g)
    out = torch.zeros(value.shape, dtype=torch.bfloat16, device=value.device)
    for length in lengths:
        if length:
            s = state[slots[start]].float()
        for t in range(start, start + length):
            s = s * decay[t, :, None, None]
            delta = (v[t] - torch.einsum("hvk,hk->hv", s, k[t])) * write[t, :, None]
            s = s + delta[:, :, None] * k[t, :, None, :]
            out[t] = torch.einsum("hvk,hk->hv", s, q[t]).to(out.dtype)
            state[slots[t]] = s.to(state.dtype)
        start += length
    return out


@torch.library.register_fake(f"pagedpack_C_ascend::{RECURRENT_GDR}")
def _(query, key, value, state, *, beta=None, scale=None, actual_seq_lengths=None, ssm_state_indices=None,
      num_accepted_tokens=None, g=None, gk=None):
    return value.new_empty(value.shape, dtype=torch.bfloat16)
