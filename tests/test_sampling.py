"""SamplingParams validation, top-k/top-p masking against a plain reference, the Sampler."""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import Sampler, SamplingParams
from pagedpack.runtime.sampling_ops import apply_top_k_top_p, first_max, inverse_cdf


def make_request(request_id: str = "r", **params) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(**params))


# --- SamplingParams ---------------------------------------------------------------------------


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.stop_token_ids, p.ignore_eos) == (
        1.0, 1.0, 0, None, 16, [], False,
    )
    assert SamplingParams().stop_token_ids is not p.stop_token_ids


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("seed", 1.0),
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1),
    ],
)
def test_invalid_params_raise_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: expected .*got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("top_k", [0, -1, 5])
def test_valid_top_k_values(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


# --- apply_top_k_top_p against a per-row reference ---------------------------------------------


def reference_kept(row: list[float], top_k: int, top_p: float) -> set[int] | None:
    """Tokens a plain per-row computation keeps (ties ordered by token id, as documented);
    ``None`` when a cumulative mass lies within rounding distance of ``top_p``."""
    order = sorted(range(len(row)), key=lambda v: (-row[v], v))
    if top_k > 0:
        order = order[:top_k]
    if top_p >= 1:
        return set(order)
    peak = row[order[0]]
    weights = [math.exp(row[v] - peak) for v in order]
    total = sum(weights)
    kept, mass = set(), 0.0
    for v, w in zip(order, weights):
        kept.add(v)
        mass += w / total
        if abs(mass - top_p) < 1e-4:
            return None
        if mass >= top_p:
            break
    return kept


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=12),
            st.integers(-1, 14),
            st.sampled_from([0.05, 0.3, 0.5, 0.75, 0.9, 0.999, 1.0]),
        ),
        min_size=1,
        max_size=5,
    ),
    vocab=st.integers(1, 12),
)
def test_top_k_top_p_matches_reference(rows, vocab):
    logits = torch.tensor([(r + [0.0] * vocab)[:vocab] for r, _, _ in rows], dtype=torch.float32)
    top_k = torch.tensor([k for _, k, _ in rows])
    top_p = torch.tensor([p for _, _, p in rows], dtype=torch.float32)
    expected = [reference_kept(logits[b].tolist(), k, p) for b, (_, k, p) in enumerate(rows)]
    assume(None not in expected)
    masked = apply_top_k_top_p(logits, top_k, top_p)
    assert masked.dtype == logits.dtype and masked.shape == logits.shape
    for b in range(len(rows)):
        kept = {v for v in range(vocab) if masked[b, v] != -math.inf}
        assert kept == expected[b]
        assert torch.equal(masked[b, sorted(kept)], logits[b, sorted(kept)])


def test_top_p_examples():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p, expected in [(0.5, {0}), (0.7, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([top_p]))
        assert {v for v in range(4) if masked[0, v] != -math.inf} == expected, top_p


def test_top_p_after_top_k_renormalizes():
    # top_k=2 leaves [0.5, 0.3] -> renormalized [0.625, 0.375]; top_p=0.6 keeps only token 0.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(masked[0]).tolist() == [True, False, False, False]


# --- Sampler ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    requests = [make_request(str(i), temperature=0.0) for i in range(5)]
    assert Sampler()(logits, requests) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_takes_the_first_of_tied_maxima(dtype):
    """Low-precision logits tie often (bf16 keeps 8 bits): greedy is the lowest index among them."""
    logits = torch.zeros(3, 40, dtype=dtype)
    logits[0, [7, 3, 30]] = 2.5
    logits[1, [39, 0]] = 1.0
    logits[2, :] = -1.0
    requests = [make_request(str(i), temperature=0.0) for i in range(3)]
    assert Sampler()(logits, requests) == [3, 0, 0]


def test_top_k_1_is_greedy_at_any_temperature():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    requests = [make_request(str(i), temperature=2.0, top_k=1) for i in range(4)]
    assert Sampler()(logits, requests) == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_and_sampled_rows():
    logits = torch.full((3, 10), -30.0)
    logits[:, 7] = 0.0
    logits[1, 2] = 5.0
    requests = [
        make_request("a", temperature=0.0),
        make_request("b", temperature=1.0, top_k=1),
        make_request("c", temperature=0.7, seed=3),
    ]
    assert Sampler()(logits, requests) == [7, 2, 7]


def test_sampled_tokens_stay_in_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    requests = [make_request(str(i), top_p=0.7) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, requests)), minlength=4)
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() / 4000 - 0.5 / 0.8) < 0.04


def test_temperature_scales_the_distribution():
    base = torch.tensor([1.0, 0.0, -1.0])
    logits = base.expand(8000, 3)
    requests = [make_request(str(i), temperature=0.5, seed=i) for i in range(8000)]
    freq = torch.bincount(torch.tensor(Sampler()(logits, requests)), minlength=3) / 8000
    assert torch.allclose(freq, (base / 0.5).softmax(-1), atol=0.02)


def test_seeded_request_is_independent_of_batch():
    """The same seeded request draws the same tokens alone and amid other rows."""
    vocab, steps = 64, 6
    step_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    params = dict(temperature=1.3, top_p=0.95, top_k=40, seed=1234)

    alone = make_request("x", **params)
    tokens_alone = [Sampler()(lg[None], [alone])[0] for lg in step_logits]

    crowd = make_request("x", **params)
    tokens_crowd = []
    for s, lg in enumerate(step_logits):
        others = [make_request(f"o{j}", temperature=1.0, seed=None if j % 2 else 99 + j) for j in range(s % 3 + 1)]
        batch = others[: s % 2] + [crowd] + others[s % 2 :]
        logits = torch.randn(len(batch), vocab)
        logits[batch.index(crowd)] = lg
        tokens_crowd.append(Sampler()(logits, batch)[batch.index(crowd)])

    assert tokens_alone == tokens_crowd
    assert alone.generator is not None and crowd.generator is not alone.generator


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.zeros(1, 1000)
    a, b, c = (make_request(n, seed=s) for n, s in [("a", 7), ("b", 7), ("c", 8)])
    draws = {r.request_id: [Sampler()(logits, [r])[0] for _ in range(5)] for r in (a, b, c)}
    assert draws["a"] == draws["b"] != draws["c"]


def test_masked_vocab_is_never_sampled():
    logits = torch.full((500, 8), -math.inf)
    logits[:, [2, 5]] = 0.0
    requests = [make_request(str(i)) for i in range(500)]
    assert set(Sampler()(logits, requests)) == {2, 5}


def test_logits_shape_must_match_requests():
    with pytest.raises(ValueError, match=r"logits: expected shape \[2, vocab\]"):
        Sampler()(torch.zeros(3, 5), [make_request("a"), make_request("b")])


# --- the candidates' exact ranking on large vocabularies, and the draw ---------------------------


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(300, 1500), st.sampled_from([0.5, 0.25, 1 / 64]))
def test_candidates_keep_the_ranking_s_tokens_among_heavy_ties(data, vocab, step):
    """Logits on a coarse grid (bf16 logits tie this way): a top-k or nucleus cut often falls inside
    a run of equal values that reaches past the candidates ``torch.topk`` gave; the kept tokens are
    still the ranking's first (ties by id). Top-p alone may need more than TOP_P_GUESS candidates."""
    rows = data.draw(st.lists(st.tuples(st.integers(-1, vocab + 5), st.sampled_from([0.05, 0.5, 0.9, 0.99, 1.0]),
                                        st.integers(0, 2**31)), min_size=1, max_size=4))
    logits = torch.stack([(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2 / step).round() * step
                          for _, _, seed in rows])
    expected = [reference_kept(logits[b].tolist(), k, p) for b, (k, p, _) in enumerate(rows)]
    assume(None not in expected)
    masked = apply_top_k_top_p(logits, torch.tensor([k for k, _, _ in rows]), torch.tensor([p for _, p, _ in rows]))
    for b in range(len(rows)):
        assert {v for v in range(vocab) if masked[b, v] != -math.inf} == expected[b]


@pytest.mark.parametrize("vocab", [7, 1024, 3000, 49152])
def test_inverse_cdf_draws_each_token_with_its_probability(vocab):
    """Frequencies over 40,000 draws against the weights (zeros never drawn, block edges included)."""
    weights = torch.rand(1, vocab, generator=torch.Generator().manual_seed(vocab)) ** 4
    support = torch.tensor([0, vocab // 3, vocab // 2, vocab - 1])[: min(4, vocab)]
    row = torch.zeros(vocab)
    row[support] = weights[0, support]
    if vocab > 1024:
        row[1023] = row[1024] = 0.3  # the two sides of a block edge
        support = torch.cat([support, torch.tensor([1023, 1024])])
    n = 40000
    drawn = inverse_cdf(row.expand(n, vocab), torch.rand(n, dtype=torch.float64,
                                                         generator=torch.Generator().manual_seed(1)))
    counts = torch.bincount(drawn, minlength=vocab).double()
    assert counts[row == 0].sum() == 0
    expected = row.double() / row.double().sum() * n
    assert torch.all((counts[support] - expected[support]).abs() <= 5 * expected[support].sqrt() + 1)


def test_inverse_cdf_at_the_edges_of_the_uniform_range():
    """u = 0 takes the first token with weight; u just below 1 the last one (never a zero past it)."""
    row = torch.tensor([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0]])
    low, high = torch.tensor([0.0], dtype=torch.float64), torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(row, low).tolist() == [2] and inverse_cdf(row, high).tolist() == [4]


def test_a_row_with_no_finite_maximum_fails_alone():
    """NaN, +inf, or every token masked: that row's request is named in errors; the others sample."""
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = math.nan
    logits[2, 7] = math.inf
    logits[3] = -math.inf
    requests = [make_request(str(i), temperature=t) for i, t in enumerate([0.0, 1.0, 0.0, 1.0, 1.0])]
    out = Sampler().sample(logits, requests)
    assert set(out.errors) == {1, 2, 3}
    assert "request '1' can take no token" in out.errors[1] and "inf" in out.errors[2]
    assert "every logit is -inf" in out.errors[3]
    assert out.token_ids[0] == int(logits[0].argmax()) and 0 <= out.token_ids[4] < 32


@pytest.mark.parametrize("top_p", [1e-300, 5e-324])
def test_a_top_p_below_float32_keeps_the_most_likely_token(top_p):
    """top_p 1e-46 became 0 in float32 and masked every token (issue 51): the first token always stays."""
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    out = Sampler().sample(logits, [make_request(str(i), top_p=top_p) for i in range(64)])
    assert out.errors == {} and out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1, 5, 1023, 1024, 1025, 3000, 49152])
def test_first_max_is_torch_max_with_the_lowest_index_among_ties(vocab):
    """Coarse values tie often (bf16 logits); a row of -inf, and one with NaN, as torch.max gives them."""
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 2).round()
    logits[1] = -math.inf
    logits[2, vocab // 2] = math.nan
    logits[3, -1] = 1e30  # the maximum in the last, partial block
    values, indices = first_max(logits)
    expected_values, expected_indices = logits.max(dim=-1)
    rows = [0, 1, 3, 4, 5]
    assert torch.equal(values[rows], expected_values[rows]) and values[2].isnan()
    assert indices[rows].tolist() == expected_indices[rows].tolist() == [
        int((logits[r] == logits[r].max()).nonzero()[0]) for r in rows]
