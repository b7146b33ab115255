"""BlockPool and KVCacheManager: counts, all-or-nothing growth, freeing."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack.runtime.block_pool import BlockPool
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import SamplingParams


def make_request(request_id: str = "r", num_prompt_tokens: int = 1) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)), SamplingParams())


def test_allocator_counts_and_peak():
    alloc = BlockPool(4)
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.peak_used_blocks) == (4, 0, 0)
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    assert len({a, b, c}) == 3
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.peak_used_blocks) == (1, 3, 3)
    alloc.free(b)
    assert (alloc.num_used_blocks, alloc.peak_used_blocks) == (2, 3)
    alloc.reset_peak()
    assert alloc.peak_used_blocks == 2
    alloc.allocate()
    assert alloc.peak_used_blocks == 3


def test_allocator_exhaustion_raises():
    alloc = BlockPool(2)
    alloc.allocate()
    alloc.allocate()
    with pytest.raises(RuntimeError, match="no free KV block"):
        alloc.allocate()


def test_allocator_refcounts():
    alloc = BlockPool(2)
    block = alloc.allocate()
    alloc.incref(block)
    assert alloc.ref_count(block) == 2
    alloc.free(block)
    assert alloc.num_free_blocks == 1  # still owned once
    alloc.free(block)
    assert alloc.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="not allocated"):
        alloc.free(block)
    with pytest.raises(RuntimeError, match="not allocated"):
        alloc.incref(block)
    with pytest.raises(ValueError, match="block_id"):
        alloc.free(2)


def test_allocator_reuses_freed_blocks():
    alloc = BlockPool(1)
    block = alloc.allocate()
    alloc.free(block)
    assert alloc.allocate() == block


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_blocks_for(num_tokens, expected):
    assert KVCacheManager(num_blocks=8, block_size=4).num_blocks_for(num_tokens) == expected


def test_allocate_slots_grows_to_cover_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(num_prompt_tokens=6)
    assert kv.allocate_slots(req, 6)
    assert len(req.block_ids) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2)  # positions 6, 7: same blocks
    assert len(req.block_ids) == 2
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)
    assert len(req.block_ids) == 3
    assert kv.num_used_blocks == 3


def test_allocate_slots_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    req = make_request(num_prompt_tokens=7)
    assert not kv.can_allocate(req, 7)
    assert not kv.allocate_slots(req, 7)
    assert req.block_ids == [] and kv.num_free_blocks == 3
    assert kv.can_allocate(req, 6)
    assert kv.allocate_slots(req, 6)
    assert kv.num_free_blocks == 0


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a, b = make_request("a", 3), make_request("b", 4)
    assert kv.allocate_slots(a, 3) and kv.allocate_slots(b, 4)
    assert set(a.block_ids).isdisjoint(b.block_ids)
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 2
    assert kv.peak_used_blocks == 4
    kv.free(b)
    assert kv.num_free_blocks == 4


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 5),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), max_size=40),
)
def test_random_grow_and_free_keeps_ownership_exclusive(num_blocks, block_size, ops):
    """Random growth and frees of 4 requests: blocks are never shared or lost."""
    kv = KVCacheManager(num_blocks, block_size)
    reqs = [make_request(str(i), 1) for i in range(4)]
    for index, grow in ops:
        req = reqs[index]
        if grow == 0:
            kv.free(req)
            req.num_computed_tokens = 0
            continue
        before = list(req.block_ids)
        expect_ok = kv.num_blocks_for(req.num_computed_tokens + grow) - len(before) <= kv.num_free_blocks
        assert kv.can_allocate(req, grow) == expect_ok
        assert kv.allocate_slots(req, grow) == expect_ok
        if expect_ok:
            assert req.block_ids[: len(before)] == before
            assert len(req.block_ids) == kv.num_blocks_for(req.num_computed_tokens + grow)
            req.num_computed_tokens += grow
        else:
            assert req.block_ids == before
        owned = [b for r in reqs for b in r.block_ids]
        assert len(owned) == len(set(owned)) == kv.num_used_blocks
        assert kv.num_used_blocks + kv.num_free_blocks == num_blocks
        assert kv.peak_used_blocks >= kv.num_used_blocks
