"""Parallel sampling (``SamplingParams(n=...)``): the prompt's KV is computed once and shared,
each completion writes only its own blocks and equals the prompt run alone with its seed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.request import Request

from conftest import random_prompts
from test_scheduler import check_pool, make_scheduler, solo_stream


def with_forks(request_id: str, prompt: list[int], n: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first, *forks = [Request(f"{i}_{request_id}", prompt, params) for i in range(n)]
    first.forks = forks
    return first


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_blocks=st.integers(5, 14),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(1, 16),
    enable_prefix_caching=st.booleans(),
    specs=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=4),
)
def test_forks_share_the_prompt_and_write_only_their_own_blocks(
        block_size, num_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, specs):
    """Echo model (tests/test_scheduler.py): every step the pool's counts match the owners, no
    step writes a block another request holds, every completion reads back its own history and
    equals its solo stream; with room for all, each prompt token is computed once."""
    scheduler, model = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=16,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_prefix_caching=enable_prefix_caching)
    leaders, requests, computed = [], [], 0
    for i, (num_prompt, n, max_tokens) in enumerate(specs):
        prompt = [(3 * i + j) % 7 + 1 for j in range(num_prompt)]
        if scheduler.kv_cache_manager.num_blocks_for(num_prompt + max_tokens) <= num_blocks:
            leader = with_forks(str(i), prompt, n, max_tokens)
            scheduler.add_request(leader)
            leaders.append(leader)
            requests += [leader, *leader.forks]
    preempted = False
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        check_pool(scheduler.kv_cache_manager, scheduler.running, out.blocks_to_copy)
        preempted |= bool(out.preempted)
        computed += sum(min(s.request.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens)
                        - min(s.request.num_computed_tokens, s.request.num_prompt_tokens) for s in out.scheduled)
        scheduler.update_from_output(out, model(out))
    assert scheduler.kv_cache_manager.num_used_blocks == 0
    for r in requests:
        assert (r.output_token_ids, r.finish_reason) == solo_stream(r.prompt_token_ids, r.sampling_params, None, 16)
    roomy = num_blocks >= sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens + block_size for r in requests)
    if roomy and max_num_seqs >= len(requests) and not preempted:
        assert computed == sum(len(r.prompt_token_ids) for r in leaders)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_n_completions_equal_their_seeds_run_alone_and_the_prompt_is_computed_once(model, enable_prefix_caching):
    prompt = random_prompts([37], seed=11)[0]  # two full blocks of 16 and a partial one: shared + copied
    params = SamplingParams(n=4, temperature=0.9, seed=123, max_tokens=10)
    llm = LLM(model, block_size=16, enable_prefix_caching=enable_prefix_caching)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    stats = llm.get_stats()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.error is None
    assert stats.num_prompt_tokens_computed == len(prompt)
    assert stats.kv_blocks_used == 0
    alone = LLM(model, block_size=16, enable_prefix_caching=False)
    for i, completion in enumerate(out.outputs):
        solo = alone.generate(prompt, SamplingParams(temperature=0.9, seed=123 + i, max_tokens=10), use_tqdm=False)
        assert completion.token_ids == solo[0].outputs[0].token_ids, f"completion {i}"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds differ, so do the samples


def test_n_with_a_tight_pool_and_few_sequences_still_matches(model):
    """Forks that find no room wait and recompute; the tokens do not change."""
    prompts = random_prompts([21, 40], seed=12)
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12)
    roomy = LLM(model, block_size=16).generate(prompts, params, use_tqdm=False)
    tight = LLM(model, block_size=16, num_blocks=6, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in tight] == [[c.token_ids for c in o.outputs] for o in roomy]


def test_n_is_checked():
    with pytest.raises(ValueError, match=r"n: expected an int >= 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"seed: with n=3"):
        SamplingParams(n=3, seed=2**64 - 2)
