"""The online engine: requests that arrive and leave while others run, streamed text, stop
strings, many callers. References: the unmodified model's greedy ``generate`` per prompt, the
tokenizer's own ``decode``, and for seeded sampling the same request run alone."""
import asyncio
import threading

import pytest
from hypothesis import HealthCheck, given, settings

from pagedpack import LLM, AsyncLLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.detokenizer import IncrementalDetokenizer
from pagedpack.runtime.engine import RequestRejected

from conftest import arrival_schedules, assert_each_as_alone, greedy_alone, random_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPTS = random_prompts((3, 17, 40, 5, 29, 64, 11, 2), seed=21)
TEXTS = ["héllo wörld", "naïve café ✓", "日本語のテキスト", "emoji 😀 and more", "plain ascii text", "ß∂ƒ©˙∆˚¬"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def solo(model):
    return greedy_alone(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(model):
    # a small step budget (chunked prefill) and a small pool (preemption) make arrivals interleave
    return LLM(model, num_blocks=24, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)


# Random arrival steps for every prompt, and up to three of them aborted at a random step.
_SCHEDULES = arrival_schedules(len(PROMPTS))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_SCHEDULES)
def test_requests_arriving_and_aborted_while_others_run(llm, solo, arrival, aborted):
    assert_each_as_alone(llm, PROMPTS, arrival, aborted, lambda i: GREEDY, solo)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=(0.6, 0.9, 1.3)[i % 3], top_p=(1.0, 0.9)[i % 2], seed=1000 + i,
                          max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def seeded_alone(model):
    """Each prompt's seeded sample, run alone on an engine of its own (same limits as ``llm``)."""
    fresh = LLM(model, num_blocks=24, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    return [fresh.generate({"prompt_token_ids": p}, _seeded(i), use_tqdm=False)[0].outputs[0].token_ids
            for i, p in enumerate(PROMPTS)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_SCHEDULES)
def test_seeded_requests_arriving_and_aborted_while_others_run(llm, seeded_alone, arrival, aborted):
    """Seeded sampling draws from each request's own generator: interleaved with random arrivals,
    aborts, chunked prefill and preemption, every request samples what it sampled alone."""
    assert_each_as_alone(llm, PROMPTS, arrival, aborted, _seeded, seeded_alone)


def test_seeded_sampling_is_the_same_when_requests_arrive_late(llm):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS) for i in range(4)]
    alone = [llm.generate({"prompt_token_ids": PROMPTS[i]}, params[i], use_tqdm=False)[0].outputs[0].token_ids
             for i in range(4)]
    assert_each_as_alone(llm, PROMPTS[:4], [0, 2, 3, 3], {}, lambda i: params[i], alone)


def test_an_aborted_prefix_goes_back_to_the_prefix_cache(model):
    llm = LLM(model, num_blocks=32, block_size=4, max_num_batched_tokens=8)
    prompt = PROMPTS[5]  # 64 tokens: prefilled over several steps
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(3):
        engine.step()
    assert llm.get_stats().kv_blocks_used > 0
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    stats = llm.get_stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached_free == 24 // 4  # the 3 x 8 computed tokens
    assert engine.abort_request("a") is None  # no longer live


def test_a_duplicate_live_request_id_is_refused(llm):
    engine = llm.llm_engine
    engine.add_request("dup", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    with pytest.raises(ValueError, match="request_id: 'dup' is already running; expected a new id"):
        engine.add_request("dup", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.abort_request("dup")
    with pytest.raises(RequestRejected, match="request 'big': prompt has 2000 tokens, more than max_model_len"):
        engine.add_request("big", {"prompt_token_ids": [1] * 2000}, GREEDY)
    assert not engine.has_unfinished()


# ---------------------------------------------------------------- streamed text


@pytest.fixture(scope="module")
def text_llm():
    return LLM("tiny", num_blocks=128)


def test_streamed_deltas_concatenate_to_the_decoded_text(text_llm):
    """120 prompts of multi-byte UTF-8 through the byte-level tokenizer (random weights: many
    outputs are invalid UTF-8, which decode replaces): the deltas never split a character and add
    up to ``tokenizer.decode`` of the output ids."""
    tokenizer = text_llm.tokenizer
    prompts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(120)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) for i in range(120)]
    streamed = {}
    for delta in text_llm.generate(prompts, params, stream=True):
        streamed.setdefault(delta.request_id, []).append(delta.outputs[0])
    assert len(streamed) == 120
    for parts in streamed.values():
        ids = [t for p in parts for t in p.token_ids]
        assert "".join(p.text for p in parts) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all(p.finish_reason is None for p in parts[:-1]) and parts[-1].finish_reason == "length"


def test_the_detokenizer_never_splits_a_character():
    from pagedpack.models.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas = [detokenizer.push([t]) for t in ids]
        assert "".join(deltas) + detokenizer.finish() == text
        assert all("\ufffd" not in d for d in deltas)
        assert len([d for d in deltas if d]) == len(text)  # one delta per character, however many bytes


def _greedy_text(llm, prompt: str, max_tokens: int = 24) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_and_deltas_is_found_and_cut(text_llm, include):
    prompt = "plain ascii text"
    text = _greedy_text(text_llm, prompt)
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3]
                and text.find(text[i:i + 3]) == i)  # three characters: three tokens at least
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["never-there", stop],
                            include_stop_str_in_output=include)
    cut = text[:text.find(stop) + (len(stop) if include else 0)]
    deltas = list(text_llm.generate(prompt, params, stream=True))
    streamed = ""
    for delta in deltas:
        streamed += delta.outputs[0].text
        assert cut.startswith(streamed), "a delta showed text the stop string then cut"
    final = deltas[-1].outputs[0]
    assert streamed == cut and final.finish_reason == "stop" and final.stop_reason == stop
    whole = text_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert whole.text == cut and whole.stop_reason == stop
    assert text_llm.get_stats().kv_blocks_used == 0  # the stopped request's blocks were freed


def test_stop_strings_are_checked():
    for bad in ("", [""], [1], "x" and {"x": 1}):
        with pytest.raises(ValueError, match="stop: expected a non-empty str, a list of them or None"):
            SamplingParams(stop=bad)
    assert SamplingParams(stop="ab").stop == ["ab"]


# ---------------------------------------------------------------- many callers


def test_many_threads_share_one_llm_and_each_gets_its_own_answers(llm, solo):
    results, errors = {}, []

    def call(t):
        try:
            chosen = [(t + k) % len(PROMPTS) for k in range(3)]
            outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in chosen], GREEDY, use_tqdm=False)
            results[t] = [(i, o.outputs[0].token_ids) for i, o in zip(chosen, outs)]
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    threads = [threading.Thread(target=call, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and len(results) == 8
    for got in results.values():
        for i, tokens in got:
            assert tokens == solo[i]
    assert llm.get_stats().kv_blocks_used == 0


def test_async_requests_stream_and_a_cancelled_one_frees_its_blocks(llm, solo):
    engine = AsyncLLM.from_llm(llm)

    started = asyncio.Event()

    async def run(i, stop_after=None, params=GREEDY):
        seen = []
        async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, params, f"async-{i}"):
            seen.append(list(out.outputs[0].token_ids))
            started.set()
            if stop_after is not None and len(seen) >= stop_after:
                break
        return seen

    async def main():
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        cancelled = asyncio.create_task(run(5, params=long))
        await started.wait()
        done = await asyncio.gather(run(0), run(1), run(2, stop_after=2))
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return done

    full0, full1, partial = asyncio.run(main())
    assert full0[-1] == solo[0] and full1[-1] == solo[1]
    assert all(a == b[:len(a)] for a, b in zip(full0, full0[1:]))  # cumulative outputs grow
    assert partial[-1] == solo[2][:len(partial[-1])]
    deadline = threading.Event()
    for _ in range(100):  # the loop thread takes the aborts before its next step
        if not llm.llm_engine.has_unfinished() and llm.get_stats().kv_blocks_used == 0:
            break
        deadline.wait(0.05)
    assert llm.get_stats().kv_blocks_used == 0


def test_a_failing_step_fails_its_own_requests_and_the_others_run_on(llm, solo, monkeypatch):
    """The step's model call raises (no row to blame): the requests it computed finish with "error",
    the one it did not compute runs on to the unmodified model's tokens, and the prefix blocks that
    step named are uncached (their K/V were never written: the same prompts later get their tokens)."""
    runner = llm.llm_engine.runner
    real, calls = runner.execute, []

    def fail_first(batch, *state, **inputs):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(batch, *state, **inputs)

    monkeypatch.setattr(runner, "execute", fail_first)
    assert llm.reset_prefix_cache()  # earlier tests' cached prompts would change what the first step computes
    # a budget of 24 tokens: the first step computes prompt 1 (17 tokens) and 7 of prompt 2; prompt 5 waits
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (1, 2, 5)], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert outs[0].error.startswith("the step computing this request failed (RuntimeError")
    assert outs[2].error is None and outs[2].outputs[0].token_ids == solo[5]
    monkeypatch.setattr(runner, "execute", real)
    again = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (1, 2)], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [solo[1], solo[2]]
    assert llm.get_stats().kv_blocks_used == 0


def test_a_blocking_caller_steps_the_engine_in_its_own_thread(llm):
    """LLM.generate runs the steps where it is called (OpenMP's pool of that thread: a second
    thread's pool halves CPU speed, runtime/engine_loop.py); AsyncLLM's steps run in the loop's
    background thread, which ends once idle."""
    threads = []
    llm.llm_engine.step_observers.append(lambda engine: threads.append(threading.current_thread()))
    try:
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
        assert set(threads) == {threading.current_thread()}
        threads.clear()

        async def run():
            async for _ in AsyncLLM.from_llm(llm).generate({"prompt_token_ids": PROMPTS[1]}, GREEDY):
                pass

        asyncio.run(run())
        assert threads and threading.current_thread() not in threads
    finally:
        llm.llm_engine.step_observers.clear()
