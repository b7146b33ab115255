"""pagedpack::varlen_attention against a plainly written explicit-mask fp32 reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedpack.kernels.varlen  # noqa: F401  (registers the op)

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # each test with both kernel sets (conftest)


def reference(q, k, v, cu, scale, causal, sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
    """Per sequence: repeat KV heads, explicit mask (row ``i`` sees ``j <= i`` if causal and
    ``j > i - sliding_window``), soft cap, ALiBi ``slope * (j - i)``, sink column; fp64 softmax."""
    rows = []
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        n_rep = q.shape[1] // k.shape[1]
        kk, vv = (t[a:b].repeat_interleave(n_rep, dim=1).double() for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.double()[:, None, None] * (j - i)
        mask = j <= i if causal else torch.ones(n, n, dtype=torch.bool)
        if sliding_window is not None:
            mask = mask & (j > i - sliding_window)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink_column = sinks.double()[:, None, None].expand(-1, n, 1)
            weights = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        rows.append(torch.einsum("hqk,khd->qhd", weights, vv))
    return torch.cat(rows).float() if rows else q.new_zeros(0, q.shape[1], v.shape[2])


def params_for(num_heads, window=None, soft_cap=None, alibi=False, sinks=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = dict(sliding_window=window, logits_soft_cap=soft_cap)
    if alibi:
        params["alibi_slopes"] = torch.rand(num_heads, generator=g)
    if sinks:
        params["sinks"] = torch.randn(num_heads, generator=g)
    return params


def test_sinks_are_granite_swa_s_logsumexp_gate():
    """A sink ``s`` joining the softmax as one more column (gpt-oss) is Granite-SWA's gate
    ``softmax(scores) @ v * sigmoid(logsumexp(scores) - s)`` (modeling_granite_swa): ``sigmoid(l - s) =
    e^l / (e^l + e^s)`` with ``l = logsumexp(scores)``; here on causal fp64 scores, sinks from -4 to 4."""
    q, k, v, cu = make([9, 1, 30], num_kv_heads=2, ratio=2, head_dim=8, seed=3)
    sinks = torch.linspace(-4.0, 4.0, 4)
    ours = torch.ops.pagedpack.varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 0.3, True, sinks=sinks)
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].repeat_interleave(2, 1).double()) * 0.3
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        gate = (scores.logsumexp(-1) - sinks.double()[:, None]).sigmoid()
        theirs = scores.softmax(-1) @ v[a:b].repeat_interleave(2, 1).double().transpose(0, 1) * gate[..., None]
        torch.testing.assert_close(ours[a:b], theirs.transpose(0, 1).float(), rtol=1e-5, atol=1e-5)


PARAMS = st.fixed_dictionaries({}, optional=dict(
    window=st.integers(1, 45), soft_cap=st.floats(0.5, 30.0), alibi=st.just(True), sinks=st.just(True)))


def make(lens, num_kv_heads, ratio, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, num_kv_heads * ratio, head_dim, generator=g)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return q, k, v, cu


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=5), ratio=st.sampled_from([1, 2, 4, 7]),
       head_dim=st.sampled_from([16, 64, 80]), causal=st.booleans())
def test_matches_reference(lens, ratio, head_dim, causal):
    q, k, v, cu = make(lens, 2, ratio, head_dim)
    scale = head_dim ** -0.5
    out = torch.ops.pagedpack.varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), scale, causal)
    torch.testing.assert_close(out, reference(q, k, v, cu, scale, causal), atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=5), ratio=st.sampled_from([1, 2, 4, 7]),
       head_dim=st.sampled_from([16, 64, 80]), causal=st.booleans(), params=PARAMS)
def test_matches_reference_with_params(lens, ratio, head_dim, causal, params):
    q, k, v, cu = make(lens, 2, ratio, head_dim)
    scale = head_dim ** -0.5
    params = params_for(2 * ratio, **params)
    out = torch.ops.pagedpack.varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), scale, causal, **params)
    torch.testing.assert_close(out, reference(q, k, v, cu, scale, causal, **params), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 4, 5, 9], ids=lambda w: f"window{w}")
def test_window_around_the_sequence_length(window, causal):
    """Windows below, at and above a 5-token sequence, with the other parameters."""
    q, k, v, cu = make([5, 3], 2, 2, 16)
    params = params_for(4, window=window, soft_cap=4.0, alibi=True, sinks=True)
    out = torch.ops.pagedpack.varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 0.25, causal, **params)
    torch.testing.assert_close(out, reference(q, k, v, cu, 0.25, causal, **params), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_params", [False, True], ids=["plain", "params"])
@pytest.mark.parametrize("causal", [True, False])
def test_opcheck(causal, with_params):
    q, k, v, cu = make([3, 0, 5, 1], 2, 2, 16)
    params = params_for(4, window=2, soft_cap=3.0, alibi=True, sinks=True) if with_params else {}
    torch.library.opcheck(torch.ops.pagedpack.varlen_attention.default,
                          (q, k, v, torch.tensor(cu, dtype=torch.int32), 0.25, causal), params)


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, cu: (q, k[:-1], v, cu), "key: expected T="),
    (lambda q, k, v, cu: (q, k, v, cu.long()), "cu_seqlens: expected dtype int32"),
    (lambda q, k, v, cu: (q.long(), k, v, cu), "query: expected dtype float32 .* got int64"),
    (lambda q, k, v, cu: (q[:, :3], k, v, cu), "query: expected num_heads divisible by num_kv_heads=2"),
])
def test_bad_arguments_are_named(bad, message):
    q, k, v, cu = make([3, 5], 2, 2, 16)
    with pytest.raises(ValueError, match=message):
        torch.ops.pagedpack.varlen_attention(*bad(q, k, v, torch.tensor(cu, dtype=torch.int32)), 0.25, True)


@pytest.mark.parametrize("params, message", [
    (dict(sliding_window=0), "sliding_window: expected None or an int >= 1, got 0"),
    (dict(logits_soft_cap=-2.0), "logits_soft_cap: expected None or a finite float > 0"),
    (dict(alibi_slopes=torch.ones(2)), r"alibi_slopes: expected shape \[num_heads\] = \(4,\)"),
    (dict(sinks=torch.ones(4, dtype=torch.int32)), "sinks: expected dtype float32 .* got int32"),
])
def test_bad_params_are_named(params, message):
    q, k, v, cu = make([3, 5], 2, 2, 16)
    with pytest.raises(ValueError, match=f"^varlen_attention: {message}"):
        torch.ops.pagedpack.varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 0.25, True, **params)
