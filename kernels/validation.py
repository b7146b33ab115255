"""Value checks on paged/packed attention metadata.

The batch builder always checks its block table (its other fields hold by construction); the ops
run them all when ``PAGEDPACK_VALIDATE=1`` (they need the metadata's values, i.e. a device sync,
so they stay off the hot path by default).
Every failure is a ``ValueError`` naming the argument, what was expected and what came.

Inside :func:`checked_step` (the runner's step, whose metadata the batch builder checked once and
whose caches the runner allocated to the program's specs) the ops also skip their per-call
argument checks; called directly, or with ``PAGEDPACK_VALIDATE=1``, they always run them.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import numpy as np
import torch

_STEP_CHECKED = contextvars.ContextVar("pagedpack_step_checked", default=False)


def validation_enabled() -> bool:
    """True when ``PAGEDPACK_VALIDATE=1`` asks the ops to check metadata values."""
    return os.environ.get("PAGEDPACK_VALIDATE", "0") == "1"


def arguments_checked() -> bool:
    """True inside :func:`checked_step` unless ``PAGEDPACK_VALIDATE=1``: the ops' argument checks
    were done once for the whole step."""
    return _STEP_CHECKED.get() and not validation_enabled()


@contextlib.contextmanager
def checked_step():
    """Run one step whose metadata and caches were checked once (see the module docstring)."""
    token = _STEP_CHECKED.set(True)
    try:
        yield
    finally:
        _STEP_CHECKED.reset(token)


def _host_int64(values: torch.Tensor) -> np.ndarray:
    """``values`` as an int64 NumPy array on the host (the checks run on a few hundred values: NumPy
    takes about a microsecond an op where a torch op takes several)."""
    return values.detach().cpu().numpy().astype(np.int64, copy=False)


def check_cu_seqlens_q(cu_seqlens_q: torch.Tensor, num_tokens: int) -> np.ndarray:
    """``cu_seqlens_q`` must start at 0, never decrease, and end at ``num_tokens``.

    Returns the per-sequence query lengths ``q_lens`` (int64 ``[B]``, a NumPy array).
    """
    cu = _host_int64(cu_seqlens_q)
    if cu.size == 0 or cu[0] != 0:
        raise ValueError(f"cu_seqlens_q: expected cu_seqlens_q[0] == 0, got {cu.tolist()[:8]}")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        b = int(np.flatnonzero(q_lens < 0)[0])
        raise ValueError(
            f"cu_seqlens_q: expected a non-decreasing sequence, got cu_seqlens_q[{b}]={int(cu[b])} "
            f"> cu_seqlens_q[{b + 1}]={int(cu[b + 1])}"
        )
    if cu[-1] != num_tokens:
        raise ValueError(
            f"cu_seqlens_q: expected the last entry to equal num_tokens={num_tokens}, got {int(cu[-1])}"
        )
    return q_lens


def check_seq_lens(seq_lens: torch.Tensor, q_lens: np.ndarray) -> np.ndarray:
    """``seq_lens[b] >= q_lens[b]``: the KV of this step's tokens is part of ``seq_lens``. Returns
    ``seq_lens`` as an int64 NumPy array."""
    kv = _host_int64(seq_lens)
    bad = np.flatnonzero(kv < q_lens)
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"seq_lens: expected seq_lens[{b}] >= q_len={int(q_lens[b])} (the KV length includes this "
            f"step's tokens), got {int(kv[b])}"
        )
    return kv


def check_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor | np.ndarray, num_blocks: int, block_size: int
) -> None:
    """Every block a sequence reads is a valid id, and each row is wide enough for its length."""
    bt = _host_int64(block_table)
    kv = seq_lens if isinstance(seq_lens, np.ndarray) else _host_int64(seq_lens)
    needed = (kv + block_size - 1) // block_size
    if bt.ndim != 2 or bt.shape[0] != kv.shape[0]:
        raise ValueError(
            f"block_table: expected {kv.shape[0]} rows (one per sequence), got shape {tuple(bt.shape)}"
        )
    too_narrow = np.flatnonzero(needed > bt.shape[1])
    if too_narrow.size:
        b = int(too_narrow[0])
        raise ValueError(
            f"block_table: expected at least {int(needed[b])} columns for seq_lens[{b}]={int(kv[b])} "
            f"with block_size={block_size}, got {bt.shape[1]}"
        )
    used = np.arange(bt.shape[1]) < needed[:, None]  # the columns each sequence reads
    bad = np.argwhere(used & ((bt < 0) | (bt >= num_blocks)))
    if bad.size:
        b, j = bad[0].tolist()
        raise ValueError(
            f"block_table: expected block ids in [0, {num_blocks}), got block_table[{b}, {j}]={int(bt[b, j])}"
        )


def check_slot_mapping(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Slots are ``-1`` (skip) or inside the pool ``[0, num_blocks * block_size)``."""
    slots = _host_int64(slot_mapping)
    num_slots = num_blocks * block_size
    bad = np.flatnonzero((slots < -1) | (slots >= num_slots))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"slot_mapping: expected -1 or a slot in [0, {num_slots}) (num_blocks={num_blocks} x "
            f"block_size={block_size}), got slot_mapping[{t}]={int(slots[t])}"
        )


def check_paged_metadata(
    *,
    num_tokens: int,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    num_blocks: int,
    block_size: int,
) -> None:
    """All value checks of one step's metadata (see the module docstring)."""
    q_lens = check_cu_seqlens_q(cu_seqlens_q, num_tokens)
    kv = check_seq_lens(seq_lens, q_lens)
    check_block_table(block_table, kv, num_blocks, block_size)
    if slot_mapping is not None:
        check_slot_mapping(slot_mapping, num_blocks, block_size)
