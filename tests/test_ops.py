"""Tests of ``torch.ops.pagedpack.reshape_and_cache`` and ``paged_attention``.

The ops are compared with a reference written plainly here (token-by-token gathers, an explicit
boolean mask, ``repeat_interleave`` for grouped-query heads), never with themselves. The whole
module runs twice: with the native CPU kernels and with the PyTorch reference kernels
(``PAGEDPACK_NATIVE=0``).
"""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

import pagedpack.kernels  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.kernels.attention_params import AttentionParams

from conftest import assert_within_own_error

ops = torch.ops.pagedpack


pytestmark = pytest.mark.usefixtures("cpu_kernels")  # each test with both kernel sets (conftest)
PAIRS = [(1, 1), (1, 147), (3, 799), (127, 512), (127, 513), (64, 64), (0, 5)]  # (q_len, kv_len)
BLOCK_SIZES = [1, 16, 128]
HEAD_DIMS = [64, 80, 128]
GQA_RATIOS = [1, 2, 4, 7]


# ---------------------------------------------------------------- independent reference


def gather_kv(cache, block_row, kv_len):
    """``[kv_len, num_kv_heads, head_dim]`` of one sequence, read token by token via its blocks."""
    block_size, ids = cache.shape[1], block_row.tolist()
    rows = [cache[ids[p // block_size], p % block_size] for p in range(kv_len)]
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:])


def reference_attention(q, k, v, scale, dtype=torch.float32, *, sliding_window=None, logits_soft_cap=None,
                        alibi_slopes=None, sinks=None, attention_chunk_size=None, causal=True):
    """One sequence: ``q [q_len, H, D]``, ``k``/``v [kv_len, H_kv, D]``, computed in ``dtype``.

    Row ``i`` sits at position ``p = kv_len - q_len + i``; it sees key ``j`` if ``j <= p`` (causal)
    and ``j > p - sliding_window`` and ``j // c == p // c`` (``attention_chunk_size = c``). Scores
    ``q.k * scale``, then ``cap * tanh(s / cap)``, then ``+ slope[h] * (j - p)``, then the mask; a
    sink logit per head joins the softmax and its column is dropped. A row that sees no key is NaN
    here (without sinks)."""
    q_len, kv_len = q.shape[0], k.shape[0]
    i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    position = kv_len - q_len + i
    mask = j <= position if causal else torch.ones(q_len, kv_len, dtype=torch.bool)
    if sliding_window is not None:
        mask = mask & (j >= position - sliding_window + 1)
    if attention_chunk_size is not None:
        mask = mask & (j // attention_chunk_size == position // attention_chunk_size)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1).to(dtype), v.repeat_interleave(n_rep, dim=1).to(dtype)
    bias = torch.where(mask, 0.0, float("-inf")).to(dtype)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.to(dtype)[:, None, None] * (j - position).to(dtype)
    scores = scores + bias
    if sinks is not None:
        sink_column = sinks.to(dtype)[:, None, None].expand(-1, q_len, 1)
        weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def reference_paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale,
                              dtype=torch.float32, **params):
    cu = cu_seqlens_q.tolist()
    return torch.cat([
        reference_attention(query[cu[b]:cu[b + 1]], gather_kv(key_cache, block_table[b], kv_len),
                            gather_kv(value_cache, block_table[b], kv_len), scale, dtype, **params)
        for b, kv_len in enumerate(seq_lens.tolist())
    ])


# ---------------------------------------------------------------- inputs


def make_batch(q_lens, kv_lens, *, num_kv_heads=2, ratio=2, head_dim=64, block_size=16,
               dtype=torch.float32, g=None):
    """Random query and caches; block tables are a random permutation of a pool 3x the need.

    Unused block_table entries hold random (valid) ids, which the op must ignore.
    """
    g = g or torch.Generator().manual_seed(0)
    needed = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = 3 * max(sum(needed), 1)
    pool = torch.randperm(num_blocks, generator=g).split(needed + [num_blocks - sum(needed)])
    block_table = torch.randint(num_blocks, (len(kv_lens), max(needed + [1])), generator=g)
    for b, ids in enumerate(pool[:-1]):
        block_table[b, : len(ids)] = ids

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(
        query=randn(sum(q_lens), ratio * num_kv_heads, head_dim),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        block_table=block_table.int(),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def make_step(seqs, *, slot_dtype=torch.int64, g=None, **kw):
    """A packed step: ``seqs`` holds ``(num_cached, q_len)`` per sequence.

    The cached prefix is written into the caches token by token; this step's K/V are returned
    with their ``slot_mapping`` for ``reshape_and_cache``. ``full_kv`` is each sequence's whole
    K/V, contiguous, for the reference.
    """
    g = g or torch.Generator().manual_seed(0)
    batch = make_batch([q for _, q in seqs], [c + q for c, q in seqs], g=g, **kw)
    key_cache, value_cache = batch["key_cache"], batch["value_cache"]
    block_size = key_cache.shape[1]
    full_kv, new_k, new_v, slots = [], [], [], []
    for (cached, q_len), row in zip(seqs, batch["block_table"].tolist()):
        k, v = (torch.randn(cached + q_len, *key_cache.shape[2:], generator=g).to(key_cache.dtype)
                for _ in range(2))
        for p in range(cached):
            key_cache[row[p // block_size], p % block_size] = k[p]
            value_cache[row[p // block_size], p % block_size] = v[p]
        slots += [row[p // block_size] * block_size + p % block_size for p in range(cached, cached + q_len)]
        full_kv.append((k, v))
        new_k.append(k[cached:])
        new_v.append(v[cached:])
    slot_mapping = torch.tensor(slots, dtype=slot_dtype)
    return batch, dict(key=torch.cat(new_k), value=torch.cat(new_v), slot_mapping=slot_mapping), full_kv


def alibi_slopes(num_heads):
    """BLOOM's slopes ``2 ** (-8 (h + 1) / H)`` (for a power-of-two ``H``; any H works here)."""
    return torch.tensor([2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float32)


def make_params(num_heads, *, window=None, soft_cap=None, alibi=False, sinks=False, chunk=None, seed=0):
    """Keyword arguments of the attention parameters: the scalars as given, ALiBi slopes and
    random sink logits for ``num_heads`` heads if asked."""
    params = {}
    if window is not None:
        params["sliding_window"] = window
    if chunk is not None:
        params["attention_chunk_size"] = chunk
    if soft_cap is not None:
        params["logits_soft_cap"] = soft_cap
    if alibi:
        params["alibi_slopes"] = alibi_slopes(num_heads)
    if sinks:
        params["sinks"] = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) + 1.0
    return params


# ---------------------------------------------------------------- paged_attention numerics


# Every (q_len, kv_len) pair with every block size; head_dim and GQA ratio rotate so that each
# head_dim meets each ratio (i % 3, i % 4 walks all 12 combinations over the first 12 cases).
GRID = [(pair, bs, HEAD_DIMS[i % 3], GQA_RATIOS[i % 4])
        for i, (pair, bs) in enumerate(itertools.product(PAIRS, BLOCK_SIZES))]


@pytest.mark.parametrize(("pair", "block_size", "head_dim", "ratio"), GRID,
                         ids=[f"q{p[0]}-kv{p[1]}-bs{bs}-d{d}-gqa{r}" for p, bs, d, r in GRID])
def test_paged_attention_matches_reference_fp32(pair, block_size, head_dim, ratio, monkeypatch):
    monkeypatch.setenv("PAGEDPACK_VALIDATE", "1")  # valid metadata passes the value checks
    q_len, kv_len = pair
    batch = make_batch([q_len], [kv_len], ratio=ratio, head_dim=head_dim, block_size=block_size)
    out = ops.paged_attention(**batch)
    assert out.shape == (q_len, 2 * ratio, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_paged_attention(**batch), atol=1e-5, rtol=1e-5)


def windows(kv_len, block_size):
    """Sliding windows smaller than (one key; one that starts mid-block), equal to and larger than ``kv_len``."""
    mid = max(1, kv_len // 2 + block_size // 2 + 1)  # the last row's window starts inside a block
    return {"w1": 1, "mid": mid, "eq": max(kv_len, 1), "over": kv_len + 7}


# Each GRID case with every parameter alone and all together; windows per ``windows``.
PARAM_SETS = {"softcap": dict(soft_cap=5.0), "alibi": dict(alibi=True), "sinks": dict(sinks=True),
              "chunk": dict(chunk=7),  # not a multiple of any block size: chunks start mid-block
              "all": dict(window="mid", soft_cap=20.0, alibi=True, sinks=True),
              **{f"window-{name}": dict(window=name) for name in ("w1", "mid", "eq", "over")}}
PARAM_GRID = [(case, name) for case in GRID for name in PARAM_SETS]


def grid_params(name, kv_len, block_size, num_heads, seed=0):
    chosen = dict(PARAM_SETS[name])
    if "window" in chosen:
        chosen["window"] = windows(kv_len, block_size)[chosen["window"]]
    return make_params(num_heads, seed=seed, **chosen)


@pytest.mark.parametrize(("case", "param_set"), PARAM_GRID,
                         ids=[f"q{p[0]}-kv{p[1]}-bs{bs}-d{d}-gqa{r}-{name}" for (p, bs, d, r), name in PARAM_GRID])
def test_paged_attention_with_params_matches_reference_fp32(case, param_set, monkeypatch):
    monkeypatch.setenv("PAGEDPACK_VALIDATE", "1")
    (q_len, kv_len), block_size, head_dim, ratio = case
    batch = make_batch([q_len], [kv_len], ratio=ratio, head_dim=head_dim, block_size=block_size)
    params = grid_params(param_set, kv_len, block_size, 2 * ratio)
    out = ops.paged_attention(**batch, **params)
    assert out.shape == (q_len, 2 * ratio, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_paged_attention(**batch, **params), atol=1e-5, rtol=1e-5)


def test_each_parameter_changes_the_result():
    """Guard against a parameter being dropped silently: each one alone moves the output."""
    batch = make_batch([5, 1], [40, 33], block_size=4)
    plain = ops.paged_attention(**batch)
    for params in (dict(window=9), dict(soft_cap=0.5), dict(alibi=True), dict(sinks=True), dict(chunk=8)):
        assert (ops.paged_attention(**batch, **make_params(4, **params)) - plain).abs().max() > 1e-3, params


@pytest.mark.parametrize("with_params", [False, True], ids=["plain", "params"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_low_precision(dtype, with_params):
    """Error against the fp32 reference is within 2x what the reference itself loses in ``dtype``."""
    batch = make_batch([127, 1], [513, 147], ratio=4, head_dim=128, dtype=dtype)
    params = make_params(8, window=200, soft_cap=30.0, alibi=True, sinks=True) if with_params else {}
    out = ops.paged_attention(**batch, **params)
    assert out.dtype == dtype
    exact = reference_paged_attention(**batch, **params)
    low_precision = reference_paged_attention(**batch, dtype=dtype, **params)
    assert_within_own_error(out, low_precision, exact)
    seq_lens = batch["seq_lens"].clone()
    seq_lens[1] -= 1  # the decode row's newest key dropped: the rule must see it
    with pytest.raises(AssertionError):
        assert_within_own_error(ops.paged_attention(**dict(batch, seq_lens=seq_lens), **params), low_precision, exact)


SEQ = st.tuples(st.integers(0, 40), st.integers(0, 20))  # (num_cached, q_len)
# Packed steps of 1..5 sequences; ``@given(**PACKED_STEPS)`` (also used by the ONNX tests).
PACKED_STEPS = dict(
    seqs=st.lists(SEQ, min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 16]),
    head_dim=st.sampled_from(HEAD_DIMS),
    ratio=st.sampled_from(GQA_RATIOS),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31),
)


# Random attention parameters for ``make_params`` (``@given(params=PARAMS)``; also used by the ONNX tests).
PARAMS = st.fixed_dictionaries({}, optional=dict(
    window=st.integers(1, 45), soft_cap=st.floats(0.5, 30.0), alibi=st.just(True), sinks=st.just(True),
    chunk=st.integers(1, 45)))


@settings(max_examples=25, deadline=None)
@given(**PACKED_STEPS, params=PARAMS)
def test_packed_step_matches_reference(seqs, block_size, head_dim, ratio, slot_dtype, seed, params):
    """Prefill (0 cached), decode (q_len 1), chunked prefill and q_len 0 sequences, packed, with
    random attention parameters (none, some or all)."""
    seqs = [(c, q) if c + q else (c, 1) for c, q in seqs]  # a sequence holds at least one token
    batch, write, full_kv = make_step(seqs, slot_dtype=slot_dtype, g=torch.Generator().manual_seed(seed),
                                      ratio=ratio, head_dim=head_dim, block_size=block_size, num_kv_heads=1)
    params = make_params(ratio, seed=seed, **params)
    ops.reshape_and_cache(write["key"], write["value"], batch["key_cache"], batch["value_cache"],
                          write["slot_mapping"])
    out = ops.paged_attention(**batch, **params)
    cu = batch["cu_seqlens_q"].tolist()
    expected = torch.cat([reference_attention(batch["query"][cu[b]:cu[b + 1]], k, v, batch["scale"], **params)
                          for b, (k, v) in enumerate(full_kv)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero(monkeypatch):
    """Degenerate metadata (seq_lens < q_len, which validation rejects) must not produce NaN.

    Sequence 0: q_len 4 over 2 keys, so rows 0 and 1 see no key; sequence 1: no key at all.
    """
    monkeypatch.delenv("PAGEDPACK_VALIDATE", raising=False)
    batch = make_batch([4, 2], [2, 0])
    out = ops.paged_attention(**batch)
    assert not out.isnan().any()
    assert (out[:2] == 0).all() and (out[4:] == 0).all()
    k, v = (gather_kv(c, batch["block_table"][0], 2) for c in (batch["key_cache"], batch["value_cache"]))
    expected = reference_attention(batch["query"][:4], k, v, batch["scale"])  # rows 0, 1 are NaN here
    torch.testing.assert_close(out[2:4], expected[2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("param_set", ["window-w1", "sinks", "all"])
def test_fully_masked_rows_are_zero_with_params(param_set, monkeypatch):
    """The same degenerate step through the explicit path (a decode with no key, too)."""
    monkeypatch.delenv("PAGEDPACK_VALIDATE", raising=False)
    batch = make_batch([4, 2, 1], [2, 0, 0])
    params = grid_params(param_set, 2, 16, 4)
    out = ops.paged_attention(**batch, **params)
    assert not out.isnan().any()
    assert (out[:2] == 0).all() and (out[4:] == 0).all()
    k, v = (gather_kv(c, batch["block_table"][0], 2) for c in (batch["key_cache"], batch["value_cache"]))
    expected = reference_attention(batch["query"][:4], k, v, batch["scale"], **params)
    torch.testing.assert_close(out[2:4], expected[2:], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_named_slots_only(slot_dtype, cache_dtype, monkeypatch):
    monkeypatch.setenv("PAGEDPACK_VALIDATE", "1")  # -1 passes the value check
    num_blocks, block_size = 5, 4
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 8, 2, 16, generator=g)
    key_cache, value_cache = torch.randn(2, num_blocks, block_size, 2, 16, generator=g).to(cache_dtype)
    before = key_cache.clone(), value_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:8]
    slots[[2, 5]] = -1
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(slot_dtype))
    for cache, old, new in ((key_cache, before[0], key), (value_cache, before[1], value)):
        expected = old.clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                expected[s // block_size, s % block_size] = new[t].to(cache_dtype)
        assert torch.equal(cache, expected)


# ---------------------------------------------------------------- registration: opcheck, export


def _attention_samples():
    yield make_batch([3, 1, 5], [7, 20, 5], block_size=4)  # chunked prefill, decode, prefill
    yield make_batch([0, 2], [5, 2], ratio=1, head_dim=80, block_size=16)  # a q_len 0 sequence
    yield make_batch([4], [9], ratio=7, num_kv_heads=1, block_size=1, dtype=torch.bfloat16)
    mixed = make_batch([3, 1, 5], [7, 20, 5], block_size=4)
    yield dict(mixed, **make_params(4, window=3, soft_cap=10.0, alibi=True, sinks=True))
    yield dict(mixed, **make_params(4, window=6))  # a parameter alone; the others by default


@pytest.mark.parametrize("batch", list(_attention_samples()),
                         ids=["mixed", "qlen0", "bf16-gqa7", "mixed-all-params", "mixed-window"])
def test_opcheck_paged_attention(batch):
    torch.library.opcheck(ops.paged_attention.default, (), batch)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_opcheck_reshape_and_cache(slot_dtype):
    batch, write, _ = make_step([(3, 2), (0, 4)], slot_dtype=slot_dtype, block_size=4)
    write["slot_mapping"][1] = -1
    torch.library.opcheck(ops.reshape_and_cache.default, (),
                          dict(write, key_cache=batch["key_cache"], value_cache=batch["value_cache"]))


@pytest.mark.parametrize("with_params", [False, True], ids=["plain", "params"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_paged_attention_functional(slot_dtype, with_params):
    """The functional pair (ONNX export's form): same output as the reference, the caches come
    back written, the inputs are left as they were."""
    batch, write, full_kv = make_step([(3, 2), (0, 4), (17, 1)], slot_dtype=slot_dtype, block_size=4)
    params = make_params(4, window=5, soft_cap=8.0, alibi=True, sinks=True) if with_params else {}
    before = batch["key_cache"].clone(), batch["value_cache"].clone()
    args = dict(batch, **write, **params)
    out, key_cache, value_cache = ops.paged_attention_functional(**args)
    cu = batch["cu_seqlens_q"].tolist()
    expected = torch.cat([reference_attention(batch["query"][cu[b]:cu[b + 1]], k, v, batch["scale"], **params)
                          for b, (k, v) in enumerate(full_kv)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(batch["key_cache"], before[0]) and torch.equal(batch["value_cache"], before[1])
    ops.reshape_and_cache(write["key"], write["value"], *before, write["slot_mapping"])
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
    torch.library.opcheck(ops.paged_attention_functional.default, (), args)


class _Step(torch.nn.Module):
    def forward(self, query, key, value, key_cache, value_cache, slot_mapping, block_table, cu_seqlens_q,
                seq_lens):
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return ops.paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, 0.125)


def test_export_with_dynamic_token_and_batch_dims():
    tokens, seqs, width, blocks = Dim("T"), Dim("B"), Dim("max_blocks_per_seq"), Dim("num_blocks")
    dynamic = dict(query={0: tokens}, key={0: tokens}, value={0: tokens}, key_cache={0: blocks},
                   value_cache={0: blocks}, slot_mapping={0: tokens}, block_table={0: seqs, 1: width},
                   cu_seqlens_q={0: seqs + 1}, seq_lens={0: seqs})

    def inputs(seqs):
        batch, write, _ = make_step(seqs, block_size=4)
        return dict(write, **{k: v for k, v in batch.items() if k != "scale"})

    program = torch.export.export(_Step(), (), inputs([(3, 4), (9, 1)]), dynamic_shapes=dynamic)
    code = program.graph_module.code
    assert "pagedpack.reshape_and_cache.default" in code and "pagedpack.paged_attention.default" in code
    for step in ([(0, 7), (2, 1), (5, 3), (30, 0)], [(12, 2), (1, 3)]):  # other T, B, widths, pools
        eager = inputs(step)
        exported = {k: v.clone() for k, v in eager.items()}
        torch.testing.assert_close(program.module()(**exported), _Step()(**eager))
        assert torch.equal(exported["key_cache"], eager["key_cache"])  # the cache write is kept


class _StepWithParams(_Step):
    """``_Step`` with every attention parameter, the tensors as buffers, passed by keyword."""

    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(4))
        self.register_buffer("sinks", torch.randn(4, generator=torch.Generator().manual_seed(3)))

    def forward(self, query, key, value, key_cache, value_cache, slot_mapping, block_table, cu_seqlens_q,
                seq_lens):
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return ops.paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, 0.125,
                                   sliding_window=5, logits_soft_cap=12.5, alibi_slopes=self.slopes, sinks=self.sinks)


def test_export_keeps_the_attention_params():
    """A ``.pt2``-style program carries the parameters; they read back by name off its graph."""
    batch, write, full_kv = make_step([(3, 4), (9, 1)], block_size=4)
    inputs = dict(write, **{k: v for k, v in batch.items() if k != "scale"})
    module = _StepWithParams()
    program = torch.export.export(module, (), {k: v.clone() for k, v in inputs.items()})
    (node,) = [n for n in program.graph.nodes if n.target is ops.paged_attention.default]
    params = AttentionParams.from_node(node)
    assert (params.scale, params.sliding_window, params.logits_soft_cap) == (0.125, 5, 12.5)
    assert all(isinstance(t, torch.fx.Node) for t in (params.alibi_slopes, params.sinks))
    got = program.module()(**{k: v.clone() for k, v in inputs.items()})
    expected = torch.cat([reference_attention(batch["query"][a:b], k, v, 0.125, sliding_window=5,
                                              logits_soft_cap=12.5, alibi_slopes=module.slopes, sinks=module.sinks)
                          for (a, b), (k, v) in zip([(0, 4), (4, 5)], full_kv)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- AttentionParams


def _call_node(op, args, kwargs):
    graph = torch.fx.Graph()
    placeholders = [graph.placeholder(f"x{i}") if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    kw = {k: graph.placeholder(k) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return graph.call_function(op, tuple(placeholders), kw)


def test_params_read_back_by_name_however_the_call_spells_them():
    b = make_batch([3, 1], [7, 2], block_size=4)
    tensors = [b[k] for k in ("query", "key_cache", "value_cache", "block_table", "cu_seqlens_q", "seq_lens")]
    params = AttentionParams(0.5, sliding_window=7, logits_soft_cap=30.0, alibi_slopes=alibi_slopes(4),
                             sinks=torch.zeros(4), attention_chunk_size=16)
    by_keyword = AttentionParams.from_node(_call_node(ops.paged_attention.default, tensors, params.op_kwargs()))
    positional = AttentionParams.from_node(_call_node(
        ops.paged_attention.default, [*tensors, *params.op_kwargs().values()], {}))
    old_style = AttentionParams.from_node(_call_node(ops.paged_attention.default, [*tensors, 0.25], {}))
    for read in (by_keyword, positional):
        assert (read.scale, read.sliding_window, read.logits_soft_cap, read.attention_chunk_size) == (0.5, 7, 30.0, 16)
        assert read.alibi_slopes.op == read.sinks.op == "placeholder"
    assert old_style.scale == 0.25 and old_style.is_default and old_style.describe() == ""
    assert params.describe() == "window=7, soft_cap=30.0, alibi, sinks, chunk=16"
    assert AttentionParams(1.0, sliding_window=512, logits_soft_cap=50.0).describe() == "window=512, soft_cap=50.0"
    assert list(params.op_kwargs()) == ["scale", "sliding_window", "logits_soft_cap", "alibi_slopes", "sinks",
                                        "attention_chunk_size"]
    varlen = _call_node(ops.varlen_attention.default, [*tensors[:3], tensors[4], 0.5, True], dict(sliding_window=3))
    assert AttentionParams.from_node(varlen).sliding_window == 3


@pytest.mark.parametrize(("field", "value"), [("sliding_window", 0), ("sliding_window", 2.0), ("sliding_window", True),
                                              ("logits_soft_cap", -1.0), ("logits_soft_cap", float("nan")),
                                              ("alibi_slopes", torch.ones(2, 2)), ("sinks", torch.ones(4).long())])
def test_params_record_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        AttentionParams(1.0, **{field: value})


def test_from_node_refuses_a_node_without_scale():
    node = _call_node(ops.reshape_and_cache.default, [torch.zeros(1)] * 5, {})
    with pytest.raises(ValueError, match="attention op"):
        AttentionParams.from_node(node)


# ---------------------------------------------------------------- argument checks


def _bad_attention_args():
    b = make_batch([3, 2], [5, 2], block_size=4)  # 4 query heads, 2 kv heads, head_dim 64
    return [
        ("query", dict(b, query=b["query"][0])),
        ("key_cache", dict(b, key_cache=b["key_cache"][0])),
        ("key_cache", dict(b, value_cache=b["value_cache"][:-1])),
        ("query", dict(b, query=b["query"][:, :3])),  # 3 heads over 2 kv heads
        ("query", dict(b, query=b["query"][..., :32])),  # head_dim 32 vs 64
        ("block_table", dict(b, block_table=b["block_table"].long())),
        ("cu_seqlens_q", dict(b, cu_seqlens_q=b["cu_seqlens_q"].long())),
        ("seq_lens", dict(b, seq_lens=b["seq_lens"].float())),
        ("cu_seqlens_q", dict(b, cu_seqlens_q=b["cu_seqlens_q"][:-1])),
        ("block_table", dict(b, block_table=b["block_table"][:1])),
        ("seq_lens", dict(b, seq_lens=b["seq_lens"].to("meta"))),  # the one cpu tensor on the meta run
        ("sliding_window", dict(b, sliding_window=0)),
        ("logits_soft_cap", dict(b, logits_soft_cap=0.0)),
        ("logits_soft_cap", dict(b, logits_soft_cap=float("inf"))),
        ("alibi_slopes", dict(b, alibi_slopes=torch.ones(3))),  # 3 slopes for 4 heads
        ("alibi_slopes", dict(b, alibi_slopes=torch.ones(4, dtype=torch.int64))),
        ("sinks", dict(b, sinks=torch.ones(1, 4))),
        ("sinks", dict(b, sinks=torch.ones(4, device="meta"))),
    ]


def _bad_cache_args():
    batch, w, _ = make_step([(3, 2), (0, 4)], block_size=4)
    w = dict(w, key_cache=batch["key_cache"], value_cache=batch["value_cache"])
    return [
        ("key", dict(w, key=w["key"][0])),
        ("key", dict(w, key=w["key"][:, :, :1])),
        ("value", dict(w, value=w["value"][..., :32])),
        ("value", dict(w, value=w["value"][:-1])),
        ("key_cache", dict(w, value_cache=w["value_cache"][:-1])),
        ("slot_mapping", dict(w, slot_mapping=w["slot_mapping"].float())),
        ("slot_mapping", dict(w, slot_mapping=w["slot_mapping"][None])),
        ("slot_mapping", dict(w, slot_mapping=w["slot_mapping"][:-1])),
        ("slot_mapping", dict(w, slot_mapping=w["slot_mapping"].to("meta"))),
    ]


BAD_ARGS = [("paged_attention", arg, kw) for arg, kw in _bad_attention_args()] + \
           [("reshape_and_cache", arg, kw) for arg, kw in _bad_cache_args()]


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta runs the fake kernel
@pytest.mark.parametrize(("op", "arg", "kwargs"), BAD_ARGS,
                         ids=[f"{op}-{arg}-{i}" for i, (op, arg, _) in enumerate(BAD_ARGS)])
def test_shape_and_dtype_checks(op, arg, kwargs, device):
    if device == "meta":  # move everything to meta; a tensor already on meta goes to cpu instead
        kwargs = {k: (torch.empty_like(v, device="cpu") if v.is_meta else v.to("meta"))
                  if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=rf"^{op}: {arg}: expected .*, got "):
        getattr(ops, op)(**kwargs)


def _bad_values():
    b = make_batch([3, 2, 1], [5, 2, 9], block_size=4)  # T=6, blocks needed [2, 1, 3], width 3
    bt = b["block_table"].clone()
    bt[2, 1] = b["key_cache"].shape[0]  # one past the pool

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32)

    return {
        "non-monotone": ("cu_seqlens_q", "non-decreasing", dict(b, cu_seqlens_q=i32(0, 4, 3, 6))),
        "start": ("cu_seqlens_q", r"\[0\] == 0", dict(b, cu_seqlens_q=i32(1, 3, 5, 6))),
        "end": ("cu_seqlens_q", "num_tokens=6", dict(b, cu_seqlens_q=i32(0, 3, 5, 5))),
        "seq-lens": ("seq_lens", r"seq_lens\[1\] >= q_len=2", dict(b, seq_lens=i32(5, 1, 9))),
        "block-id": ("block_table", "block ids in", dict(b, block_table=bt)),
        "too-narrow": ("block_table", "at least 4 columns", dict(b, seq_lens=i32(5, 2, 13))),
    }


@pytest.mark.parametrize("case", list(_bad_values()))
def test_value_checks_when_validating(case, monkeypatch):
    monkeypatch.setenv("PAGEDPACK_VALIDATE", "1")
    arg, detail, kwargs = _bad_values()[case]
    with pytest.raises(ValueError, match=rf"^{arg}: expected .*{detail}"):
        ops.paged_attention(**kwargs)


@pytest.mark.parametrize("slot", [-2, 20])
def test_slot_check_when_validating(slot, monkeypatch):
    monkeypatch.setenv("PAGEDPACK_VALIDATE", "1")
    key = torch.randn(3, 2, 8)
    cache = torch.zeros(5, 4, 2, 8)  # 20 slots
    with pytest.raises(ValueError, match=rf"^slot_mapping: expected .*got slot_mapping\[1\]={slot}"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, slot, -1]))
