"""Each request's KV blocks: growing them, finding a cached prefix, copying, freeing.

``KVCacheManager`` keeps every request's ``block_ids`` over a :class:`BlockPool`; with prefix
caching on it names each full block by its content hash (:mod:`pagedpack.runtime.block_hash`),
offers a computed block to the cache, and on admission finds the longest cached prefix of a new
request in whole blocks (vLLM v1's ``KVCacheManager`` semantics, with one difference noted on
:meth:`KVCacheManager.find_cached_prefix`).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedpack.runtime.block_hash import extend_block_hashes
from pagedpack.runtime.block_pool import BlockPool
from pagedpack.runtime.kv_events import blocks_stored
from pagedpack.runtime.request import Request


@dataclass
class CachedPrefix:
    """What the prefix cache holds of a waiting request.

    block_ids: the cached blocks of its first ``len(block_ids)`` full blocks, in order.
    num_tokens: tokens whose K/V need not be computed (its ``num_computed_tokens`` once
        admitted): ``len(block_ids) * block_size``, or one less when every token is cached, so
        that the last one is computed and gives logits to sample from; the last block is then
        copied into a block of the request's own before that token's K/V is written to it.
    """

    block_ids: list[int]
    num_tokens: int

    def copies_last_block(self, block_size: int) -> bool:
        return self.num_tokens < len(self.block_ids) * block_size


NO_PREFIX = CachedPrefix([], 0)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens over admitted requests (as vLLM counts them):
    ``queries`` their tokens, ``hits`` the tokens found cached (not computed)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Grows each request's ``block_ids`` to cover its tokens, shares cached blocks, frees them.

    A request's blocks cover ``len(block_ids) * block_size`` token positions; block ``j``
    holds positions ``j * block_size .. (j + 1) * block_size - 1``.

    Block copies (``(src, dst)`` pairs: copy-on-write of a shared last block) are registered
    here, handed to the step that performs them by :meth:`take_block_copies`, and their sources
    held (one reference each) until :meth:`end_step`.

    With ``num_state_slots`` (a model with recurrent layers), a request also holds a state slot
    from its first allocation until it is freed (finished, aborted, preempted: a preempted request
    recomputes from its first token, so its state starts over). A fork takes a copy of its
    parent's state (:meth:`take_state_copies`, made before the step that reads it). Prefix caching
    is off for such models: a cached prefix would skip the tokens whose state the slot lacks.

    With ``enable_kv_cache_events`` each run of consecutive blocks of one request that it caches is
    recorded in the pool's events as a ``BlockStored`` (:mod:`pagedpack.runtime.kv_events`).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, enable_kv_cache_events: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        if num_state_slots and enable_prefix_caching:
            raise ValueError("enable_prefix_caching: expected False for a model with recurrent state (its state "
                             "is not cached with the prefix's blocks), got True")
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pending_state_copies: list[tuple[int, int]] = []
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching,
                              enable_kv_cache_events=enable_kv_cache_events)
        self.prefix_cache_stats = PrefixCacheStats()
        self._pending_copies: list[tuple[int, int]] = []
        self._copies_in_step: list[tuple[int, int]] = []
        self._named_in_step: set[int] = set()  # blocks cached while the step writing them is scheduled

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def peak_used_blocks(self) -> int:
        return self.pool.peak_used_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[bytes]:
        """The hashes of all full blocks of ``request.all_token_ids`` (extended as tokens come)."""
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.block_keys)
        return request.block_hashes

    def find_cached_prefix(self, request: Request) -> list[CachedPrefix]:
        """What the cache holds of ``request``'s leading full blocks, best first: the longest run
        found, and, when that copies its last block, the same run without that block (the copy
        needs one block more than the request's tokens: the fallback where the pool is short).

        Unlike vLLM v1, which recomputes a whole block when every token is cached, a fully
        cached request computes only its last token (into a copy of its last block). A request
        still missing prompt logprobs takes no cached block past the first position whose logits
        they need (:attr:`~pagedpack.runtime.request.Request.first_missing_prompt_logprob`; a new one
        none, as vLLM skips the cache for it)."""
        if not self.enable_prefix_caching or request.block_ids:
            return [NO_PREFIX]
        needed_from = request.first_missing_prompt_logprob
        if needed_from is not None and needed_from < self.block_size:
            return [NO_PREFIX]
        hashes = self.block_hashes(request)
        hits = []
        for block_hash in hashes if needed_from is None else hashes[:needed_from // self.block_size]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        found = CachedPrefix(hits, min(len(hits) * self.block_size, request.num_tokens - 1))
        if not found.copies_last_block(self.block_size):
            return [found]
        whole_blocks = CachedPrefix(hits[:-1], (len(hits) - 1) * self.block_size)
        if hits[-1] in self._named_in_step:  # its K/V are written only by the step being scheduled
            return [whole_blocks]
        return [found, whole_blocks]

    def _num_missing_blocks(self, request: Request, num_new_tokens: int, prefix: CachedPrefix) -> int:
        kept = len(request.block_ids) or prefix.num_tokens // self.block_size
        needed = self.num_blocks_for(max(request.num_computed_tokens, prefix.num_tokens) + num_new_tokens)
        # touching a cached block nobody owns takes it out of the free queue
        revived = sum(self.pool.ref_count(b) == 0 for b in prefix.block_ids)
        return max(0, needed - kept) + revived

    def can_allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX,
                     num_external_tokens: int = 0) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens, prefix, num_external_tokens)`` would succeed now."""
        if self.num_state_slots and request.state_slot < 0 and not self._free_slots:
            return False
        return self._num_missing_blocks(request, num_external_tokens + num_new_tokens, prefix) <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX,
                       num_external_tokens: int = 0, *, name_external: bool = True) -> bool:
        """Extend ``request.block_ids`` to cover ``num_computed_tokens + num_new_tokens`` tokens.

        With ``prefix`` (from :meth:`find_cached_prefix`, for a request holding no blocks) the
        request first takes the prefix's blocks and ``num_computed_tokens = prefix.num_tokens``,
        and the admission is counted in :attr:`prefix_cache_stats`. ``num_external_tokens`` (a whole
        number of blocks, for a request holding no blocks): tokens past the prefix that a KV connector
        loads into the blocks allocated for them; they count as computed. They are named for the
        prefix cache with the step's blocks (their load runs before the step), or, with
        ``name_external=False`` (an asynchronous load), only when a later allocation covers them.
        All or nothing: returns ``False`` and changes nothing when too few blocks are free.
        """
        if not self.can_allocate(request, num_new_tokens, prefix, num_external_tokens):
            return False
        if self.num_state_slots and request.state_slot < 0:
            request.state_slot = self._free_slots.pop()
        if prefix is not NO_PREFIX:
            self._take_prefix(request, prefix)
        named_up_to = request.num_computed_tokens + (num_external_tokens if name_external else 0) + num_new_tokens
        request.num_computed_tokens += num_external_tokens
        missing = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        request.block_ids.extend(self.pool.allocate() for _ in range(missing))
        if prefix.copies_last_block(self.block_size):
            self._pending_copies.append((prefix.block_ids[-1], request.block_ids[len(prefix.block_ids) - 1]))
        self._name_blocks(request, named_up_to)
        return True

    def free_blocks_past(self, request: Request, num_tokens: int) -> None:
        """Free ``request``'s blocks past the first ``num_tokens`` tokens' (those held only rejected draft
        tokens: never offered to the prefix cache, which names blocks of known tokens only)."""
        keep = self.num_blocks_for(num_tokens)
        for block_id in reversed(request.block_ids[keep:]):
            self.pool.free(block_id)
        del request.block_ids[keep:]

    def forget_blocks(self, request: Request, first: int) -> None:
        """``request``'s blocks from index ``first`` on do not hold what their hashes say (a KV
        connector's load failed): uncache them and let the request name them again once recomputed."""
        for block_id in request.block_ids[first:]:
            if self.pool.block_hash(block_id) is not None:
                self.pool.uncache(block_id)
        request.num_cached_blocks = min(request.num_cached_blocks, first)

    def _take_prefix(self, request: Request, prefix: CachedPrefix) -> None:
        for block_id in prefix.block_ids:
            self.pool.touch(block_id)  # the copied last block: held as the copy's source
        kept = prefix.num_tokens // self.block_size
        request.block_ids.extend(prefix.block_ids[:kept])
        request.num_computed_tokens = prefix.num_tokens
        request.num_cached_blocks = kept
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += prefix.num_tokens

    def _name_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks that the first ``num_tokens`` tokens fill to the prefix cache now, as
        vLLM does at allocation: the step being scheduled writes their K/V, and each layer writes
        all of a step's K/V before its attention reads any, so a request admitted in the same step
        may read them already. They are uncached again if that step never runs (:meth:`reset`)."""
        if not self.enable_prefix_caching:
            return
        full = min(num_tokens, request.num_tokens) // self.block_size  # blocks whose tokens are all known
        if full <= request.num_cached_blocks:
            return
        hashes = self.block_hashes(request)
        stored = []  # the blocks this call cached (a block another one is cached under is not)
        for j in range(request.num_cached_blocks, full):
            if self.pool.cache_block(request.block_ids[j], hashes[j]):
                self._named_in_step.add(request.block_ids[j])
                stored.append(j)
        request.num_cached_blocks = full
        if self.pool.kv_events is not None and stored:
            self._record_stored(request, hashes, stored)

    def _record_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive block indices in ``stored``."""
        runs: list[list[int]] = []
        for j in stored:
            if runs and runs[-1][-1] == j - 1:
                runs[-1].append(j)
            else:
                runs.append([j])
        size, keys = self.block_size, request.block_keys
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.pool.kv_events.append(blocks_stored(
                hashes[first:end], hashes[first - 1] if first else None,
                list(request.all_token_ids[first * size:end * size]), size,
                [keys if j == 0 and keys else None for j in run]))

    def fork_blocks(self, parent: Request, child: Request) -> bool:
        """Give ``child`` (holding no blocks) ``parent``'s computed tokens: it shares the full
        blocks and gets a copy of the partial last one (registered for the next step). Returns
        False, changing nothing, if no block is free for the copy."""
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and not self.num_free_blocks or self.num_state_slots and not self._free_slots:
            return False
        if self.num_state_slots:
            child.state_slot = self._free_slots.pop()
            self._pending_state_copies.append((parent.state_slot, child.state_slot))
        for block_id in parent.block_ids[:full]:
            self.pool.incref(block_id)
        child.block_ids = parent.block_ids[:full]
        if partial:
            child.block_ids.append(self.pool.allocate())
            self.copy_block(parent.block_ids[full], child.block_ids[-1])
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        return True

    def copy_block(self, src: int, dst: int) -> None:
        """Register a copy of block ``src`` into the allocated block ``dst`` for the next step;
        ``src`` is held until that step ends."""
        self.pool.incref(src)
        self._pending_copies.append((src, dst))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` state-slot copies (forks) the step being scheduled must make before it runs."""
        copies, self._pending_state_copies = self._pending_state_copies, []
        return copies

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` copies the step being scheduled must perform before it runs."""
        copies, self._pending_copies = self._pending_copies, []
        self._copies_in_step.extend(copies)
        return copies

    def end_step(self) -> None:
        """The step ran: release the sources of its copies; the blocks it named hold their K/V."""
        for src, _ in self._copies_in_step:
            self.pool.free(src)
        self._copies_in_step = []
        self._named_in_step = set()

    def free(self, request: Request) -> None:
        """Release all blocks of ``request`` (last block first: its tail is evicted before its
        prefix) and its state slot, and empty its ``block_ids``."""
        for block_id in reversed(request.block_ids):
            self.pool.free(block_id)
        request.block_ids.clear()
        request.num_cached_blocks = 0
        if request.state_slot >= 0:
            self._free_slots.append(request.state_slot)
            request.state_slot = -1

    def reset(self) -> None:
        """After an abort: drop pending copies (releasing their sources) and uncache the blocks
        named for a step that did not run (their K/V were never written)."""
        for block_id in self._named_in_step:
            self.pool.uncache(block_id)
        self._copies_in_step += self._pending_copies
        self._pending_copies, self._pending_state_copies = [], []
        self.end_step()
