"""vLLM's sampling options (penalties, logit bias, min_tokens, min_p, logprobs) against plain
per-request references written here, and against ``transformers``' own generation."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.logits_processors import process_logits
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling_ops import apply_min_p

from conftest import hf_last_logits, random_prompts, snapshot

VOCAB = 40


def _reference_logits(row: torch.Tensor, request: Request) -> torch.Tensor:
    """One request's processed logits, token by token, as vLLM defines each option."""
    p, out = request.sampling_params, request.output_token_ids
    row = row.double().clone()
    for token, bias in p.logit_bias.items():
        row[token] += bias
    if len(out) < p.min_tokens:
        for token in [*p.stop_token_ids, *([] if p.ignore_eos else [request.eos_token_id])]:
            row[token] = -math.inf
    for token in set(request.prompt_token_ids) | set(out):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(out):
        row[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
    return row


_params = st.fixed_dictionaries({
    "presence_penalty": st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.3, -0.7]),
    "repetition_penalty": st.sampled_from([1.0, 1.3, 0.8]),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    "ignore_eos": st.booleans(),
})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_params, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
                          st.lists(st.integers(0, VOCAB - 1), max_size=9)), min_size=1, max_size=5),
       st.integers(0, 2**31))
def test_penalties_bias_and_min_tokens_match_a_per_request_reference(batch, seed):
    requests = []
    for i, (params, prompt, output) in enumerate(batch):
        request = Request(str(i), prompt, SamplingParams(max_tokens=16, **params), eos_token_id=VOCAB - 1)
        request.output_token_ids.extend(output)
        requests.append(request)
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    got = process_logits(logits, requests)
    for row, request, expected in zip(got, requests, logits):
        reference = _reference_logits(expected, request)
        assert torch.equal(row.isinf(), reference.isinf())
        finite = ~reference.isinf()
        torch.testing.assert_close(row[finite].double(), reference[finite], atol=1e-4, rtol=1e-5)


def test_no_option_leaves_the_logits_untouched():
    logits = torch.randn(2, VOCAB)
    requests = [Request(str(i), [1, 2], SamplingParams()) for i in range(2)]
    assert process_logits(logits, requests) is logits


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]), st.sampled_from([0.5, 1.0, 2.0])),
                min_size=1, max_size=4), st.integers(0, 2**31))
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely(rows, seed):
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    min_p = [m for m, _ in rows]
    temperature = torch.tensor([t for _, t in rows], dtype=torch.float64)
    got = apply_min_p(logits, min_p, temperature)
    for row, masked, (m, t) in zip(logits, got, rows):
        probs = (row.double() / t).softmax(-1)
        keep = probs >= m * probs.max()
        assert torch.equal(~masked.isinf(), keep | (m == 0))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, num_blocks=64, block_size=8)


def test_logprobs_are_the_models_log_softmax(model, llm):
    reference = snapshot(model)
    prompts = random_prompts((4, 19, 33), seed=5)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=4)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            expected = hf_last_logits(reference, prompt + completion.token_ids[:i]).float().log_softmax(-1)
            assert abs(entry[token].logprob - float(expected[token])) < 1e-5
            assert entry[token].rank == int((expected > expected[token]).sum()) + 1
            top = expected.topk(4)
            assert [t for t in entry if entry[t].rank <= 4][:4] == top.indices.tolist()
            for t, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[t].logprob - value) < 1e-5
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
        assert all(lp.decoded_token is None for entry in completion.logprobs for lp in entry.values())  # no tokenizer
    with_tokenizer = LLM("tiny", num_blocks=16)
    out = with_tokenizer.generate("héllo", SamplingParams(max_tokens=4, logprobs=2, seed=1), use_tqdm=False)[0]
    decode = with_tokenizer.tokenizer.decode
    assert all(lp.decoded_token == decode([t]) for entry in out.outputs[0].logprobs for t, lp in entry.items())


def test_greedy_repetition_penalty_equals_transformers_generate(model, llm):
    """transformers' RepetitionPenaltyLogitsProcessor is the same rule over prompt and output."""
    reference = snapshot(model)
    for prompt in random_prompts((6, 21), seed=9):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                      repetition_penalty=1.5)[0, len(prompt):].tolist()
        params = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.5)
        got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want


def test_min_tokens_holds_back_the_stop_tokens(llm):
    prompt = {"prompt_token_ids": random_prompts((12,), seed=2)[0]}
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    stops = sorted(set(first[:3]))
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=stops),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=stops, min_tokens=4),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 4 and not set(held.token_ids[:4]) & set(stops)


def test_logit_bias_forces_a_token(llm):
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4,
                       logit_bias={42: 100.0}, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [42] * 4
    with pytest.raises(ValueError, match=r"logit_bias: expected token ids in \[0, vocab_size=258\), got \[999\]"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(logit_bias={999: 1.0}), use_tqdm=False)


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, r"presence_penalty: expected a number in \[-2, 2\], got 2.5"),
    ("frequency_penalty", float("nan"), r"frequency_penalty: expected a number in \[-2, 2\]"),
    ("repetition_penalty", 0, r"repetition_penalty: expected a number in \[1.175e-38, 3.403e\+38\] .*, got 0"),
    # float32 rounds it to 0: dividing a logit by it gave inf, and NaN probabilities (issue 51)
    ("repetition_penalty", 1e-40, r"repetition_penalty: expected a number in \[1.175e-38, 3.403e\+38\] "
                                  r"\(float32's normal range: the logits are divided by it\), got 1e-40"),
    ("repetition_penalty", 1e39, r"repetition_penalty: expected .*got 1e\+39"),
    ("min_p", 1.5, r"min_p: expected a number in \[0, 1\], got 1.5"),
    ("min_tokens", 20, r"min_tokens: expected an int in \[0, max_tokens=16\], got 20"),
    ("logit_bias", {1: 500}, r"logit_bias: expected a dict of token ids >= 0 to biases in \[-100, 100\]"),
    ("logit_bias", {"a": 1}, r"logit_bias: expected a dict of token ids"),
    ("logprobs", 21, r"logprobs: expected None or an int in \[0, 20\], got 21"),
    ("logprobs", True, r"logprobs: expected None or an int"),
])
def test_bad_option_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
