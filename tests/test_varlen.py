"""pagedpack::varlen_attention against a plainly written explicit-mask fp32 reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedpack.kernels.varlen  # noqa: F401  (registers the op)


def reference(q, k, v, cu, scale, causal):
    """Per sequence: repeat KV heads, explicit mask, fp32 softmax."""
    rows = []
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        n_rep = q.shape[1] // k.shape[1]
        kk, vv = (t[a:b].repeat_interleave(n_rep, dim=1).double() for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        rows.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(rows).float() if rows else q.new_zeros(0, q.shape[1], v.shape[2])


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


@pytest.mark.parametrize("causal", [True, False])
def test_opcheck(causal):
    q, k, v, cu = make([3, 0, 5, 1], 2, 2, 16)
    torch.library.opcheck(torch.ops.pagedpack.varlen_attention.default,
                          (q, k, v, torch.tensor(cu, dtype=torch.int32), 0.25, causal))


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v, cu: (q, k[:-1], v, cu), "key: expected T="),
    (lambda q, k, v, cu: (q, k, v, cu.long()), "cu_seqlens: expected dtype int32"),
    (lambda q, k, v, cu: (q.long(), k, v, cu), "query: expected a floating-point dtype"),
    (lambda q, k, v, cu: (q[:, :3], k, v, cu), "query: expected num_heads divisible by num_kv_heads=2"),
])
def test_bad_arguments_are_named(bad, message):
    q, k, v, cu = make([3, 5], 2, 2, 16)
    with pytest.raises(ValueError, match=message):
        torch.ops.pagedpack.varlen_attention(*bad(q, k, v, torch.tensor(cu, dtype=torch.int32)), 0.25, True)
