"""A draft model's proposals: a second, smaller model's greedy tokens, run by the same engine on a
paged KV cache of its own that shares the target's block ids.

The draft's cache has the target's ``num_blocks`` blocks of ``block_size`` tokens (the same block
table and slots address both) plus ``ceil(num_speculative_tokens / block_size)`` scratch blocks per
sequence a proposal may hold (``max_num_seqs``). Two things write it:

- :meth:`DraftModel.follow`: every step the target runs (prompt chunks, decodes, verifications), the
  draft runs too, on the same metadata, so wherever the target's cache holds a position's K/V the
  draft's holds its own for the same token; prefix-cache hits, preemption and the roll-back of rejected
  drafts therefore need nothing of it. A position written with a draft token that is rejected is
  written again with the right token by the step that computes it;
- :meth:`DraftModel.propose`: after a step, ``k`` decode passes of the drafting requests (round ``j``
  feeds the last known token, then the draft's own greedy tokens, at positions ``n - 1 ..
  n + k - 2``), whose K/V go to the request's own blocks where it holds them, else its scratch blocks.

A draft's tokens need not be right: verification keeps or rejects each against the target's
distribution (:mod:`.verify`), so the draft model changes how many tokens a step takes, never which.
As vLLM's ``draft_model`` method, the draft proposes greedily (a point mass, what
:func:`~.verify.sample_positions` verifies exactly for sampled requests too).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pagedpack.runtime.model_runner import ModelRunner
from pagedpack.step.metadata import StepMetadata, paged_metadata

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request


class DraftModel:
    """The draft ``program`` (a :class:`~pagedpack.step.contract.StepProgram`) and its KV cache: the
    target's ``num_blocks`` blocks of ``block_size`` tokens plus ``scratch_per_seq`` blocks for each of
    ``max_num_seqs`` proposals (``SpeculativeConfig.scratch_blocks_per_seq``; the module docstring), on
    ``device``, stepped with ``cpu_threads``. A request gets no draft token past the draft's
    ``max_positions`` (None: no limit), as vLLM stops drafting past the draft model's length."""

    def __init__(self, program, *, num_blocks: int, block_size: int, max_num_seqs: int, scratch_per_seq: int, device,
                 cpu_threads=None, max_positions: int | None = None):
        self.num_blocks, self.block_size, self.max_positions = num_blocks, block_size, max_positions
        self.scratch_per_seq = scratch_per_seq
        self.runner = ModelRunner(program, num_blocks=num_blocks + max_num_seqs * self.scratch_per_seq,
                                  block_size=block_size, device=device, cpu_threads=cpu_threads)

    def follow(self, batch: StepMetadata) -> None:
        """Run the target's step ``batch`` (its metadata, on the target's blocks) through the draft.
        Positions past the draft's ``max_positions`` are clamped to its last: their K/V is never read
        by a proposal (none is made there), and a model of learned positions could not embed them."""
        if self.max_positions is not None:
            batch = batch._replace(positions=batch.positions.clamp(max=self.max_positions - 1))
        self.runner.execute(batch)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The target copied these blocks (copy-on-write): so does the draft's cache."""
        self.runner.copy_blocks(pairs)

    def propose(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        """The draft's greedy continuation of each of ``requests`` (each decoding: its K/V computed up to
        its last token), ``lengths[i] >= 1`` tokens for request ``i`` (fewer near ``max_positions``); at most
        ``max_num_seqs`` requests."""
        if self.max_positions is not None:  # the draft's token at position p is fed at p - 1
            lengths = [max(0, min(n, self.max_positions + 1 - r.num_tokens)) for r, n in zip(requests, lengths)]
        rows = [self._blocks(i, r, length) for i, (r, length) in enumerate(zip(requests, lengths))]
        starts = [r.num_tokens - 1 for r in requests]
        tokens = [r.all_token_ids[-1] for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, n in enumerate(lengths) if n]
        for j in range(max(lengths, default=0)):
            batch = paged_metadata([1] * len(active), [starts[i] + j for i in active], [rows[i] for i in active],
                                   block_size=self.block_size, input_ids=np.array([tokens[i] for i in active]))
            next_tokens = self.runner.execute(batch.to(self.runner.device)).argmax(-1).tolist()
            for i, token in zip(active, next_tokens):
                drafts[i].append(token)
                tokens[i] = token
            active = [i for i in active if len(drafts[i]) < lengths[i]]
        return drafts

    def _blocks(self, index: int, request: Request, length: int) -> list[int]:
        """``request``'s block ids for positions up to ``num_tokens - 2 + length``: its own, then its scratch."""
        needed = math.ceil((request.num_tokens - 1 + length) / self.block_size)
        own = list(request.block_ids[:needed])
        scratch = self.num_blocks + index * self.scratch_per_seq
        return own + list(range(scratch, scratch + needed - len(own)))


def check_draft(target_description, draft_description) -> None:
    """``ValueError`` naming ``speculative_config.model`` for a draft whose token ids are not the
    target's (another vocabulary size)."""
    if draft_description.vocab_size != target_description.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's token ids must be the target's; expected a "
                         f"vocabulary of {target_description.vocab_size} tokens, got {draft_description.vocab_size}")
