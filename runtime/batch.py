"""The packed, paged metadata of one scheduled step (the rewritten graph's extra inputs).

Names, shapes and dtypes are those of docs/design.md: all ``T`` new tokens of the ``B``
scheduled sequences form one packed row; sequence ``b`` owns rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import numpy as np
import torch

from pagedpack.kernels.validation import check_paged_metadata
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.runtime.scheduler import ScheduledRequest


@dataclass
class BatchMetadata:
    """One step's inputs.

    input_ids: int64 ``[T]``, the new tokens.
    positions: int64 ``[T]``, each token's absolute position in its sequence.
    cu_seqlens_q: int32 ``[B+1]``, packed row offsets of the sequences.
    seq_lens: int32 ``[B]``, KV length of each sequence including this step's tokens.
    block_table: int32 ``[B, max_blocks_per_seq]``, physical blocks of each sequence; the width
        is the most blocks any sequence of this batch needs, shorter rows are padded with 0.
    slot_mapping: int64 ``[T]``, cache slot each new token's K/V is written to.
    logits_indices: int64 ``[B]``, the last row of each sequence (``cu_seqlens_q[1:] - 1``).
    num_tokens / num_seqs: ``T`` / ``B``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    num_tokens: int
    num_seqs: int

    def as_inputs(self) -> dict[str, torch.Tensor]:
        """The seven tensors by name (the graph's metadata inputs)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("num_tokens", "num_seqs")}


def build_batch(
    scheduled: list[ScheduledRequest],
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
) -> BatchMetadata:
    """Metadata for ``scheduled`` (in order): request ``r`` contributes the tokens
    ``all_token_ids[c : c + n]`` at positions ``c ..``, where ``c = num_computed_tokens`` and
    ``n = num_new_tokens``; its K/V go to slot ``block_ids[pos // block_size] * block_size +
    pos % block_size``.

    Built on the CPU, checked with ``check_paged_metadata`` (``ValueError`` naming the bad
    field, e.g. ``block_table`` when a request's ``block_ids`` do not cover its tokens), then
    moved to ``device``.
    """
    requests = [s.request for s in scheduled]
    num_seqs = len(scheduled)
    q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_seqs)
    seq_lens = starts + q_lens
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])

    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - cu_seqlens_q[:-1][seq_of_token] + starts[seq_of_token]
    input_ids = np.fromiter(
        itertools.chain.from_iterable(
            r.all_token_ids[c : c + n] for r, c, n in zip(requests, starts.tolist(), q_lens.tolist())
        ),
        dtype=np.int64,
        count=num_tokens,
    )

    # Missing blocks are -1 while checking, so a request whose block_ids are too short fails
    # check_paged_metadata; afterwards the padding becomes block 0.
    blocks_needed = -(-seq_lens // block_size)
    block_table = np.full((num_seqs, int(blocks_needed.max(initial=0))), -1, dtype=np.int32)
    for b, (request, needed) in enumerate(zip(requests, blocks_needed.tolist())):
        row = request.block_ids[:needed]
        block_table[b, : len(row)] = row
    slot_mapping = (
        block_table[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )

    metadata = BatchMetadata(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        logits_indices=torch.from_numpy(cu_seqlens_q[1:] - 1),
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    check_paged_metadata(
        num_tokens=num_tokens,
        cu_seqlens_q=metadata.cu_seqlens_q,
        seq_lens=metadata.seq_lens,
        block_table=metadata.block_table,
        slot_mapping=metadata.slot_mapping,
        num_blocks=num_blocks,
        block_size=block_size,
    )
    np.maximum(block_table, 0, out=block_table)
    for name, tensor in metadata.as_inputs().items():
        setattr(metadata, name, tensor.to(device))
    return metadata


def example_batch(q_lens: list[int], context_lens: list[int] | None = None, *, block_size: int,
                  num_blocks: int, device: torch.device | str = "cpu") -> BatchMetadata:
    """A valid step for tracing, exporting or checking a step program, built by
    :func:`build_batch`: sequence ``b`` has ``context_lens[b]`` tokens cached (default 0) and
    computes ``q_lens[b]`` new ones (token id 0); blocks are numbered consecutively over the
    sequences, modulo ``num_blocks``."""
    context_lens = context_lens or [0] * len(q_lens)
    scheduled, next_block = [], 0
    for b, (q_len, cached) in enumerate(zip(q_lens, context_lens)):
        request = Request(f"example-{b}", [0] * (cached + q_len), SamplingParams())
        request.num_computed_tokens = cached
        needed = -(-(cached + q_len) // block_size)
        request.block_ids = [(next_block + j) % num_blocks for j in range(needed)]
        next_block += needed
        scheduled.append(ScheduledRequest(request, q_len))
    return build_batch(scheduled, block_size=block_size, num_blocks=num_blocks, device=device)
