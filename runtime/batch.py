"""The step metadata of the scheduler's requests: :func:`pagedpack.step.metadata.paged_metadata` fed
from ``ScheduledRequest``s, its block table checked with ``kernels.validation``."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from pagedpack.kernels.validation import check_block_table
from pagedpack.runtime.scheduler import ScheduledRequest
from pagedpack.step.metadata import StepMetadata, paged_metadata


def build_batch(
    scheduled: list[ScheduledRequest],
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str = "cpu",
    extra_logits_rows: list[int] | None = None,
) -> StepMetadata:
    """Metadata for ``scheduled`` (in order): request ``r`` contributes the ``n = num_new_tokens`` tokens
    ``ScheduledRequest.token_ids`` (``all_token_ids[c : c + n]``, where ``c = num_computed_tokens``, its
    draft tokens last under speculative decoding) at positions ``c ..``; its K/V go to slot
    ``block_ids[pos // block_size] * block_size + pos % block_size``.

    ``logits_indices``: each sequence's last row, then ``extra_logits_rows`` (packed rows in
    ``[0, T)``: the prompt rows of :func:`pagedpack.runtime.prompt_logprobs.prompt_rows`, the rows
    verifying draft tokens).

    Built on the CPU, checked with ``check_block_table`` (``ValueError`` naming ``block_table`` when a
    request's ``block_ids`` do not cover its tokens or name a block outside the pool), then moved to
    ``device``. The other fields hold by construction: ``ScheduledRequest`` keeps every chunk within
    ``1 ..`` the tokens left, so ``cu_seqlens_q`` rises and ``seq_lens`` covers the chunk, and each
    slot is an in-pool block's row. Padding of the block table is block 0.
    """
    requests = [s.request for s in scheduled]
    q_lens = [s.num_new_tokens for s in scheduled]
    starts = [r.num_computed_tokens for r in requests]
    input_ids = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in scheduled),
        dtype=np.int64, count=sum(q_lens))
    # Missing blocks are -1 while checking, so a request whose block_ids are too short fails the check.
    metadata = paged_metadata(q_lens, starts, [r.block_ids for r in requests], block_size=block_size,
                              input_ids=input_ids, pad_block=-1)
    check_block_table(metadata.block_table, metadata.seq_lens, num_blocks, block_size)
    metadata.block_table.clamp_(min=0)
    if extra_logits_rows:
        extra = torch.tensor(extra_logits_rows, dtype=torch.int64)
        metadata = metadata._replace(logits_indices=torch.cat([metadata.logits_indices, extra]))
    return metadata.to(device)
