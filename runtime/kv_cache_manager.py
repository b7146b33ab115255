"""Physical KV blocks: who owns which, and how many are left.

``BlockAllocator`` hands out block ids with reference counts (so blocks can later be shared by
a prefix cache); ``KVCacheManager`` grows and frees each request's ``block_ids``.
"""
from __future__ import annotations

from collections import deque

from pagedpack.runtime.request import Request


class BlockAllocator:
    """Free list plus reference counts over block ids ``0 .. num_blocks - 1``.

    Blocks are handed out in id order at first; a freed block goes to the front of the free
    list and is the next one handed out, so a run keeps reusing the blocks whose cache lines
    and pages are already warm instead of cycling through the whole pool (on the CPU the pool's
    pages become resident only once written: ``ModelRunner``).

    ``allocate`` raises ``RuntimeError`` when no block is free; ``free``/``incref`` raise
    ``RuntimeError`` on a block that is not allocated and ``ValueError`` on an id out of range.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._peak_used = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def peak_used_blocks(self) -> int:
        """Most blocks in use at once since construction or the last ``reset_peak()``."""
        return self._peak_used

    def reset_peak(self) -> None:
        self._peak_used = self.num_used_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self) -> int:
        """Take a free block (reference count 1)."""
        if not self._free:
            raise RuntimeError(f"no free KV block (all {self.num_blocks} in use)")
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        self._peak_used = max(self._peak_used, self.num_used_blocks)
        return block_id

    def incref(self, block_id: int) -> None:
        """One more owner of an allocated block."""
        self._check_allocated(block_id)
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one owner; the block returns to the free list when none is left."""
        self._check_allocated(block_id)
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.appendleft(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id: expected an id in [0, {self.num_blocks}), got {block_id}")

    def _check_allocated(self, block_id: int) -> None:
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} is not allocated")


class KVCacheManager:
    """Grows each request's ``block_ids`` to cover its tokens, and frees them.

    A request's blocks cover ``len(block_ids) * block_size`` token positions; block ``j``
    holds positions ``j * block_size .. (j + 1) * block_size - 1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used_blocks

    @property
    def peak_used_blocks(self) -> int:
        return self.allocator.peak_used_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens)`` would succeed now."""
        return self._num_missing_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Extend ``request.block_ids`` to cover ``num_computed_tokens + num_new_tokens`` tokens.

        All or nothing: returns ``False`` and changes nothing when too few blocks are free.
        """
        missing = self._num_missing_blocks(request, num_new_tokens)
        if missing > self.num_free_blocks:
            return False
        request.block_ids.extend(self.allocator.allocate() for _ in range(missing))
        return True

    def free(self, request: Request) -> None:
        """Release all blocks of ``request`` (last block first) and empty its ``block_ids``."""
        for block_id in reversed(request.block_ids):
            self.allocator.free(block_id)
        request.block_ids.clear()
