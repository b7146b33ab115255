"""The pool of physical KV blocks: reference counts, a free queue, and the prefix cache.

Semantics follow vLLM v1's ``BlockPool`` (``vllm/v1/core/block_pool.py``): a block whose last
owner lets go keeps its K/V and its content hash and stays findable by that hash until the pool
needs the block for something else (eviction, least recently freed first); a hit on such a block
takes it out of the free queue again (``touch``).

The free queue is ordered by what should be handed out next:

* a freed block without a hash (a partial block, or caching off) goes to the front: its
  contents are worth nothing, and reusing it first keeps a run on warm cache lines and pages
  (on the CPU the pool's pages become resident only once written: ``ModelRunner``);
* a freed block with a hash goes to the back, so the cached blocks are evicted in LRU order;
  a request frees its blocks last block first, so its tail goes before its prefix, which other
  requests are likelier to share.

With ``enable_kv_cache_events`` the pool records each change of the prefix cache as vLLM's pool
does (:mod:`pagedpack.runtime.kv_events`): a block evicted or uncached (``BlockRemoved``), the cache
reset (``AllBlocksCleared``); the ``KVCacheManager``, which knows a block's tokens, records
``BlockStored``. The engine takes them once per step (:meth:`BlockPool.take_events`).
"""
from __future__ import annotations

from collections import OrderedDict

from pagedpack.runtime.block_hash import BlockHash
from pagedpack.runtime.kv_events import AllBlocksCleared, KVCacheEvent, block_removed


class BlockPool:
    """Block ids ``0 .. num_blocks - 1`` with reference counts and an optional prefix cache.

    ``allocate`` raises ``RuntimeError`` when no block is free; ``free``/``incref`` raise
    ``RuntimeError`` on a block that is not allocated; every method taking an id raises
    ``ValueError`` for one out of range.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next out
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._peak_used = 0
        self.num_evictions = 0
        self.kv_events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None  # since take_events
        # (hash, block id) of each cached block handed out for other contents, since take_evicted:
        # its K/V are still in the block until the step that allocated it runs (a KV connector saves them)
        self.evicted: list[tuple[BlockHash, int]] = []

    # --- counts ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody owns (cached ones included: they are handed out when needed)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by their hash, owned or not."""
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Cached blocks nobody owns (reusable by a hit until evicted)."""
        return sum(self._ref_counts[b] == 0 for b in self._cached.values())

    @property
    def peak_used_blocks(self) -> int:
        """Most blocks in use at once since construction or the last ``reset_peak()``."""
        return self._peak_used

    def reset_peak(self) -> None:
        self._peak_used = self.num_used_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is cached under, or None."""
        self._check_id(block_id)
        return self._hashes[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, next block handed out first."""
        return list(self._free)

    def cached_blocks(self) -> dict[BlockHash, int]:
        """A copy of the hash -> block map."""
        return dict(self._cached)

    # --- ownership ------------------------------------------------------------------------

    def allocate(self) -> int:
        """Take the first block of the free queue (reference count 1), evicting it from the
        cache if it was cached."""
        if not self._free:
            raise RuntimeError(f"no free KV block (all {self.num_blocks} in use)")
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block_id] = None
            self.num_evictions += 1
            self.evicted.append((block_hash, block_id))
            if self.kv_events is not None:
                self.kv_events.append(block_removed(block_hash))
        self._ref_counts[block_id] = 1
        self._peak_used = max(self._peak_used, self.num_used_blocks)
        return block_id

    def touch(self, block_id: int) -> None:
        """One more owner of a cached block found by its hash (it leaves the free queue if it
        was there). ``RuntimeError`` if it is not cached."""
        self._check_id(block_id)
        if self._hashes[block_id] is None:
            raise RuntimeError(f"block {block_id} is not cached")
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
            self._peak_used = max(self._peak_used, self.num_used_blocks)
        self._ref_counts[block_id] += 1

    def incref(self, block_id: int) -> None:
        """One more owner of an allocated block."""
        self._check_allocated(block_id)
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one owner; with none left the block joins the free queue (module docstring)."""
        self._check_allocated(block_id)
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if self._hashes[block_id] is None:
                self._free.move_to_end(block_id, last=False)

    # --- the prefix cache -----------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, or None (always None with caching off)."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make the allocated ``block_id`` findable by ``block_hash`` (its K/V complete and final
        once the step being scheduled has run). Returns False, changing nothing, with caching off,
        if the block is already cached, or if another block is cached under that hash (two
        requests computed the same block; the first stays the one found)."""
        self._check_allocated(block_id)
        if not self.enable_caching or self._hashes[block_id] is not None or block_hash in self._cached:
            return False
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Forget ``block_id``'s hash (its contents are not what the hash says)."""
        self._check_id(block_id)
        block_hash, self._hashes[block_id] = self._hashes[block_id], None
        if block_hash is not None and self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
            if self.kv_events is not None:
                self.kv_events.append(block_removed(block_hash))

    def reset_cache(self) -> bool:
        """Uncache every block; only when nobody holds a block (returns False otherwise)."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """``(hash, block_id)`` of each block evicted since the last call, in order."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def lru_cached_free_blocks(self, limit: int) -> list[tuple[BlockHash, int]]:
        """``(hash, block_id)`` of up to ``limit`` cached blocks nobody owns, next evicted first."""
        found = []
        for block_id in self._free:
            if len(found) >= limit:
                break
            if self._hashes[block_id] is not None:
                found.append((self._hashes[block_id], block_id))
        return found

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order (none with events off)."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id: expected an id in [0, {self.num_blocks}), got {block_id}")

    def _check_allocated(self, block_id: int) -> None:
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} is not allocated")
