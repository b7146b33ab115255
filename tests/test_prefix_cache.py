"""Prefix caching: block hashes, the pool's LRU cache, the scheduler's reuse, and end to end
against the unmodified model run one prompt at a time."""
from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from pagedpack.runtime.block_pool import BlockPool
from pagedpack.runtime.request import Request

from conftest import hf_greedy, random_prompts
from test_scheduler import check_pool, make_scheduler, solo_stream

BLOCK = 16


# --- hashes ----------------------------------------------------------------------------------


def test_block_hashes_chain_prefixes_and_salt_only_the_first_block():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5], block_size=2)
    extend_block_hashes(b, [1, 2, 3, 4], block_size=2)
    assert len(a) == 2 and a == b  # full blocks only; equal prefixes, equal hashes
    assert a[1] == hash_block_tokens(hash_block_tokens(ROOT_HASH, [1, 2]), [3, 4])
    c = []
    extend_block_hashes(c, [9, 2, 3, 4], block_size=2)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash
    salted = []
    extend_block_hashes(salted, [1, 2, 3, 4], block_size=2, extra_keys=("s",))
    assert salted[0] == hash_block_tokens(ROOT_HASH, [1, 2], ["s"]) and salted[0] != a[0]
    assert salted[1] == hash_block_tokens(salted[0], [3, 4])
    # length-prefixed fields: moving a token between the tokens and the keys changes the hash
    assert hash_block_tokens(ROOT_HASH, [1], ["2"]) != hash_block_tokens(ROOT_HASH, [1, 2])
    assert len(a[0]) == 32  # a sha256 digest


# --- the pool --------------------------------------------------------------------------------


def test_pool_keeps_freed_cached_blocks_and_evicts_least_recently_freed():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks[:3]):
        assert pool.cache_block(b, bytes([i]) * 32)
    for b in blocks:
        pool.free(b)
    # uncached block 3 is handed out first, then the cached ones in the order they were freed
    assert pool.free_block_ids() == [blocks[3], blocks[0], blocks[1], blocks[2]]
    assert (pool.num_cached_blocks, pool.num_cached_free_blocks, pool.num_evictions) == (3, 3, 0)
    pool.touch(blocks[0])  # a hit: out of the free queue, still cached
    assert pool.ref_count(blocks[0]) == 1 and blocks[0] not in pool.free_block_ids()
    assert pool.allocate() == blocks[3] and pool.num_evictions == 0
    assert pool.allocate() == blocks[1] and pool.num_evictions == 1  # the LRU cached block
    assert pool.get_cached_block(bytes([1]) * 32) is None and pool.block_hash(blocks[1]) is None
    assert pool.get_cached_block(bytes([0]) * 32) == blocks[0]


def test_pool_cache_block_keeps_the_first_block_of_a_hash():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(), pool.allocate()
    assert pool.cache_block(a, b"h" * 32)
    assert not pool.cache_block(b, b"h" * 32) and pool.block_hash(b) is None
    assert not pool.cache_block(a, b"g" * 32)  # already cached under its hash
    off = BlockPool(2, enable_caching=False)
    assert not off.cache_block(off.allocate(), b"h" * 32) and off.num_cached_blocks == 0
    with pytest.raises(RuntimeError, match="not cached"):
        pool.touch(pool.allocate())
    with pytest.raises(RuntimeError, match="not allocated"):
        off.cache_block(1, b"h" * 32)


def test_reset_cache_only_when_idle():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.cache_block(b, b"h" * 32)
    assert not pool.reset_cache()
    pool.free(b)
    assert pool.reset_cache() and pool.num_cached_blocks == 0 and pool.get_cached_block(b"h" * 32) is None


# --- the scheduler with the echo model -------------------------------------------------------


def run(scheduler, model, requests, *, check=True):
    """Add ``requests`` and step until all finish; returns per step (num_new_tokens by id, copies)."""
    for r in requests:
        scheduler.add_request(r)
    steps = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        if check:
            check_pool(scheduler.kv_cache_manager, scheduler.running, out.blocks_to_copy)
            check_salts(scheduler.running)
        steps.append(({s.request.request_id: s.num_new_tokens for s in out.scheduled}, out.blocks_to_copy))
        scheduler.update_from_output(out, model(out))
    return steps


def check_salts(running):
    """A block held by several requests is held only by requests of one ``cache_salt``."""
    salts = collections.defaultdict(set)
    for r in running:
        for b in r.block_ids:
            salts[b].add(r.cache_salt)
    assert all(len(s) == 1 for s in salts.values()), "requests with different cache_salt share a block"


def req(request_id, prompt, max_tokens=3, salt=None):
    return Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), cache_salt=salt)


def test_second_request_computes_only_what_is_not_cached():
    scheduler, model = make_scheduler(block_size=4)
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks + 3
    run(scheduler, model, [req("a", prompt)])
    steps = run(scheduler, model, [req("b", prompt + [5, 6])])
    assert steps[0][0] == {"b": 13 - 8}
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (11 + 13, 8)


def test_block_aligned_prompt_twice_computes_one_token_into_a_copied_block():
    scheduler, model = make_scheduler(block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    first = req("a", prompt)
    run(scheduler, model, [first])
    second = req("b", prompt)
    steps = run(scheduler, model, [second])
    (new_tokens, copies), = steps[:1]
    assert new_tokens == {"b": 1} and len(copies) == 1
    assert second.output_token_ids == first.output_token_ids


def test_requests_admitted_together_share_the_blocks_the_step_fills():
    """As in vLLM: blocks are named when the step filling them is scheduled, so a request admitted
    in the same step reads them (each layer writes the step's K/V before attention reads). A copy
    needs its source written before the step, so a fully cached twin recomputes its last block."""
    scheduler, model = make_scheduler(block_size=4)
    prefix = list(range(1, 9))
    a, b = req("a", prefix + [9]), req("b", prefix + [10])
    assert run(scheduler, model, [a, b])[0][0] == {"a": 9, "b": 1}
    c, d = req("c", [5] * 8), req("d", [5] * 8)
    (first, copies), *_ = run(scheduler, model, [c, d])
    assert first == {"c": 8, "d": 4} and copies == []
    for r in (a, b, c, d):
        assert (r.output_token_ids, r.finish_reason) == solo_stream(r.prompt_token_ids, r.sampling_params, None, 128)


def test_blocks_named_for_a_step_that_never_ran_are_uncached():
    scheduler, model = make_scheduler(block_size=4)
    scheduler.add_request(req("a", list(range(1, 10))))
    scheduler.schedule()  # names 2 blocks; the step then fails before it runs
    assert scheduler.kv_cache_manager.pool.num_cached_blocks == 2
    scheduler.abort_all()
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_cached_blocks == 0 and pool.num_used_blocks == 0
    assert run(scheduler, model, [req("b", list(range(1, 10)))])[0][0] == {"b": 9}


def test_cache_salt_separates_requests():
    scheduler, model = make_scheduler(block_size=4)
    prompt = list(range(1, 10))
    run(scheduler, model, [req("a", prompt, salt="alice")])
    assert run(scheduler, model, [req("b", prompt, salt="bob")])[0][0] == {"b": 9}
    assert run(scheduler, model, [req("c", prompt)])[0][0] == {"c": 9}  # unsalted is a salt of its own
    assert run(scheduler, model, [req("d", prompt, salt="alice")])[0][0] == {"d": 1}


def test_preempted_request_finds_its_own_blocks_again():
    # pool of 6 blocks of 2: "a" (8 tokens, grows to 10) and "b" cannot both grow; "b" is preempted
    scheduler, model = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a, b = req("a", list(range(1, 9)), max_tokens=3), req("b", list(range(9, 13)), max_tokens=3)
    steps = run(scheduler, model, [a, b])
    assert b.num_preemptions >= 1
    readmitted = next(n for n, _ in steps[1:] if n.get("b", 0) > 1)  # b's recompute after preemption
    assert readmitted["b"] < b.num_tokens - 1  # some of its blocks were found
    for r in (a, b):
        assert (r.output_token_ids, r.finish_reason) == solo_stream(r.prompt_token_ids, r.sampling_params, None, 128)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_blocks=st.integers(6, 16),
    max_num_batched_tokens=st.integers(1, 16),
    specs=st.lists(st.tuples(st.integers(0, 4),  # arrival step
                             st.lists(st.integers(1, 2), min_size=1, max_size=10),  # prompt, alphabet {1, 2}
                             st.integers(1, 4),  # max_tokens
                             st.sampled_from([None, "x"])),  # cache_salt
                   min_size=1, max_size=8),
)
def test_random_shared_prefixes_keep_the_pool_consistent(block_size, num_blocks, max_num_batched_tokens, specs):
    """Colliding prefixes, tight pools (eviction, preemption), random arrivals: the pool's
    invariants hold every step, no two salts share a block, every request reads back exactly its
    own tokens (the echo model) and produces its solo stream."""
    scheduler, model = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=14)
    pending = sorted(enumerate(specs), key=lambda item: item[1][0])
    requests = []
    for step_index in range(10_000):
        while pending and pending[0][1][0] <= step_index:
            i, (_, prompt, max_tokens, salt) = pending.pop(0)
            r = req(str(i), prompt, max_tokens, salt)
            if scheduler.kv_cache_manager.num_blocks_for(len(prompt) + max_tokens) <= num_blocks:
                scheduler.add_request(r)
                requests.append(r)
        if not pending and not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        check_pool(scheduler.kv_cache_manager, scheduler.running, out.blocks_to_copy)
        check_salts(scheduler.running)
        scheduler.update_from_output(out, model(out))
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == num_blocks
    for r in requests:
        assert (r.output_token_ids, r.finish_reason) == solo_stream(r.prompt_token_ids, r.sampling_params, None, 14)


# --- end to end: the tiny Llama against the unmodified model ---------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    prefix = random_prompts([200], seed=7)[0]
    suffixes = random_prompts([5 + 3 * i for i in range(16)], seed=8)
    return prefix, [prefix + s for s in suffixes]


def test_shared_prefix_matches_the_model_with_the_cache_on_and_off(model, shared_prefix_prompts):
    """16 prompts = a 200-token prefix + a suffix: together, and in two waves of 8; tokens equal
    the unmodified model's with prefix caching on and off; the second wave computes only what
    follows the shared full blocks."""
    prefix, prompts = shared_prefix_prompts
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    shared_tokens = len(prefix) // BLOCK * BLOCK  # 192: 12 full blocks
    for enable in (True, False):
        together = LLM(model, block_size=BLOCK, max_num_batched_tokens=512, enable_prefix_caching=enable)
        assert [o.outputs[0].token_ids for o in together.generate(prompts, params, use_tqdm=False)] == expected
        # with the cache off, what the first run leaves changes nothing: the waves run on the same LLM
        waves = LLM(model, block_size=BLOCK, max_num_batched_tokens=512, enable_prefix_caching=enable) \
            if enable else together
        first = waves.generate(prompts[:8], params, use_tqdm=False)
        before = waves.get_stats()
        second = waves.generate(prompts[8:], params, use_tqdm=False)
        after = waves.get_stats()
        assert [o.outputs[0].token_ids for o in first + second] == expected
        computed = after.num_prompt_tokens_computed - before.num_prompt_tokens_computed
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        if enable:
            assert computed == sum(len(p) - shared_tokens for p in prompts[8:])
            assert hits == 8 * shared_tokens and hits // BLOCK >= 8 * (len(prefix) // BLOCK)
            assert after.kv_blocks_used == 0 and after.kv_blocks_cached > 0
        else:
            assert computed == sum(map(len, prompts[8:])) and hits == 0 and after.kv_blocks_cached == 0


def test_block_aligned_prompt_again_computes_one_token(model):
    llm = LLM(model, block_size=BLOCK)
    prompt = random_prompts([2 * BLOCK], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    before = llm.get_stats()
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    after = llm.get_stats()
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == 1
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * BLOCK - 1
    assert first == again == hf_greedy(model, prompt, 6)


def test_cache_salt_end_to_end(model):
    llm = LLM(model, block_size=BLOCK)
    prompt = random_prompts([40], seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = hf_greedy(model, prompt, 4)
    hits = []
    for salt in ("a", "b", "a"):
        before = llm.get_stats().prefix_cache_hits
        out = llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
        hits.append(llm.get_stats().prefix_cache_hits - before)
    assert hits == [0, 0, 2 * BLOCK]


def test_preemption_with_the_cache_on_matches_an_unconstrained_run(model):
    prompts = random_prompts([30, 45, 17, 60, 33, 50], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    roomy = LLM(model, block_size=BLOCK).generate(prompts, params, use_tqdm=False)
    tight = LLM(model, block_size=BLOCK, num_blocks=9)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 20) for p in prompts]
