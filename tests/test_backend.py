"""torch.compile(model, backend="pagedpack"): padded forwards run packed, same values as eager."""
import random

import pytest
import torch
from torch._dynamo.utils import counters

import pagedpack.backend as backend
from pagedpack.models.tiny import FAMILIES, tiny_model


def padded_batch(rng: random.Random, batch: int, seq: int, left: bool):
    """Random ids and a left/right-padded mask; rows may be empty."""
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(rng.randrange(10**6)))
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        n = rng.randint(0, seq) if batch > 1 else rng.randint(1, seq)
        if left:
            mask[b, seq - n:] = 1
        else:
            mask[b, :n] = 1
    return ids, mask


def calls(seed: int, n: int, shapes=()):
    rng = random.Random(seed)
    shapes = list(shapes) + [(rng.randint(1, 4), rng.randint(1, 24)) for _ in range(n - len(shapes))]
    return [padded_batch(rng, b, s, rng.random() < 0.5) for b, s in shapes]


def assert_matches_per_sequence(model, ids, mask, logits, padding_zero=True):
    """Real positions equal the unmodified model run on that row alone; padding is zero."""
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        assert not (padding_zero and logits[b][~real].any())
        if real.any():
            with torch.no_grad():
                ref = model(ids[b][real][None], use_cache=False).logits[0]
            torch.testing.assert_close(logits[b][real], ref, atol=1e-4, rtol=0)


def count_graphs(model, batches, **compile_kwargs) -> int:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, **compile_kwargs)
    with torch.no_grad():
        for ids, mask in batches:
            compiled(input_ids=ids, attention_mask=mask)
    return counters["stats"]["unique_graphs"]


# The first calls include batch 1 and length 1, which Dynamo itself specialises.
FIRST_SHAPES = [(3, 10), (2, 7), (1, 5), (4, 1), (1, 1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_calls_match_eager_and_compile_no_more_than_dynamo(family):
    model = tiny_model(family)
    first, more = calls(1, 50, FIRST_SHAPES), calls(2, 50)
    eager_graphs = count_graphs(model, first, backend="eager", dynamic=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    with torch.no_grad():
        for ids, mask in first:
            assert_matches_per_sequence(model, ids, mask, compiled(input_ids=ids, attention_mask=mask).logits)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs <= eager_graphs
        for ids, mask in more:
            assert_matches_per_sequence(model, ids, mask, compiled(input_ids=ids, attention_mask=mask).logits)
    assert counters["stats"]["unique_graphs"] == graphs
    packed = [r for r in backend.LAST_REPORTS[-graphs:] if r.num_rewritten]
    assert packed and all(r.num_rewritten == model.config.num_hidden_layers for r in packed)


def test_default_dynamic_packs_from_the_first_dynamic_graph():
    """With dynamic=None, Dynamo's first graph is static: it runs as captured (reported), and
    the graph Dynamo compiles on the next shape is packed."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="pagedpack")
    batches = calls(4, 3, [(3, 10), (2, 7), (4, 9)])
    with torch.no_grad():
        for i, (ids, mask) in enumerate(batches):
            out = compiled(input_ids=ids, attention_mask=mask).logits
            assert_matches_per_sequence(model, ids, mask, out, padding_zero=i > 0)
    assert "static shapes" in backend.LAST_REPORTS[-2].notes[0]
    assert backend.LAST_REPORTS[-1].num_rewritten == model.config.num_hidden_layers


def test_all_padding_row_and_single_token():
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="pagedpack", dynamic=True, fullgraph=True)
    ids = torch.randint(0, 256, (3, 6))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        assert_matches_per_sequence(model, ids, mask, compiled(input_ids=ids, attention_mask=mask).logits)
        one = torch.tensor([[42]])
        assert_matches_per_sequence(model, one, torch.ones_like(one),
                                    compiled(input_ids=one, attention_mask=torch.ones_like(one)).logits)
    assert not counters["graph_break"]


def test_fullgraph_has_no_graph_break():
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("qwen2")
    ids, mask = padded_batch(random.Random(0), 3, 12, left=True)
    with torch.no_grad():
        compiled = torch.compile(model, backend="pagedpack", fullgraph=True, dynamic=True)
        out = compiled(input_ids=ids, attention_mask=mask)
    assert_matches_per_sequence(model, ids, mask, out.logits)
    assert not counters["graph_break"]
    assert backend.LAST_REPORTS[-1].num_rewritten == model.config.num_hidden_layers


def test_inductor_hand_off_keeps_values_and_custom_ops_opaque():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = tiny_model("mistral")
    compiled = torch.compile(model, backend="pagedpack", dynamic=True, options={"inductor": True})
    batches = calls(3, 4, [(3, 9), (2, 5), (4, 1)])  # the last: sizes Dynamo would specialise
    with torch.no_grad():
        out, code = run_and_get_code(compiled, input_ids=batches[0][0], attention_mask=batches[0][1])
        assert_matches_per_sequence(model, *batches[0], out.logits)
        for ids, mask in batches[1:]:
            assert_matches_per_sequence(model, ids, mask, compiled(input_ids=ids, attention_mask=mask).logits)
    assert any("torch.ops.pagedpack.varlen_attention" in c for c in code)


def test_unknown_option_is_a_clear_error():
    torch._dynamo.reset()
    compiled = torch.compile(tiny_model("llama"), backend="pagedpack", options={"inductr": True})
    with pytest.raises(Exception, match=r"options: expected keys among \['inductor'\], got \['inductr'\]"):
        compiled(input_ids=torch.ones(1, 3, dtype=torch.long))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_window_rows_longer_than_the_window(attn):
    """Mistral's window (24) is read off the mask probed past it; rows of 5..70 tokens match."""
    model = tiny_model("mistral", sliding_window=24, attn_implementation=attn)
    torch._dynamo.reset()
    backend.LAST_REPORTS.clear()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    ids, mask = padded_batch(random.Random(3), 3, 70, left=False)
    mask[:, :5] = 1
    mask[1, :] = 1
    with torch.no_grad():
        logits = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert [s.params for s in backend.LAST_REPORTS[-1].sites] == ["window=24"] * 2
    assert_matches_per_sequence(model, ids, mask, logits)
