"""torch.compile(model, backend="pagedpack"): padded forwards run packed, same values as eager."""
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import pagedpack.compiler.backend as backend
from pagedpack.compiler.backend import sample_lengths
from pagedpack.models.tiny import tiny_model


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


def count_graphs(model, batches, call=None, **compile_kwargs) -> int:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, **compile_kwargs)
    with torch.no_grad():
        for ids, mask in batches:
            compiled(input_ids=ids, attention_mask=mask, **(call or {}))
    return counters["stats"]["unique_graphs"]


# The first calls include batch 1 and length 1, which Dynamo itself specialises.
FIRST_SHAPES = [(3, 10), (2, 7), (1, 5), (4, 1), (1, 1)]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_padded_calls_match_eager_and_compile_no_more_than_dynamo(family):
    """Llama and Mistral (Qwen2 differs from Llama by projection biases only, which the backend
    never sees), the KV cache returned (use_cache) but for Mistral: its window (12) engages in these
    rows, and a sliding-window cache is left as captured (the next test)."""
    model = tiny_model(family)
    call = dict(use_cache=False) if family == "mistral" else {}
    first, more = calls(1, 12, FIRST_SHAPES), calls(2, 6)  # random batch sizes, lengths and paddings
    eager_graphs = count_graphs(model, first, call, backend="eager", dynamic=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    with torch.no_grad():
        for ids, mask in first:
            assert_matches_per_sequence(model, ids, mask, compiled(input_ids=ids, attention_mask=mask, **call).logits)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs <= eager_graphs
        for ids, mask in more:
            assert_matches_per_sequence(model, ids, mask, compiled(input_ids=ids, attention_mask=mask, **call).logits)
    assert counters["stats"]["unique_graphs"] == graphs
    packed = [r for r in backend.LAST_REPORTS[-graphs:] if r.num_rewritten]
    assert packed and all(r.num_rewritten == model.config.num_hidden_layers for r in packed)


def test_inputs_embeds_without_the_cache_pack():
    """``inputs_embeds`` in place of ids (a captured float input of ``[B, S, hidden]``), without the
    cache: packed like ids, every site rewritten, each row the unmodified model's on it alone."""
    model = tiny_model("llama")
    embed = model.get_input_embeddings()
    torch._dynamo.reset()
    first = len(backend.LAST_REPORTS)
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    with torch.no_grad():
        for ids, mask in calls(4, 4, FIRST_SHAPES[:2]):
            logits = compiled(inputs_embeds=embed(ids), attention_mask=mask, use_cache=False).logits
            assert_matches_per_sequence(model, ids, mask, logits)
    reports = backend.LAST_REPORTS[first:]
    assert reports and all((r.num_rewritten, r.left_as_captured) == (2, None) for r in reports), reports


def test_a_sliding_window_cache_returned_to_the_caller_is_left_as_captured():
    """With use_cache, Mistral returns each layer's KV cut to its window: a per-sequence shape the
    packed graph cannot give back, so the backend runs the graph as captured (saying which output)
    and the values are the unmodified model's."""
    model = tiny_model("mistral")  # window 12
    torch._dynamo.reset()
    backend.LAST_REPORTS.clear()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    ids, mask = padded_batch(random.Random(3), 3, 20, left=False)
    mask[1, :] = 1
    with torch.no_grad():
        logits = compiled(input_ids=ids, attention_mask=mask).logits
    assert "output 2" in backend.LAST_REPORTS[-1].left_as_captured
    assert_matches_per_sequence(model, ids, mask, logits, padding_zero=False)


def test_a_batch_of_empty_rows_only_gives_zeros():
    """Found by the randomized calls: every row padding made a packed step of 0 tokens, which failed."""
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    with torch.no_grad():
        for ids, mask in calls(3, 3, [(3, 6), (2, 5)]):
            compiled(input_ids=ids, attention_mask=mask)
        ids, mask = torch.ones(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
        assert not compiled(input_ids=ids, attention_mask=mask).logits.any()


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
    static = backend.LAST_REPORTS[-2]
    assert static.left_as_captured.startswith("static shapes: input input_ids (3, 10)")
    assert static.format() == f"graph left as captured: {static.left_as_captured}"  # no "0 sites found"
    assert backend.LAST_REPORTS[-1].num_rewritten == model.config.num_hidden_layers


def test_one_symbol_for_batch_and_length_is_reported_and_the_next_shape_packs():
    """With dynamic=True, Dynamo's duck sizing gives a first call of as many rows as tokens per row
    one symbol for both sizes: that graph cannot run one sequence of another length, so it runs as
    captured, saying why; a call of another shape compiles one that packs."""
    model = tiny_model("llama")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    with torch.no_grad():
        for i, shape in enumerate([(4, 4), (3, 7)]):
            ids, mask = padded_batch(random.Random(5), *shape, left=True)
            out = compiled(input_ids=ids, attention_mask=mask).logits
            assert_matches_per_sequence(model, ids, mask, out, padding_zero=i > 0)
    assert "one symbol" in backend.LAST_REPORTS[-2].left_as_captured
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
        out, code = run_and_get_code(compiled, input_ids=batches[0][0], attention_mask=batches[0][1], use_cache=False)
        assert_matches_per_sequence(model, *batches[0], out.logits)
        for ids, mask in batches[1:]:
            assert_matches_per_sequence(model, ids, mask,
                                        compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits)
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


# A packed sample whose sizes the configurations below reuse as model sizes: 4 sequences of 4, 1, 1
# and 10 tokens (T=16), re-traced at 10 tokens.
COINCIDING_LENS = (4, 1, 1, 10)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 10), (10, 10, 16), (16, 16, 4)])
def test_model_sizes_equal_to_the_sample_sizes_pack(heads, kv_heads, head_dim, monkeypatch):
    """Head counts, KV head counts and head_dims equal to the verification sample's sequence count,
    lengths and total: dimension roles come from Dynamo's symbols, so every coincidence packs, with
    use_cache on (the KV cache [B, KV heads, S, head_dim] scattered back too) and off, left and right
    padding. The sample is forced to coincide: the backend's own avoids the model's sizes."""
    own = []
    monkeypatch.setattr(backend, "sample_lengths", lambda gm: (own.append(sample_lengths(gm)), COINCIDING_LENS)[1])
    model = tiny_model("llama", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       hidden_size=heads * head_dim)
    torch._dynamo.reset()
    backend.LAST_REPORTS.clear()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    rng = random.Random(heads)
    with torch.no_grad():
        for use_cache in (True, False):
            for left in (True, False):
                ids, mask = padded_batch(rng, 3, 9, left)
                out = compiled(input_ids=ids, attention_mask=mask, use_cache=use_cache)
                assert_matches_per_sequence(model, ids, mask, out.logits)
                if use_cache:
                    assert_cache_matches_per_sequence(model, ids, mask, out.cache)
    assert [(r.num_rewritten, r.left_as_captured) for r in backend.LAST_REPORTS] == [(2, None)] * 2
    for lens in own:
        assert {len(lens), *lens[:1], *lens[2:], sum(lens)}.isdisjoint({heads, kv_heads, head_dim}), lens


class _HeadIndexBias(torch.nn.Module):
    """An embedding, one causal SDPA layer of ``heads`` heads whose queries get their head's index
    (``arange(heads)``, an int64 tensor of a model size), and a head."""

    def __init__(self, heads: int):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed, self.qkv = torch.nn.Embedding(32, 4 * heads), torch.nn.Linear(4 * heads, 12 * heads)
        self.head = torch.nn.Linear(4 * heads, 32)

    def forward(self, input_ids, attention_mask=None):
        batch = input_ids.shape[0]
        q, k, v = self.qkv(self.embed(input_ids)).view(batch, -1, 3, self.heads, 4).permute(2, 0, 3, 1, 4)
        q = q + 0.1 * torch.arange(self.heads)[:, None, None]
        hidden = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return (self.head(hidden.reshape(batch, -1, 4 * self.heads)),)


def test_a_model_size_equal_to_the_traced_length_is_not_taken_for_position_ids(monkeypatch):
    """``arange(heads)`` with as many heads as the re-traced sample has tokens is not replaced by the
    positions input (the candidates' length must be symbolic)."""
    monkeypatch.setattr(backend, "sample_lengths", lambda gm: COINCIDING_LENS)
    model = _HeadIndexBias(heads=max(COINCIDING_LENS))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    ids, mask = padded_batch(random.Random(1), 3, 7, left=False)  # right padding: the model ignores the mask
    ids = ids % 32
    with torch.no_grad():
        logits = compiled(ids, attention_mask=mask)[0]
        for b in range(3):
            real = mask[b].bool()
            torch.testing.assert_close(logits[b][real], model(ids[b][real][None])[0][0], atol=1e-5, rtol=0)
    assert backend.LAST_REPORTS[-1].num_rewritten == 1


def assert_cache_matches_per_sequence(model, ids, mask, cache):
    """Each layer's keys and values at real positions equal the unmodified model's on that row alone."""
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        if real.any():
            ref = model(ids[b][real][None]).cache
            for got, want in zip(cache.layers, ref.layers):
                torch.testing.assert_close(got.keys[b][:, real], want.keys[0], atol=1e-5, rtol=0)
                torch.testing.assert_close(got.values[b][:, real], want.values[0], atol=1e-5, rtol=0)


class _MeanOverTokens(torch.nn.Module):
    """An embedding, one causal SDPA layer and a head, plus the mean over all the call's tokens: a
    sequence-aware op outside attention, which mixes the sequences of a packed row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 32)

    def forward(self, input_ids, attention_mask=None):
        batch = input_ids.shape[0]
        q, k, v = self.qkv(self.embed(input_ids)).view(batch, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        hidden = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, -1, 16)
        return (self.head(hidden + hidden.mean(1, keepdim=True)),)


def test_a_graph_left_as_captured_names_the_output_and_the_node(caplog):
    model = _MeanOverTokens()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True)
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="pagedpack.compiler.backend"):
        torch.testing.assert_close(compiled(ids)[0], model(ids)[0])
    report = backend.LAST_REPORTS[-1]
    why = report.left_as_captured
    assert why.startswith("output 0 (shape (s") and "first differing node: mean = aten.mean.dim" in why, why
    assert report.format().startswith(f"graph left as captured: {why}")
    assert (report.num_found, report.num_rewritten, report.stopped_at) == (1, 0, "verify_packed")
    assert why in caplog.text
