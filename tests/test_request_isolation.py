"""One request never fails the others (issue 51), through the Python API: poison sampling values,
a row the sampler cannot draw from, a sampler or detokenizer that raises for one request, and a
reader that stops reading (backpressure). References: the unmodified model's greedy tokens, each
prompt alone."""
import asyncio
import math
import re
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedpack.runtime.output_processor as output_processor
from pagedpack import LLM, AsyncLLM, SamplingParams
from pagedpack.runtime.flow_control import FlowControl, OutputFlows
from pagedpack.runtime.sampling import Sampler

from conftest import hf_greedy, random_prompts, snapshot

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts((5, 19, 33, 8), seed=51)
POISON_PROMPT = {"prompt_token_ids": [7, 8, 9]}
TINY = 1.1754943508222875e-38  # float32's smallest normal number
EXTREMES = [0.0, 5e-324, 1e-46, 1e-40, TINY, 1e-30, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e30, 3.4e38, 1e39, 1e300,
            math.inf, math.nan]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_blocks=64, block_size=8, max_num_seqs=16)  # the built-in model, with its tokenizer


@pytest.fixture(scope="module")
def model(llm):
    return llm.model


@pytest.fixture(scope="module")
def solo(model):
    reference = snapshot(model)
    return [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


def _normal(llm) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)


def _assert_normal(outputs, solo) -> None:
    assert [o.error for o in outputs] == [None] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == solo


POISON = [  # issue 51's reproductions and the values next to them, with what must become of them
    (dict(top_p=1e-46), "served"),  # float32 made it 0 and masked every token: the first token always stays
    (dict(repetition_penalty=1e-40), "refused"),  # float32 rounds it to 0
    (dict(repetition_penalty=TINY, logit_bias={7: 100.0}), "error"),  # (logit + 100) / TINY: +inf
    (dict(repetition_penalty=TINY), "served"),  # the tiny model's logits stay finite divided by it
    (dict(temperature=1e-300), "served"),  # greedy
    (dict(temperature=1e300, top_k=3), "served"),
    (dict(min_p=5e-324, temperature=1e-4), "served"),
    (dict(stop_token_ids=list(range(258)), min_tokens=3), "refused"),  # every token banned until 3 are out
    (dict(stop_token_ids=[t for t in range(258) if t != 5], min_tokens=3), "served"),  # token 5 alone left
    (dict(logit_bias={5: 100.0, 6: -100.0}, presence_penalty=-2.0, frequency_penalty=2.0, top_k=1), "served"),
]


def _run_poison(llm, fields: dict) -> str:
    """Run one poison request beside the normal ones in the same steps: "refused" (ValueError before
    it runs), "error" (it alone failed) or "served"."""
    try:
        params = SamplingParams(max_tokens=3, **fields)
    except ValueError:
        return "refused"
    batch = [{"prompt_token_ids": p} for p in PROMPTS] + [POISON_PROMPT]
    try:
        outputs = llm.generate(batch, [GREEDY] * len(PROMPTS) + [params], use_tqdm=False)
    except ValueError:  # checked against the model (vocabulary, min_tokens) before anything ran
        return "refused"
    *normal, poison = outputs
    _assert_normal(normal, _run_poison.solo)
    if poison.error is not None:
        assert poison.outputs[0].finish_reason == "error" and poison.error.startswith("sampling: request")
        return "error"
    assert poison.outputs[0].finish_reason in ("stop", "length") and poison.outputs[0].token_ids
    return "served"


@pytest.mark.parametrize(("fields", "outcome"), POISON, ids=[",".join(f) for f, _ in POISON])
def test_a_poison_request_beside_others_is_refused_or_fails_alone(llm, solo, fields, outcome):
    _run_poison.solo = solo
    assert _run_poison(llm, fields) == outcome
    assert llm.get_stats().kv_blocks_used == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                        "frequency_penalty", "bias"]),
                       st.sampled_from(EXTREMES) | st.sampled_from(EXTREMES).map(lambda x: -x), min_size=1))
def test_extreme_values_of_every_sampling_field_fail_no_other_request(llm, solo, values):
    _run_poison.solo = solo
    fields = {k: v for k, v in values.items() if k != "bias"}
    if "bias" in values:
        fields["logit_bias"] = {3: values["bias"]}
    _run_poison(llm, fields)


def test_poison_requests_from_another_thread_fail_no_caller_s_requests(llm, solo):
    """Two threads share the steps: one's poison requests never reach the other's outputs."""
    _run_poison.solo = solo
    outcomes, normal = [], []
    start = threading.Barrier(2)

    def poisoner():
        start.wait()
        for fields, _ in POISON * 2:
            outcomes.append(_run_poison(llm, fields))

    def caller():
        start.wait()
        for _ in range(6):
            normal.append(_normal(llm))

    threads = [threading.Thread(target=t) for t in (poisoner, caller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(normal) == 6 and outcomes == [o for _, o in POISON * 2]
    for outputs in normal:
        _assert_normal(outputs, solo)


def test_a_sampler_that_raises_for_one_request_fails_that_request_alone(llm, solo, monkeypatch):
    real = Sampler.sample

    def sample(self, logits, requests, grammar=None):
        if any(r.sampling_params.seed == 666 for r in requests):
            raise RuntimeError("a bug that one request's parameters hit")
        return real(self, logits, requests, grammar)

    monkeypatch.setattr(Sampler, "sample", sample)
    *normal, poison = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] + [POISON_PROMPT],
                                   [GREEDY] * len(PROMPTS) + [SamplingParams(seed=666, max_tokens=3)],
                                   use_tqdm=False)
    _assert_normal(normal, solo)
    assert re.fullmatch(r"sampling: request '\d+' failed \(RuntimeError\)", poison.error), poison.error


def test_an_output_that_cannot_be_made_fails_that_request_alone(llm, solo, monkeypatch):
    """The stop-string search (or the detokenizer) raising for one request ends that request alone."""
    real = output_processor._find_stop

    def find_stop(text, stops, start):
        if "BOOM" in stops:
            raise UnicodeError("a text that breaks the search")
        return real(text, stops, start)

    monkeypatch.setattr(output_processor, "_find_stop", find_stop)
    *normal, poison = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] + [POISON_PROMPT],
                                   [GREEDY] * len(PROMPTS) + [SamplingParams(stop=["BOOM"], max_tokens=3)],
                                   use_tqdm=False)
    _assert_normal(normal, solo)
    assert poison.outputs[0].finish_reason == "error" and "text could not be made (UnicodeError)" in poison.error
    assert llm.get_stats().kv_blocks_used == 0


def test_prompt_logprobs_that_cannot_be_decoded_fail_that_request_alone(llm, solo, monkeypatch):
    """From a break-it review: the prompt logprobs' tokens were decoded outside the per-request guard, so
    one request's failure there would have ended every request of the step."""
    def broken(self, token, entry):
        raise UnicodeError("a token that does not decode")

    monkeypatch.setattr(output_processor.OutputProcessor, "_logprobs", broken)
    *normal, poison = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] + [POISON_PROMPT],
                                   [GREEDY] * len(PROMPTS) + [SamplingParams(prompt_logprobs=1, max_tokens=3)],
                                   use_tqdm=False)
    _assert_normal(normal, solo)
    assert poison.outputs[0].finish_reason == "error" and "(UnicodeError)" in poison.error, poison.error
    assert llm.get_stats().kv_blocks_used == 0


# --- backpressure ------------------------------------------------------------------------------


def test_output_flows_pause_past_the_bound_and_resume_at_half():
    flows = OutputFlows(FlowControl(max_unsent_tokens=10))
    assert not flows.delivered("a", 30)  # one delta, however large: its reader may be taking each one
    assert flows.delivered("a", 1) and flows.is_paused("a")
    assert not flows.delivered("a", 1)  # paused once
    assert not flows.taken("a", 1) and flows.taken("a", 30) and not flows.is_paused("a")  # 1 token left: <= 5
    assert not flows.taken("unknown", 1)
    flows.ended("a")
    assert flows.num_paused == 0 and flows.stalled() == []
    with pytest.raises(ValueError, match="max_unsent_tokens: expected an int >= 1 or None, got 0"):
        FlowControl(max_unsent_tokens=0)
    with pytest.raises(ValueError, match="stall_timeout_s: expected a number > 0 or None, got -1"):
        FlowControl(stall_timeout_s=-1)


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture()
def flow_llm(model):
    return LLM(model, num_blocks=64, block_size=8, max_num_seqs=16)  # its own loop: flow control of its own


def test_a_stream_nobody_reads_is_paused_holding_no_blocks_and_resumes_exactly(model, flow_llm):
    """n=4 completions of 40 tokens, not read: past 24 unsent tokens the request is paused (its KV
    freed, no step runs for it) while another request runs to the end; read again, it resumes and
    each completion equals the unmodified model's greedy tokens (its K/V recomputed)."""
    flow_llm._loop.flow_control = FlowControl(max_unsent_tokens=24)
    prompt, other = PROMPTS[1], PROMPTS[2]
    reference = snapshot(model)
    expected, expected_other = hf_greedy(reference, prompt, 40), hf_greedy(reference, other, 8)
    engine = AsyncLLM.from_llm(flow_llm)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        stalled = engine.add_request({"prompt_token_ids": prompt}, params, "stalled")
        await asyncio.to_thread(_wait, lambda: flow_llm._loop.num_paused == 1)
        assert flow_llm.get_stats().kv_blocks_used == 0 and len(flow_llm.llm_engine.scheduler.paused) == 4
        async for out in engine.generate({"prompt_token_ids": other}, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                      ignore_eos=True)):
            pass
        assert out.outputs[0].token_ids == expected_other and flow_llm._loop.num_paused == 1
        whole = {}
        async for delta in stalled:
            for c in delta.outputs:
                whole[c.index] = whole.get(c.index, []) + c.token_ids
        return whole

    whole = asyncio.run(main())
    assert whole == {i: expected for i in range(4)}
    assert flow_llm.get_stats().num_preemptions == 0 and flow_llm.get_stats().kv_blocks_used == 0


def test_a_stream_paused_past_the_stall_timeout_is_aborted(flow_llm):
    flow_llm._loop.flow_control = FlowControl(max_unsent_tokens=8, stall_timeout_s=0.3)
    engine = AsyncLLM.from_llm(flow_llm)

    async def main():
        stalled = engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(
            n=2, temperature=0.0, max_tokens=200, ignore_eos=True), "stalled")
        await asyncio.to_thread(_wait, lambda: flow_llm._loop.num_paused == 1)
        paused_at = time.monotonic()
        await asyncio.to_thread(_wait, lambda: flow_llm._loop.num_paused == 0)  # the loop's thread aborts it
        assert time.monotonic() - paused_at >= 0.25
        return [c.finish_reason async for delta in stalled for c in delta.outputs if c.finished]

    assert asyncio.run(main()) == ["abort", "abort"]
    assert flow_llm._loop.num_paused == 0 and flow_llm.get_stats().kv_blocks_used == 0
