"""Scaled KV caches (int8, fp8) in ``reshape_and_cache`` and ``paged_attention``.

The reference quantizes and dequantizes plainly here, row by row (max |x| / qmax, the values
divided by the scale and rounded, the scale's fp32 bytes after them), then runs the fp32 reference
attention of ``test_ops`` on what the cache holds. Both kernel sets (native and reference) run.
"""
import struct

import pytest
import torch
from hypothesis import given, settings

import pagedpack.kernels  # noqa: F401  (registers torch.ops.pagedpack.*)

from test_ops import GRID, PACKED_STEPS, PARAM_SETS, PARAMS, grid_params, make_params, reference_attention

ops = torch.ops.pagedpack
pytestmark = pytest.mark.usefixtures("cpu_kernels")

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
DTYPES = list(QMAX)
SCALED = tuple(QMAX)


def quantize(row: torch.Tensor, dtype) -> tuple[torch.Tensor, float]:
    """One fp32 row -> (its quantized values, its scale), as the cache stores them."""
    scale = float(torch.tensor(row.abs().max().item() / QMAX[dtype], dtype=torch.float32))  # fp32 division
    scale = scale if scale > 0 else 1.0
    q = (row / torch.tensor(scale, dtype=torch.float32)).clamp(-QMAX[dtype], QMAX[dtype])
    return (q.round() if dtype == torch.int8 else q).to(dtype), scale


def read_back(k: torch.Tensor, dtype) -> torch.Tensor:
    """``[tokens, heads, D]`` -> what a cache of ``dtype`` gives back, in fp32, row by row."""
    out = torch.empty_like(k)
    for t in range(k.shape[0]):
        for h in range(k.shape[1]):
            q, scale = quantize(k[t, h], dtype)
            out[t, h] = q.float() * scale
    return out


def write_all(seqs, dtype, *, num_kv_heads, head_dim, block_size, g):
    """Random K/V of each sequence written into fresh scaled caches with ``reshape_and_cache`` in
    two steps (the cached prefix, then this step's rows); returns the caches, block table and K/V."""
    total = sum(-(-(c + q) // block_size) for c, q in seqs)
    num_blocks = 2 * max(total, 1)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim + 4, dtype=dtype) for _ in range(2)]
    width = max(-(-(c + q) // block_size) for c, q in seqs) or 1
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    kvs, steps = [], ([], [])
    for b, (cached, q_len) in enumerate(seqs):
        n = -(-(cached + q_len) // block_size)
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        k, v = (torch.randn(cached + q_len, num_kv_heads, head_dim, generator=g) * 3 for _ in range(2))
        kvs.append((k, v))
        for p in range(cached + q_len):
            steps[p >= cached].append((k[p], v[p], int(table[b, p // block_size]) * block_size + p % block_size))
    for rows in steps:
        if rows:
            ks, vs, slots = zip(*rows)
            ops.reshape_and_cache(torch.stack(ks), torch.stack(vs), *caches, torch.tensor(slots))
    return caches, table, kvs


def run(seqs, dtype, *, ratio, head_dim, block_size, params=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    (key_cache, value_cache), table, kvs = write_all(seqs, dtype, num_kv_heads=2, head_dim=head_dim,
                                                     block_size=block_size, g=g)
    query = torch.randn(sum(q for _, q in seqs), 2 * ratio, head_dim, generator=g)
    cu = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c + q for c, q in seqs], dtype=torch.int32)
    params = params or {}
    out = ops.paged_attention(query, key_cache, value_cache, table, cu, lens, head_dim**-0.5, **params)
    expected = torch.cat([reference_attention(query[cu[b]:cu[b + 1]], read_back(k, dtype), read_back(v, dtype),
                                              head_dim**-0.5, **params) for b, (k, v) in enumerate(kvs)])
    return out, expected, (key_cache, table, kvs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
def test_rows_hold_the_quantized_values_and_their_scale(dtype):
    seqs = [(0, 21)]
    _, _, (key_cache, table, kvs) = run(seqs, dtype, ratio=1, head_dim=64, block_size=16)
    k = kvs[0][0]
    for p in (0, 5, 20):
        row = key_cache[table[0, p // 16], p % 16]
        for h in range(2):
            q, scale = quantize(k[p, h], dtype)
            assert torch.equal(row[h, :64].view(torch.uint8), q.view(torch.uint8))
            assert struct.unpack("<f", bytes(row[h, 64:].view(torch.uint8).tolist()))[0] == pytest.approx(scale, rel=0)


CASES = [c for c in GRID if c[1] in (1, 16)]  # the (q_len, kv_len) x block size x head dim x GQA grid


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(("pair", "block_size", "head_dim", "ratio"), CASES,
                         ids=[f"q{p[0]}-kv{p[1]}-bs{bs}-d{d}-gqa{r}" for p, bs, d, r in CASES])
def test_paged_attention_reads_scaled_caches(pair, block_size, head_dim, ratio, dtype):
    q_len, kv_len = pair
    out, expected, _ = run([(kv_len - q_len, q_len)], dtype, ratio=ratio, head_dim=head_dim, block_size=block_size)
    assert out.dtype == torch.float32 and out.shape == (q_len, 2 * ratio, head_dim)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("param_set", list(PARAM_SETS))
def test_scaled_caches_with_attention_parameters(param_set, dtype):
    """A chunk of 3 rows over 147 keys beside a 40-token prefill (the prefill path), each parameter set."""
    (q_len, kv_len), block_size, head_dim = (3, 147), 16, 64
    params = grid_params(param_set, kv_len, block_size, 4)
    out, expected, _ = run([(kv_len - q_len, q_len), (0, 40)], dtype, ratio=2, head_dim=head_dim,
                           block_size=block_size, params=params)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@settings(max_examples=12, deadline=None)
@given(**PACKED_STEPS, params=PARAMS)
def test_packed_steps_over_scaled_caches(seqs, block_size, head_dim, ratio, slot_dtype, seed, params):
    seqs = [(c, q) if c + q else (c, 1) for c, q in seqs]
    dtype = DTYPES[seed % 3]
    out, expected, _ = run(seqs, dtype, ratio=ratio, head_dim=head_dim, block_size=block_size,
                           params=make_params(2 * ratio, seed=seed, **params), seed=seed)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("amax", [1e-44, 1e-40, 1e-38])
def test_rows_of_subnormal_magnitude_are_stored_finite(dtype, amax):
    """A subnormal max|x| rounds max|x| / qmax down, so x / scale can pass qmax (e5m2 would store
    inf): the cache holds the clamped values, as the plain reference does, within max|x| of x."""
    key = (torch.tensor([1.0, -1.0, 0.5, 0.25]) * amax).repeat(16).view(1, 1, 64)
    cache = torch.zeros(1, 1, 1, 68, dtype=dtype)
    ops.reshape_and_cache(key, key.clone(), cache, cache.clone(), torch.tensor([0]))
    q, scale = quantize(key[0, 0], dtype)
    assert torch.equal(cache[0, 0, 0, :64].view(torch.uint8), q.view(torch.uint8))
    read = cache[0, 0, 0, :64].float() * cache[0, 0, 0, 64:].contiguous().view(torch.float32)
    assert read.isfinite().all() and (read - key[0, 0]).abs().max() <= amax


@pytest.mark.parametrize(("query_dtype", "cache_dtypes", "match"), [
    (torch.float32, (torch.int32, torch.int32), r"key_cache: expected dtype float32 .* got int32"),
    (torch.float32, (torch.uint8, torch.uint8), r"key_cache: expected dtype float32 .* got uint8"),
    (torch.float32, (torch.float16, torch.float32), r"value_cache: expected the dtype of key_cache"),
    (torch.float32, (torch.int8, torch.float32), r"value_cache: expected the dtype of key_cache"),
    (torch.int8, (torch.int8, torch.int8), r"query: expected dtype float32 .* got int8"),
    (torch.float8_e4m3fn, (torch.float32, torch.float32), r"query: expected dtype float32 .* got float8_e4m3fn"),
])
def test_cache_and_query_dtypes_are_named(query_dtype, cache_dtypes, match):
    """Both kernel sets refuse what they cannot read, naming the argument and the dtype."""
    row = lambda dtype: 68 if dtype in SCALED else 64  # noqa: E731
    caches = [torch.zeros(2, 16, 2, row(d), dtype=d) for d in cache_dtypes]
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        ops.paged_attention(torch.zeros(1, 2, 64).to(query_dtype), *caches, one[None, :1], one, one[1:], 0.125)
    if query_dtype == torch.float32:
        with pytest.raises(ValueError, match=match.replace("query", "key")):
            ops.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), *caches, torch.tensor([0]))


def test_a_value_cache_of_another_pool_size_is_named():
    """Slots index key_cache's blocks; a smaller value_cache is refused, not written past its end."""
    key_cache, value_cache = torch.zeros(4, 16, 2, 64), torch.zeros(1, 16, 2, 64)
    with pytest.raises(ValueError, match="value_cache"):
        ops.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), key_cache, value_cache, torch.tensor([63]))


def test_a_scaled_cache_of_the_wrong_row_length_is_named():
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.int8)  # no room for the scales
    with pytest.raises(ValueError, match=r"key: expected \(num_kv_heads, head_dim\) = \(2, 60\)"):
        ops.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), cache, cache.clone(), torch.tensor([0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
def test_every_stored_value_reads_back_exactly(dtype):
    """All 256 bytes (the NaN / infinity codes, which are never written, as 0) as value rows of scale 1,
    one 1-token sequence each: the output is each row as the dtype defines it."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    values = torch.where(values.float().isfinite(), values.float(), 0.0).to(dtype).view(16, 16)
    one = torch.tensor([1.0]).view(torch.uint8).view(dtype)
    value_cache = torch.cat([values, one.expand(16, 4)], dim=1).view(16, 1, 1, 20)
    key_cache = torch.zeros_like(value_cache)
    ids = torch.arange(16, dtype=torch.int32)
    out = ops.paged_attention(torch.randn(16, 1, 16), key_cache, value_cache, ids[:, None], torch.arange(17,
                              dtype=torch.int32), torch.ones(16, dtype=torch.int32), 0.25)
    assert torch.equal(out[:, 0], values.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_row_holding_inf_or_nan_reads_back_as_nan(dtype, bad):
    """Never as finite numbers (an fp32 cache would keep the inf / NaN); other rows are unaffected."""
    key = torch.randn(2, 2, 64)
    key[0, 1, 7] = bad
    cache = torch.zeros(1, 4, 2, 68, dtype=dtype)
    ops.reshape_and_cache(key, key.clone(), cache, cache.clone(), torch.tensor([0, 1]))
    values, scale = cache[0, :2, :, :64].float(), cache[0, :2, :, 64:].contiguous().view(torch.float32)[..., 0]
    assert scale[0, 1].isnan() and not values[0, 1].any()
    assert scale[[0, 1, 1], [0, 0, 1]].isfinite().all()
