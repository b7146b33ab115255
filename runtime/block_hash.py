"""Content hashes of full KV blocks, chained along a sequence (the prefix cache's keys).

Block ``j`` of a sequence holds the K/V of tokens ``j * block_size .. (j + 1) * block_size - 1``,
and those values depend on every token before them. So a block is named by

    hash_j = sha256(hash_{j-1} || its block_size token ids || extra keys)

(``hash_{-1}`` a fixed root), which equals another sequence's ``hash_j`` only if their first
``(j + 1) * block_size`` tokens and extra keys are equal. This is vLLM v1's scheme
(``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``): a cryptographic hash over a canonical
encoding, so that two different prefixes sharing a block would need a sha256 collision. Extra
keys carry what changes the K/V of the same tokens (a request's ``cache_salt``, its LoRA adapter's
files' digest: :func:`first_block_keys`); as in vLLM they enter the first block only, and the chain carries them on.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # a sha256 digest, 32 bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"pagedpack prefix cache v1").digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """``sha256(parent, token_ids, extra_keys)`` of one full block.

    parent: the previous block's hash, :data:`ROOT_HASH` for the first block. token_ids: the
    block's token ids (non-negative ints below 2**63). extra_keys: strings (UTF-8 encoded).
    Every field is length-prefixed, so no two different inputs share an encoding.
    """
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<Q", len(extra_keys)))
    for key in extra_keys:
        data = key.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def first_block_keys(cache_salt: str | None = None, lora_digest: str | None = None) -> tuple[str, ...]:
    """The extra keys of a sequence's first block: its ``cache_salt``, then ``"lora:<digest>"`` for a
    request of a LoRA adapter, the sha256 of its files (as vLLM's ``_gen_lora_extra_hash_keys`` adds the
    adapter, but by what it computes, not its name, which an unload and a load may give other weights):
    no prefix hit across adapters, or between an adapter and the base model."""
    return (*(() if cache_salt is None else (cache_salt,)),
            *(() if lora_digest is None else (f"lora:{lora_digest}",)))


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple[str, ...] = ()) -> None:
    """Append to ``hashes`` the hash of every full block of ``token_ids`` it lacks (the first
    ``len(hashes)`` are taken as already computed for the same tokens); ``extra_keys``: the first
    block's (:func:`first_block_keys`)."""
    if not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys: expected a tuple of strings (first_block_keys), got {extra_keys!r:.60}")
    parent = hashes[-1] if hashes else ROOT_HASH
    for j in range(len(hashes), len(token_ids) // block_size):
        extra = extra_keys if j == 0 else ()
        parent = hash_block_tokens(parent, token_ids[j * block_size:(j + 1) * block_size], extra)
        hashes.append(parent)
