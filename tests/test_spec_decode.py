"""Speculative decoding (``pagedpack.runtime.spec_decode``) against independent references: the
n-gram proposer against a brute-force search; greedy tokens with drafts of every length, rejected at
every point (an oracle proposer built from the unmodified model's own tokens), against that model
run one prompt at a time, across arrival orders, chunked prefill, prefix caching and preemption;
families with n-gram drafts; seeded sampling token for token; the sampled distribution against
the unmodified model's exact probabilities (chi-square); the drafts kept for a step's cost against
every choice of draft lengths, enumerated."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack import LLM, SamplingParams
from pagedpack.engine_args import EngineArgs
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.spec_decode.config import SpeculativeConfig
from pagedpack.runtime.spec_decode.cost import Acceptance, StepCost, worthwhile_lengths
from pagedpack.runtime.spec_decode.lookahead import Lookahead
from pagedpack.runtime.spec_decode.ngram import propose_ngram
from pagedpack.runtime.spec_decode.proposer import Proposer

from conftest import arrival_schedules, assert_each_as_alone, hf_greedy, random_prompts, snapshot
from test_families import SERVED, family_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def brute_force_ngram(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """vLLM's rule, searched naively: the longest suffix n-gram, its earliest earlier occurrence."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 6), low=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_ngram_proposals_equal_a_brute_force_search(tokens, k, low, extra):
    assert propose_ngram(tokens, k, low, low + extra) == brute_force_ngram(tokens, k, low, low + extra)


def test_lookahead_grows_with_acceptance_and_pauses_after_misses():
    look = Lookahead(4, 0.5)
    look.update(4, 1)
    assert look.next_length() == 2  # accepted 1 of 4: 2 next
    look.update(2, 2)
    assert look.next_length() == 3  # all accepted: one more
    lengths = []
    for _ in range(3):  # none accepted, three times: paused 1, then 3, then 7 steps
        look.update(look.length, 0)
        lengths += [look.next_length() for _ in range(2 ** (look.misses) - 1)] + [look.next_length()]
    assert lengths == [0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    look.update(1, 1)
    assert (look.misses, look.next_length()) == (0, 2)


def test_step_cost_fits_the_line_of_decode_steps():
    """Steps timed ``2 ms + 0.5 ms per row`` (+-5 %): the fitted line, none before a spread of row
    counts came, the last fit kept while later steps all have the same rows."""
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(20):  # 8 rows every step: no slope to fit
        cost.observe(8, 0.006 * rng.uniform(0.95, 1.05))
    assert cost.per_row is None
    for _ in range(40):
        rows = rng.randint(8, 40)
        cost.observe(rows, (0.002 + 0.0005 * rows) * rng.uniform(0.95, 1.05))
    assert cost.per_row == pytest.approx(0.0005, rel=0.15) and cost.intercept == pytest.approx(0.002, rel=0.5)
    fitted = cost.per_row
    for _ in range(200):
        cost.observe(8, 0.006)
    assert cost.per_row == pytest.approx(fitted, rel=0.3)


def test_acceptance_counts_each_position_up_to_the_first_rejection():
    acceptance = Acceptance(0.5)  # 1 of 2 prior tokens
    acceptance.update(4, 2)  # 2 accepted, the third rejected, the fourth never tried: 3 tried
    assert acceptance.rate == pytest.approx((0.97 * 1 + 2) / (0.97 * 2 + 3))
    acceptance.update(3, 3)  # all accepted: nothing rejected
    assert acceptance.rate == pytest.approx((0.97 * (0.97 + 2) + 3) / (0.97 * (0.97 * 2 + 3) + 3))


class _Line(StepCost):
    def __init__(self, intercept: float, per_row: float):
        super().__init__()
        self.intercept, self.per_row = intercept, per_row


@settings(max_examples=300, deadline=None)
@given(rates=st.lists(st.floats(0, 1), min_size=1, max_size=4), lengths=st.lists(st.integers(0, 3), min_size=4,
       max_size=4), intercept=st.floats(0, 1), per_row=st.floats(0.001, 1))
def test_kept_drafts_give_the_most_expected_tokens_per_second(rates, lengths, intercept, per_row):
    """Against every choice of draft lengths (each request's first ``k`` drafts), enumerated: the kept
    drafts' expected tokens per second (draft ``j`` accepted with ``rate ** j``) is the largest."""
    import itertools

    def tokens_per_second(kept):
        tokens = sum(1 + sum(r ** j for j in range(1, k + 1)) for r, k in zip(rates, kept))
        return tokens / (intercept + per_row * (len(rates) + sum(kept)))

    lengths = lengths[:len(rates)]
    kept = worthwhile_lengths(rates, lengths, len(rates), _Line(intercept, per_row))
    assert all(0 <= k <= n for k, n in zip(kept, lengths)) and len(kept) == len(lengths)
    best = max(tokens_per_second(c) for c in itertools.product(*(range(n + 1) for n in lengths)))
    assert tokens_per_second(kept) >= best * (1 - 1e-9)


def test_drafts_not_worth_their_rows_are_not_verified(sampling_models):
    """A step cost where a row costs as much as the rest of the step: no draft pays (the engine
    verifies none) and the tokens are the model's."""
    model, _, _ = sampling_models
    llm = LLM(snapshot(model), speculative_config=NGRAM)
    llm.llm_engine.proposer.cost = _Line(0.0, 1.0)
    llm.llm_engine.proposer.cost.observe = lambda rows, seconds: None
    prompts = [p * 3 for p in random_prompts((4, 9, 15), seed=3, vocab=260)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 16)
    assert llm.get_stats().spec_decode_num_draft_tokens == 0


def test_speculative_config_takes_vllm_s_spelling_and_defaults():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    described = SpeculativeConfig.parse({"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert described.describe() == "ngram, up to 4 draft tokens per request and step (2- to 4-gram prompt lookup)"
    drawn = SpeculativeConfig(model="/m/[/]\x1b[31m\n", num_speculative_tokens=2).describe()  # escaped for a terminal
    assert drawn.endswith("(draft model '/m/[/]\\x1b[31m\\n')") and "\x1b" not in drawn and "\n" not in drawn


@pytest.mark.parametrize("given, message", [
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: expected an int from 1 to 32, got None"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens: expected an int from 1 to 32, got True"),
    ({"num_speculative_tokens": 33}, "num_speculative_tokens: expected an int from 1 to 32, got 33"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min: expected at most prompt_lookup_max=3, got 4"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model: method 'draft_model' needs"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "speculative_config.model: only method"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "min_token_prob: expected a number from 0.0 to 1.0"),
    ({"method": "nonsense", "num_speculative_tokens": 2}, "method: expected one of .*, got .nonsense."),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, "method: expected one of .*, got .'ngram'."),
    ({"model": 5, "num_speculative_tokens": 2}, "speculative_config.model: expected a path, an alias or a "
                                                "transformers model, got 5"),
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "speculative_config.draft_tensor_parallel_size: expected one of the fields"),
    ("[1]", "speculative_config: expected a JSON object (a dict)"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SpeculativeConfig.parse(given)


def test_speculation_is_refused_where_it_cannot_run_yet():
    with pytest.raises(ValueError, match="speculative_config: speculation does not run with tensor parallelism"):
        EngineArgs(tensor_parallel_size=2, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="speculative_config: a model with recurrent layers"):
        LLM(family_model(SERVED, "lfm2", "sdpa"), speculative_config=NGRAM)


class OracleProposer(Proposer):
    """Drafts from the answer: each decoding request gets up to ``num_speculative_tokens`` of its true
    next tokens (``expected``, by prompt), the length and one wrong token (or none) drawn from ``rng``,
    so that steps accept every number of drafts; past the answer's end, random tokens."""

    def __init__(self, config, expected: dict[tuple, list[int]], rng: random.Random, vocab: int):
        super().__init__(SpeculativeConfig.parse(config))
        self.expected, self.rng, self.vocab = expected, rng, vocab

    def propose(self, requests, live_request_ids=None):
        for r in requests:
            if r.is_finished or r.forks or r.num_computed_tokens != r.num_tokens - 1:
                continue
            truth = self.expected[tuple(r.prompt_token_ids)][r.num_output_tokens:]
            k = self.rng.randint(0, self.config.num_speculative_tokens)
            draft = (truth + [self.rng.randrange(self.vocab) for _ in range(k)])[:k]
            wrong = self.rng.randint(0, k)
            if wrong < k:
                draft[wrong] = (draft[wrong] + 1) % self.vocab
            r.spec_token_ids = draft


@pytest.fixture(scope="module")
def oracle_case():
    model = tiny_model("llama", num_hidden_layers=2)
    reference = snapshot(model)
    prompts = random_prompts((1, 17, 40, 64, 100, 33), seed=5)
    expected = {tuple(p): hf_greedy(reference, p, 20) for p in prompts}
    # 12 blocks of 16 tokens for 6 requests of up to 120 tokens: preemptions; a 48-token budget: chunks
    llm = LLM(model, block_size=16, num_blocks=12, max_num_batched_tokens=48, speculative_config=NGRAM)
    return llm, prompts, expected


@settings(max_examples=12, deadline=None)
@given(schedule=st.fixed_dictionaries(arrival_schedules(6)), seed=st.integers(0, 2**16))
def test_greedy_tokens_with_drafts_cut_anywhere_equal_the_model_alone(oracle_case, schedule, seed):
    llm, prompts, expected = oracle_case
    engine = llm.llm_engine
    engine.proposer = OracleProposer(NGRAM, expected, random.Random(seed), llm.vocab_size)
    assert_each_as_alone(llm, prompts, schedule["arrival"], schedule["aborted"],
                         lambda i: SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                         [expected[tuple(p)] for p in prompts])
    stats = engine.proposer.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_prefix_cache_holds_no_rejected_draft_tokens(oracle_case):
    """A prompt served with drafts rejected everywhere, then each prompt extended by its answer: the
    second round's hits read blocks written by speculative steps, and its tokens are the model's."""
    llm, prompts, expected = oracle_case
    model = tiny_model("llama", num_hidden_layers=2)
    engine = llm.llm_engine
    engine.proposer = OracleProposer(NGRAM, expected, random.Random(1), llm.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    preemptions = engine.stats.num_preemptions
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
        expected[tuple(p)] for p in prompts]
    assert engine.stats.num_preemptions > preemptions  # all at once: the pool is too small
    hits = llm.get_stats().prefix_cache_hits
    longer = [p + expected[tuple(p)][:16] for p in prompts]
    engine.proposer = Proposer(SpeculativeConfig.parse(NGRAM))
    outputs = llm.generate(longer, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits > hits
    for prompt, out in zip(longer, outputs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)


FAMILIES = ["gemma3", "qwen2", "gpt2", "falcon", "phi", "gemma2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_families_with_ngram_drafts_give_the_model_s_greedy_tokens(family):
    """Prompts that repeat themselves, so the n-gram proposer drafts; tiny random models loop, so
    drafts of their own output are accepted too."""
    config_class, config, attns, _ = SERVED[family]
    model = family_model(SERVED, family, attns[0])
    reference = snapshot(model)
    vocab = config["vocab_size"]
    prompts = [p + p[: len(p) // 2] for p in random_prompts((3, 20, 45, 90), seed=2, vocab=vocab)]
    llm = LLM(model, block_size=16, num_blocks=256, max_num_batched_tokens=64, speculative_config=NGRAM)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 16), f"prompt length {len(prompt)}"
    assert llm.get_stats().spec_decode_num_accepted_tokens > 0


@pytest.fixture(scope="module")
def sampling_models():
    model = tiny_model("llama", num_hidden_layers=2, vocab_size=260)
    return model, LLM(snapshot(model), speculative_config=NGRAM), LLM(snapshot(model))


def test_seeded_sampling_takes_the_same_tokens_with_and_without_drafts(sampling_models):
    """Each position draws once from the request's generator, as a step without speculation does, with
    the accepted drafts already in the output: penalties, min_tokens and logprobs see what they would."""
    _, speculative, plain = sampling_models
    prompts = [p * 3 for p in random_prompts((4, 9, 15), seed=3, vocab=260)]
    params = [SamplingParams(temperature=0.3, seed=7 + i, max_tokens=40, top_k=20, top_p=0.95, logprobs=2,
                             repetition_penalty=1.1, frequency_penalty=0.2, min_tokens=30) for i in range(3)]
    got = speculative.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert speculative.get_stats().spec_decode_num_accepted_tokens > 0


def test_sampled_tokens_follow_the_model_s_distribution():
    """Drafts of fixed tokens for every request (the likeliest first token, then the likeliest after
    it): the first two sampled tokens' joint frequencies over 4,000 seeded requests of a 12-token
    vocabulary against the unmodified model's exact ``p(t1) p(t2 | t1)`` (chi-square, 144 cells)."""
    from scipy.stats import chisquare

    vocab, n, prompt = 12, 4000, [3, 9, 1]
    model = tiny_model("llama", num_hidden_layers=2, vocab_size=vocab, initializer_range=0.3)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        second = [torch.softmax(model(torch.tensor([prompt + [t]])).logits[0, -1].double(), -1) for t in range(vocab)]
    draft = [int(first.argmax()), int(second[int(first.argmax())].argmax())]

    class Fixed(Proposer):
        def propose(self, requests, live_request_ids=None):
            for r in requests:
                if not r.is_finished and r.num_computed_tokens == r.num_tokens - 1:
                    r.spec_token_ids = draft[1:] if r.output_token_ids == draft[:1] else []

    llm = LLM(snapshot(model), speculative_config=NGRAM, max_num_seqs=512)
    llm.llm_engine.proposer = Fixed(SpeculativeConfig.parse(NGRAM))
    outputs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=i, max_tokens=3) for i in range(n)],
                           use_tqdm=False)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for out in outputs:
        t, u = out.outputs[0].token_ids[:2]
        counts[t, u] += 1
    exact = first[:, None] * torch.stack(second)
    assert llm.llm_engine.proposer.stats.num_accepted_tokens > 0.05 * n
    assert chisquare(counts.flatten(), exact.flatten() * n).pvalue > 1e-3


def test_stop_strings_end_a_speculative_step_where_they_end_a_plain_one():
    """A stop string completed by an accepted draft ends the completion at that token: the text, token
    ids, logprobs and finish are those of a run without speculation, whatever the step took after it
    (the oracle's drafts are the plain run's tokens, one sometimes wrong)."""
    llm = LLM("tiny", speculative_config=NGRAM)
    engine, prompts = llm.llm_engine, ["Hello, hello, hello", "abcabcabc", "The capital"]
    engine.proposer = None  # no speculation
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    expected = {tuple(out.prompt_token_ids): out.outputs[0].token_ids for out in free}
    oracle = OracleProposer(NGRAM, expected, random.Random(0), llm.vocab_size)
    for i, out in enumerate(free):
        text = out.outputs[0].text
        params = SamplingParams(temperature=0.0, max_tokens=48, stop=[text[20 + i:22 + i]], logprobs=1)
        engine.proposer = None
        want = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0]
        engine.proposer = oracle
        got = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason)
        assert [lp.keys() for lp in got.logprobs] == [lp.keys() for lp in want.logprobs]
    assert oracle.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def draft_case():
    """A 2-layer target, its 20 greedy tokens per prompt run alone, and an LLM drafting with the target's
    own weights on a pool small enough to preempt (12 blocks of 16 tokens for 6 requests of up to 120
    tokens), a 48-token budget to chunk prompts."""
    model = tiny_model("llama", num_hidden_layers=2)
    reference = snapshot(model)
    prompts = random_prompts((1, 17, 40, 64, 100, 33), seed=5)
    expected = {tuple(p): hf_greedy(reference, p, 20) for p in prompts}
    config = {"method": "draft_model", "model": snapshot(model), "num_speculative_tokens": 3}
    llm = LLM(snapshot(model), block_size=16, num_blocks=12, max_num_batched_tokens=48, speculative_config=config)
    return model, prompts, expected, llm


@settings(max_examples=6, deadline=None)
@given(schedule=st.fixed_dictionaries(arrival_schedules(6)))
def test_a_draft_model_s_proposals_are_accepted_and_the_tokens_are_the_target_s(draft_case, schedule):
    """The target's own weights as the draft model: its greedy drafts are the target's tokens, so
    nearly all are accepted (the draft's cache, followed and scratch-extended, holds what the target's
    does) across arrival orders, aborts, chunked prefill and preemption; the tokens equal the model
    run alone."""
    _, prompts, expected, llm = draft_case
    stats = llm.llm_engine.proposer.stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert_each_as_alone(llm, prompts, schedule["arrival"], schedule["aborted"],
                         lambda i: SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                         [expected[tuple(p)] for p in prompts])
    assert stats.num_accepted_tokens - accepted >= 0.9 * (stats.num_draft_tokens - drafted) > 0, stats


def test_another_draft_model_changes_how_many_tokens_a_step_takes_not_which(draft_case, sampling_models):
    """A draft of other weights (1 layer of another initialisation): greedy tokens are the target's,
    and seeded sampled ones equal those of the target without speculation."""
    model, prompts, expected, _ = draft_case
    draft = tiny_model("llama", num_hidden_layers=1, seed=7)
    llm = LLM(snapshot(model), block_size=16, num_blocks=64,
              speculative_config={"model": draft, "num_speculative_tokens": 4})
    assert llm.llm_engine.proposer.config.method == "draft_model"  # vLLM's inference from the model alone
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]
    assert llm.get_stats().spec_decode_num_draft_tokens > 0
    params = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=12, top_k=30) for i in range(len(prompts))]
    plain = LLM(snapshot(model), block_size=16, num_blocks=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


def test_a_draft_model_of_other_token_ids_is_refused_and_a_shorter_one_drafts_within_its_positions(draft_case):
    model, prompts, expected, _ = draft_case
    with pytest.raises(ValueError, match="speculative_config.model: .*a vocabulary of 258 tokens, got 300"):
        LLM(snapshot(model), speculative_config={"model": tiny_model("llama", num_hidden_layers=1, vocab_size=300),
                                                 "num_speculative_tokens": 4})
    short = tiny_model("llama", num_hidden_layers=1, max_position_embeddings=64)  # drafts up to position 63
    llm = LLM(snapshot(model), speculative_config={"model": short, "num_speculative_tokens": 4})
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[tuple(p)] for p in prompts]


def kv_bytes_per_token(config, itemsize: int = 4) -> int:
    """K and V of one token over all layers of a Llama ``config`` (float32 caches)."""
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * itemsize


def test_the_memory_plan_counts_the_draft_model_s_kv_weights_and_scratch(draft_case):
    """The draft's KV takes the pool's blocks beside the target's: ``kv_cache_memory`` holds blocks of
    both; a budget also pays the draft's weights (at least its parameters) and the scratch blocks of
    ``max_num_seqs`` proposals (``ceil(k / block_size)`` blocks each)."""
    model, *_ = draft_case
    draft = tiny_model("llama", num_hidden_layers=1, seed=7)
    per_token = kv_bytes_per_token(model.config) + kv_bytes_per_token(draft.config)
    config = {"model": draft, "num_speculative_tokens": 20}
    llm = LLM(snapshot(model), block_size=16, max_num_seqs=4, kv_cache_memory=100 * per_token * 16 + 5,
              speculative_config=config)
    assert llm.num_blocks == 100 and llm.bytes_per_token == per_token
    assert llm.get_stats().kv_cache_bytes_per_block == per_token * 16
    plain, budget = LLM(snapshot(model), block_size=16, max_num_seqs=4), 64 << 20
    with_draft, without = llm.plan_memory(budget), plain.plan_memory(budget)
    scratch = 4 * 2 * 16 * kv_bytes_per_token(draft.config)  # 2 blocks of 16 for 20 draft tokens, per sequence
    params = sum(p.numel() * p.element_size() for p in draft.parameters())
    assert with_draft.draft_bytes >= scratch + params and without.draft_bytes == 0
    assert with_draft.num_blocks == (budget - with_draft.weight_bytes - with_draft.activation_bytes
                                     - with_draft.draft_bytes) // (per_token * 16)
    assert any(label == "draft model" for label, _ in with_draft.rows())
    small = with_draft.weight_bytes + with_draft.activation_bytes + with_draft.draft_bytes // 2  # no block fits
    with pytest.raises(ValueError, match=f"memory_budget: .*draft model's weights and scratch blocks "
                                         f"\\({with_draft.draft_bytes} bytes\\)"):
        LLM(snapshot(model), block_size=16, max_num_seqs=4, memory_budget=small, speculative_config=config)


def test_a_draft_model_that_cannot_be_loaded_is_named_as_the_draft(tmp_path):
    """What fails building the draft says it is ``speculative_config.model``, not the target's ``model``."""
    (tmp_path / "empty").write_bytes(b"")
    for path in (str(tmp_path / "missing"), str(tmp_path / "empty")):
        with pytest.raises(ValueError, match="^speculative_config.model: "):
            LLM("tiny", speculative_config={"model": path, "num_speculative_tokens": 2})


def test_suffix_decoding_drafts_from_the_request_and_earlier_responses():
    """Suffix decoding (Arctic Inference's trees): a prompt asked again is answered from the global tree of
    earlier responses, which prompt lookup cannot see; the tokens stay the model's own."""
    pytest.importorskip("arctic_inference.suffix_decoding")
    model = tiny_model("llama", num_hidden_layers=2)
    reference = snapshot(model)
    prompts = random_prompts((7, 30, 50), seed=9)
    llm = LLM(model, speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    params = SamplingParams(temperature=0.0, max_tokens=24)  # to EOS, as generate
    first = llm.generate(prompts, params, use_tqdm=False)
    accepted = llm.get_stats().spec_decode_num_accepted_tokens
    again = llm.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(reference, prompt, 24)
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens - accepted >= sum(len(o.outputs[0].token_ids) for o in again) / 2
    assert not llm.llm_engine.proposer._suffix.cache.active_requests  # finished requests' trees stopped


def test_suffix_without_arctic_inference_is_refused_naming_the_method(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ValueError, match=r"speculative_config.method: 'suffix' needs Arctic Inference"):
        Proposer(SpeculativeConfig.parse({"method": "suffix"}))
