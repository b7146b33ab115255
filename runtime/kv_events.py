"""KV cache events in vLLM's wire format: what the prefix cache stored, removed or cleared.

Routers outside the engine (llm-d's KV-cache manager, NVIDIA Dynamo's KV router, Ray Serve's
prefix-aware routers) keep a copy of each engine's prefix cache from these events. The structs
are vLLM's (``vllm/distributed/kv_events.py``), field for field and in vLLM's order, encoded with
``msgspec.msgpack`` as vLLM encodes them since vLLM PR #42892 (what vLLM 0.26 sends): a batch is an array
``[ts, events, data_parallel_rank]``; each event a map tagged by ``"type"`` (the struct's name),
fields still at their default left out (``omit_defaults``).

Block hashes are pagedpack's own (:mod:`pagedpack.runtime.block_hash`: 32-byte sha256 digests,
msgpack ``bin``), which vLLM's ``ExternalBlockHash`` (``bytes | int``) allows; ``parent_block_hash``
is None for a sequence's first block. ``medium`` is vLLM's name of the tier the engine's own KV
pool is in, ``"GPU"`` (``MEDIUM_GPU``), whatever the device; ``group_idx`` is 0 (one KV cache
group); ``lora_id`` / ``lora_name`` None (a LoRA request's blocks say their adapter in ``extra_keys``).
``extra_keys`` holds, per block, what its hash covers besides tokens: a sequence's first block's
:func:`~pagedpack.runtime.block_hash.first_block_keys` (its ``cache_salt``, ``"lora:<digest>"``), else None.
"""
from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's spelling of the engine's own KV pool's tier


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events. ``ts``: seconds since the epoch; ``data_parallel_rank``: set by
    the publisher (0 here)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache (a map tagged ``"type": <class name>``)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence now findable by their hashes. ``token_ids``: the
    blocks' tokens, ``block_size`` per block, in order; ``parent_block_hash``: the hash of the
    block before the first (None: the sequence's first block)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer findable (evicted for other contents, or uncached)."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was emptied (``reset_prefix_cache``)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_removed(block_hash: bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0)


def blocks_stored(block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
                  extra_keys: list[tuple | None]) -> BlockStored:
    return BlockStored(block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids,
                       block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                       extra_keys=extra_keys, group_idx=0)
