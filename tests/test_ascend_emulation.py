"""The Ascend op emulation against a plain explicit-mask fp32 reference, case by case from the docs.

Each case is a reading of ``torch_npu/_op_plugin_docs.py`` (torch-npu 2.13.0),
"npu_fused_infer_attention_score" / "_v2" and "npu_scatter_nd_update_": layouts, cumulative vs
per-sequence lengths, paging, sparse modes, GQA, softmax_lse, and the calls the docs reject.
The reference below is written from those readings, not from the emulation.
"""
import re

import pytest
import torch

import pagedpack.kernels.ascend_emulation  # noqa: F401  (registers torch.ops.pagedpack_air.* and pagedpack_npu.*)

from conftest import assert_rounded_close

fia = torch.ops.pagedpack_air.npu_fused_infer_attention_score.default
scatter = torch.ops.pagedpack_npu.npu_scatter_nd_update_.default
MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # the compressed mask: 1 = masked


# ---------------------------------------------------------------- reference


def visible(q_len, kv_len, rule, pre=None, nxt=None):
    """``[q_len, kv_len]``: may query row i attend key j, per the docs' sparse modes."""
    i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None]
    off = kv_len - q_len
    return {"all": j >= 0, "top_left": j <= i, "bottom_right": j <= i + off,
            "band": (j >= i + off - (pre or 0)) & (j <= i + off + (nxt or 0))}[rule]


def attend(q, k, v, allowed, scale):
    """One batch entry in fp32: ``q [sq, N, D]``, ``k``/``v [skv, KV_N, D]``; head h reads KV head h // (N/KV_N)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v), scores.logsumexp(-1).T  # [sq,N,Dv], [sq,N]


def randn(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def paged(seqs, block_size, layout="BSH", seed=1):
    """Caches holding each sequence's ``[kv_len, KV_N, D]`` rows in shuffled blocks: ``(cache, block_table)``."""
    kv_heads, dim = seqs[0].shape[1:]
    need = [-(-s.shape[0] // block_size) for s in seqs]
    ids = torch.randperm(sum(need) + 2, generator=torch.Generator().manual_seed(seed))
    cache = randn(sum(need) + 2, block_size, kv_heads, dim, dtype=seqs[0].dtype, seed=seed)
    table = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    start = 0
    for b, s in enumerate(seqs):
        table[b, : need[b]] = ids[start : start + need[b]]
        start += need[b]
        for p in range(s.shape[0]):
            cache[table[b, p // block_size], p % block_size] = s[p]
    if layout == "BNSD_CACHE":  # (blocknum, KV_N, blocksize, D)
        return cache.transpose(1, 2).contiguous(), table
    return cache.flatten(2), table  # (blocknum, blocksize, KV_N*D)


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------- layouts, lengths, GQA


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("num_heads, kv_heads", [(4, 4), (4, 2), (64, 1)])
def test_b_layouts_match_reference(layout, num_heads, kv_heads):
    q_lens, kv_lens, S, KV_S, D = [6, 3, 4], [9, 3, 7], 6, 9, 32
    q = randn(3, S, num_heads, D, seed=1)
    k, v = randn(3, KV_S, kv_heads, D, seed=2), randn(3, KV_S, kv_heads, D, seed=3)
    to_layout = {"BSH": lambda t: t.flatten(2), "BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2).contiguous()}
    out, lse = fia(to_layout[layout](q), to_layout[layout](k), to_layout[layout](v), atten_mask=MASK,
                   actual_seq_lengths=i64(q_lens), actual_seq_lengths_kv=i64(kv_lens), num_heads=num_heads,
                   num_key_value_heads=kv_heads, scale=0.2, input_layout=layout, sparse_mode=3, softmax_lse_flag=True)
    assert out.shape == to_layout[layout](q).shape and out.dtype == torch.bfloat16
    out = {"BSH": lambda t: t.view(3, S, num_heads, D), "BSND": lambda t: t,
           "BNSD": lambda t: t.transpose(1, 2)}[layout](out)
    for b, (sq, skv) in enumerate(zip(q_lens, kv_lens)):
        ref, ref_lse = attend(q[b, :sq], k[b, :skv], v[b, :skv], visible(sq, skv, "bottom_right"), 0.2)
        assert_rounded_close(out[b, :sq], ref)
        torch.testing.assert_close(lse[b, :, :sq, 0], ref_lse.T, atol=1e-2, rtol=1e-3)
        assert out[b, sq:].isnan().all(), "rows past actual_seq_lengths are undefined (NaN)"


def test_tnd_lengths_are_cumulative_and_kv_lengths_cumulative_without_paging():
    q_lens, kv_lens, N, D = [3, 5, 1], [4, 9, 11], 4, 128
    q, k, v = randn(9, N, D, seed=1), randn(24, 2, D, seed=2), randn(24, 2, D, seed=3)
    call = dict(atten_mask=MASK, num_heads=N, num_key_value_heads=2, scale=D**-0.5, input_layout="TND", sparse_mode=3)
    out, _ = fia(q, k, v, actual_seq_lengths=i64([3, 8, 9]), actual_seq_lengths_kv=i64([4, 13, 24]), **call)
    qs, ks = 0, 0
    for sq, skv in zip(q_lens, kv_lens):
        ref, _ = attend(q[qs:qs + sq], k[ks:ks + skv], v[ks:ks + skv], visible(sq, skv, "bottom_right"), D**-0.5)
        assert_rounded_close(out[qs:qs + sq], ref)
        qs, ks = qs + sq, ks + skv
    # The misreading that broke production stacks: per-sequence KV lengths without a block table
    # are accepted (they happen to be non-decreasing) and silently read the wrong keys.
    wrong, _ = fia(q, k, v, actual_seq_lengths=i64([3, 8, 9]), actual_seq_lengths_kv=i64(kv_lens), **call)
    assert not torch.allclose(wrong.float().nan_to_num(), out.float())


def test_tnd_kv_lengths_are_per_sequence_with_paging():
    q_lens, kv_lens, N, D, bs = [3, 5, 1], [4, 300, 129], 4, 128, 128
    q = randn(9, N, D, seed=1)
    ks = [randn(n, 2, D, seed=10 + i) for i, n in enumerate(kv_lens)]
    vs = [randn(n, 2, D, seed=20 + i) for i, n in enumerate(kv_lens)]
    k_cache, table = paged(ks, bs)
    v_cache, _ = paged(vs, bs)
    call = dict(atten_mask=MASK, block_table=table, block_size=bs, num_heads=N, num_key_value_heads=2,
                scale=D**-0.5, input_layout="TND", sparse_mode=3, actual_seq_lengths=i64([3, 8, 9]))
    out, _ = fia(q, k_cache, v_cache, actual_seq_lengths_kv=i64(kv_lens), **call)
    start = 0
    for b, (sq, skv) in enumerate(zip(q_lens, kv_lens)):
        ref, _ = attend(q[start:start + sq], ks[b], vs[b], visible(sq, skv, "bottom_right"), D**-0.5)
        assert_rounded_close(out[start:start + sq], ref)
        start += sq
    # The rule's own sensitivity: the decode row with its 129th key (block 1's only one) dropped fails it.
    dropped, _ = fia(q, k_cache, v_cache, actual_seq_lengths_kv=i64([4, 300, 128]), **call)
    with pytest.raises(AssertionError):
        assert_rounded_close(dropped[8:9], attend(q[8:9], ks[2], vs[2], visible(1, 129, "bottom_right"), D**-0.5)[0])
    # Cumulative KV lengths with a block table read past each sequence: refused here (the block
    # table is too narrow for 433 tokens), silently wrong on hardware when it is wide enough.
    with pytest.raises(ValueError, match="block_table has 3 columns"):
        fia(q, k_cache, v_cache, actual_seq_lengths_kv=i64([4, 304, 433]), **call)


@pytest.mark.parametrize("cache_layout, layout", [("BSH", "BNSD"), ("BNSD_CACHE", "BNSD"), ("BSH", "BSH")])
def test_paged_cache_layouts(cache_layout, layout):
    kv_lens, N, D, bs = [130, 7], 2, 64, 128
    ks = [randn(n, 1, D, seed=i) for i, n in enumerate(kv_lens)]
    vs = [randn(n, 1, D, seed=5 + i) for i, n in enumerate(kv_lens)]
    (k_cache, table), (v_cache, _) = paged(ks, bs, cache_layout), paged(vs, bs, cache_layout)
    q = randn(2, 4, N, D, seed=9)  # BSND view of the query
    query = q.transpose(1, 2).contiguous() if layout == "BNSD" else q.flatten(2)
    out, _ = fia(query, k_cache, v_cache, atten_mask=MASK, actual_seq_lengths=i64([4, 2]),
                 actual_seq_lengths_kv=i64(kv_lens), block_table=table, block_size=bs, num_heads=N,
                 num_key_value_heads=1, scale=0.1, input_layout=layout, sparse_mode=3)
    out = out.transpose(1, 2) if layout == "BNSD" else out.view(2, 4, N, D)
    for b, sq in enumerate([4, 2]):
        ref, _ = attend(q[b, :sq], ks[b], vs[b], visible(sq, kv_lens[b], "bottom_right"), 0.1)
        assert_rounded_close(out[b, :sq], ref)


# ---------------------------------------------------------------- sparse modes and masks


@pytest.mark.parametrize("sparse_mode, rule, mask, pre, nxt", [
    (0, "all", None, None, None),
    (2, "top_left", MASK, None, None),
    (3, "bottom_right", MASK, None, None),
    (4, "band", MASK, 3, 1),
    (4, "band", MASK, 2, -1),
])
def test_sparse_modes(sparse_mode, rule, mask, pre, nxt):
    sq, skv, D = 5, 9, 64  # sq < skv, so top-left and bottom-right differ
    q, k, v = randn(1, sq, 2, D, seed=1), randn(1, skv, 2, D, seed=2), randn(1, skv, 2, D, seed=3)
    band = {} if pre is None else dict(pre_tokens=pre, next_tokens=nxt)
    out, _ = fia(q, k, v, atten_mask=mask, num_heads=2, scale=0.3, input_layout="BSND", sparse_mode=sparse_mode, **band)
    ref, _ = attend(q[0], k[0], v[0], visible(sq, skv, rule, pre, nxt), 0.3)
    assert_rounded_close(out[0], ref)


@pytest.mark.parametrize("sparse_mode", [0, 1])
def test_full_mask_modes_apply_the_given_mask(sparse_mode):
    sq, skv, D = 4, 6, 32
    q, k, v = randn(1, sq, 2, D, seed=1), randn(1, skv, 2, D, seed=2), randn(1, skv, 2, D, seed=3)
    mask = torch.rand(sq, skv, generator=torch.Generator().manual_seed(4)) > 0.5
    mask[:, 0] = False  # every row keeps a key
    out, _ = fia(q, k, v, atten_mask=mask, num_heads=2, scale=0.3, input_layout="BSND", sparse_mode=sparse_mode)
    ref, _ = attend(q[0], k[0], v[0], ~mask, 0.3)
    assert_rounded_close(out[0], ref)


def test_query_s_1_takes_the_decode_branch_where_sparse_mode_has_no_effect():
    kv_lens, D, bs = [40, 17], 64, 16  # Q_S == 1 paged: 16-aligned block sizes are allowed
    ks = [randn(n, 2, D, seed=i) for i, n in enumerate(kv_lens)]
    vs = [randn(n, 2, D, seed=5 + i) for i, n in enumerate(kv_lens)]
    (k_cache, table), (v_cache, _) = paged(ks, bs), paged(vs, bs)
    q = randn(2, 1, 8 * D, seed=9)
    out, _ = fia(q, k_cache, v_cache, atten_mask=MASK, sparse_mode=2, actual_seq_lengths=i64([5]),
                 actual_seq_lengths_kv=i64(kv_lens), block_table=table, block_size=bs, num_heads=8,
                 num_key_value_heads=2, scale=0.1, input_layout="BSH")
    for b, skv in enumerate(kv_lens):  # top-left causal would let the single row see key 0 only
        ref, _ = attend(q[b].view(1, 8, D), ks[b], vs[b], visible(1, skv, "all"), 0.1)
        assert_rounded_close(out[b].view(1, 8, D), ref)


@pytest.mark.parametrize("inner_precise, expected", [(0, "nan"), (2, "zero")])
def test_rows_without_visible_keys_need_row_invalid_correction(inner_precise, expected):
    q, k, v = randn(1, 4, 2, 32, seed=1), randn(1, 2, 2, 32, seed=2), randn(1, 2, 2, 32, seed=3)
    out, _ = fia(q, k, v, atten_mask=MASK, num_heads=2, scale=0.3, input_layout="BSND", sparse_mode=3,
                 inner_precise=inner_precise)  # q_len 4 > kv_len 2: bottom-right rows 0 and 1 see no key
    rows = out[0, :2].float()
    assert rows.isnan().all() if expected == "nan" else (rows == 0).all()
    ref, _ = attend(q[0, 2:], k[0], v[0], visible(4, 2, "bottom_right")[2:], 0.3)
    assert_rounded_close(out[0, 2:], ref)


def test_softmax_lse_is_an_empty_tensor_unless_asked_for():
    q = randn(3, 2, 128, seed=1)
    out, lse = fia(q, q, q, atten_mask=MASK, actual_seq_lengths=i64([3]), actual_seq_lengths_kv=i64([3]), num_heads=2,
                   input_layout="TND", sparse_mode=3)
    assert lse.shape == (0,) and lse.dtype == torch.float32
    _, lse = fia(q, q, q, atten_mask=MASK, actual_seq_lengths=i64([3]), actual_seq_lengths_kv=i64([3]), num_heads=2,
                 input_layout="TND", sparse_mode=3, softmax_lse_flag=True, scale=0.5)
    _, ref = attend(q, q, q, visible(3, 3, "bottom_right"), 0.5)
    assert lse.shape == (3, 2, 1)
    torch.testing.assert_close(lse[..., 0], ref, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("layout, shape", [("BSH", (2, 3, 256)), ("BSND", (2, 3, 2, 128)), ("BNSD", (2, 2, 3, 128)),
                                           ("TND", (6, 2, 128))])
def test_fake_kernel_infers_the_real_output_shapes(layout, shape):
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = randn(*shape, seed=1)
    lengths = dict(actual_seq_lengths=i64([3, 6]), actual_seq_lengths_kv=i64([3, 6])) if layout == "TND" else {}
    call = dict(atten_mask=MASK, num_heads=2, input_layout=layout, sparse_mode=3, softmax_lse_flag=True, **lengths)
    real = fia(q, q, q, **call)
    with FakeTensorMode() as mode:
        fake_call = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        fake = fia(*(mode.from_tensor(q) for _ in range(3)), **fake_call)
    assert [t.shape for t in fake] == [t.shape for t in real]


# ---------------------------------------------------------------- calls the docs reject


def _tnd_call(**overrides):
    """A valid paged TND call; ``overrides`` break one documented rule."""
    q, cache = randn(4, 4, 128, seed=1), randn(3, 128, 2 * 128, seed=2)
    call = dict(query=q, key=cache, value=cache, atten_mask=MASK, actual_seq_lengths=i64([4]),
                actual_seq_lengths_kv=i64([4]), block_table=torch.tensor([[1]], dtype=torch.int32), num_heads=4,
                num_key_value_heads=2, input_layout="TND", sparse_mode=3, block_size=128)
    call.update(overrides)
    return call


REJECTED = {
    "query dtype float32": (dict(query=randn(4, 4, 128, dtype=torch.float32)), "float16 or bfloat16"),
    "TND in float16": (dict(query=randn(4, 4, 128, dtype=torch.float16), key=randn(3, 128, 256, dtype=torch.float16),
                            value=randn(3, 128, 256, dtype=torch.float16)), "TND supports bfloat16 only"),
    "TND head_dim 64": (dict(query=randn(4, 4, 64), key=randn(3, 128, 128), value=randn(3, 128, 128)),
                        "TND needs Q_D=K_D=V_D=128"),
    "GQA ratio 128": (dict(query=randn(4, 128, 128), num_heads=128, num_key_value_heads=1, key=randn(3, 128, 128),
                           value=randn(3, 128, 128)), "exceeds 64"),
    "heads not divisible": (dict(num_key_value_heads=3, key=randn(3, 128, 384), value=randn(3, 128, 384)),
                            "divisible by num_key_value_heads"),
    "block_size 64 with Q_S > 1": (dict(block_size=64, key=randn(3, 64, 256), value=randn(3, 64, 256)),
                                   "128..512, a multiple of 128"),
    "block_size 640": (dict(block_size=640, key=randn(3, 640, 256), value=randn(3, 640, 256)),
                       "128..512, a multiple of 128"),
    "no kv lengths with paging": (dict(actual_seq_lengths_kv=None), "requires actual_seq_lengths_kv"),
    "no query lengths in TND": (dict(actual_seq_lengths=None), "TND requires actual_seq_lengths"),
    "lengths not cumulative": (dict(actual_seq_lengths=i64([3, 1]), actual_seq_lengths_kv=i64([4, 4]),
                                    block_table=torch.ones(2, 1, dtype=torch.int32)), "cumulative"),
    "lengths as int32": (dict(actual_seq_lengths=torch.tensor([4], dtype=torch.int32)), "int64"),
    "TND query rows past the last length": (dict(actual_seq_lengths=i64([3]), actual_seq_lengths_kv=i64([4])),
                                            r"TND query T=4 must equal the last actual_seq_lengths entry, got 3"),
    "block table too narrow": (dict(actual_seq_lengths_kv=i64([200])), "block_table has 1 columns"),
    "block id out of range": (dict(block_table=torch.tensor([[7]], dtype=torch.int32)), "outside [0, 3)"),
    "block table int64": (dict(block_table=torch.tensor([[1]])), "int32"),
    "q_len > kv_len in TND sparse 3": (dict(actual_seq_lengths_kv=i64([2])), "q_len <= kv_len"),
    "TND sparse_mode 2": (dict(sparse_mode=2), "TND supports sparse_mode 0 without a mask, 3 or 4"),
    "TND sparse_mode 0 with a mask": (dict(sparse_mode=0), "TND supports sparse_mode 0 without a mask"),
    "sparse_mode 3 without mask": (dict(atten_mask=None), "requires the compressed atten_mask"),
    "sparse_mode 3 with a 1024 mask": (dict(atten_mask=MASK[:1024, :1024]), "(2048, 2048)"),
    "sparse_mode 3 with a lower-triangular mask": (dict(atten_mask=MASK.T.contiguous()), "strictly upper triangular"),
    "sparse_mode 5": (dict(sparse_mode=5), "not supported"),
    "non-contiguous query": (dict(query=randn(4, 128, 4, seed=1).transpose(1, 2)), "not contiguous"),
    "4-D cache with BSH query": (dict(query=randn(1, 4, 512), input_layout="BSH", actual_seq_lengths=i64([4]),
                                      key=randn(3, 2, 128, 128), value=randn(3, 2, 128, 128)),
                                 "(blocknum, KV_N, blocksize, D) for BNSD/TND"),
    "key/value caches of different shapes": (dict(value=randn(3, 128, 2 * 64)), "same shape"),
    "non-paged key with 3 heads": (dict(block_table=None, key=randn(4, 3, 128), value=randn(4, 3, 128)),
                                   "num_key_value_heads=2 heads"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_rejected_calls_raise_with_the_documented_limit(case):
    overrides, message = REJECTED[case]
    call = _tnd_call(**overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        fia(call.pop("query"), call.pop("key"), call.pop("value"), **call)


def test_the_valid_base_call_of_the_rejection_cases_runs():
    call = _tnd_call()
    out, _ = fia(call.pop("query"), call.pop("key"), call.pop("value"), **call)
    assert not out.isnan().any()


# ---------------------------------------------------------------- npu_scatter_nd_update_


def test_scatter_writes_rows_by_index_in_place():
    cache = torch.zeros(6, 2, 3, dtype=torch.bfloat16)
    rows = randn(3, 2, 3)
    out = scatter(cache, torch.tensor([[4], [0], [5]]), rows)
    assert out is cache
    for slot, row in zip((4, 0, 5), rows):
        assert torch.equal(cache[slot], row)
    assert (cache[[1, 2, 3]] == 0).all()


@pytest.mark.parametrize("indices, updates, message", [
    (torch.tensor([[-1]]), randn(1, 2, 3), "out of range"),
    (torch.tensor([[6]]), randn(1, 2, 3), "out of range"),
    (torch.tensor([[1]]), randn(1, 2, 3, dtype=torch.float16), "must equal input dtype"),
    (torch.tensor([[1]]), randn(1, 3, 3), "updates shape"),
    (torch.tensor([1]), randn(1, 2, 3), "at least 2 dims"),
    (torch.tensor([[1.0]]), randn(1, 2, 3), "int32 or int64"),
])
def test_scatter_rejects_what_the_doc_does_not_support(indices, updates, message):
    with pytest.raises(ValueError, match=message):
        scatter(torch.zeros(6, 2, 3, dtype=torch.bfloat16), indices, updates)
