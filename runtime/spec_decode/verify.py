"""One step's sampling, position by position: how a speculative step keeps the target model's
distribution exactly.

A request that brought ``k`` draft tokens has ``k + 1`` logits rows: row ``j`` scores the token after
its known tokens and drafts ``0 .. j-1``. Position ``j`` is sampled exactly as a step without
speculation would sample it, with the tokens taken at positions ``< j`` already in the output (the
penalties, ``min_tokens``, the grammar and the seeded generator see them: one draw per position,
as one per step). If the token drawn is draft ``j``, the draft is accepted and position ``j + 1``
is sampled; otherwise the drawn token ends the step. This is rejection sampling (Leviathan et al.,
2023; Chen et al., 2023) for a proposer whose draft is one token with certainty (n-gram, suffix):
a draft ``d`` is accepted with probability ``p(d)``, and a rejection's token, drawn from ``p`` but
not ``d``, follows the residual ``max(0, p - q) / (1 - p(d))`` with ``q`` the point mass on ``d``.
So every request gets the distribution, and a seeded or greedy one the very tokens, that it gets
without speculation (up to the rows' floating-point rounding in a wider step).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedpack.runtime.grammar_bitmask import StepBitmask
    from pagedpack.runtime.request import Request, ScheduledRequest
    from pagedpack.runtime.sampling import SamplerOutput

log = logging.getLogger("pagedpack.engine")


@dataclass
class StepSample:
    """``token_ids``: request id -> the tokens it took this step (its accepted drafts, then the token
    drawn after them); ``failed``: request id -> why it could take none (it fails alone)."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def sample_positions(sample: Callable[[torch.Tensor, list, StepBitmask | None], SamplerOutput],
                     logits: torch.Tensor, requests: list[Request], rows: list[list[int]],
                     drafts: list[list[int]], bitmask: StepBitmask | None,
                     next_bitmask: Callable[[list], StepBitmask | None]) -> StepSample:
    """The tokens of ``requests`` from the step's ``logits`` ``[R, V]`` (the module docstring).

    ``rows[i]``: the logits rows of ``requests[i]``, one per position (``len(drafts[i]) + 1``);
    ``sample(logits [n, V], requests, bitmask)``: the sampler over those rows, failing rows on their
    own (``LLMEngine._sample``); ``bitmask``: position 0's grammar bitmask (None: no constrained row);
    ``next_bitmask(requests)``: a later position's, once their matchers accepted the tokens before it.
    Each token is accepted by its request's grammar here and its logprobs appended to
    ``Request.output_logprobs``.
    """
    result = StepSample()
    taken: list[list[int]] = [[] for _ in requests]
    active, position = list(range(len(requests))), 0
    while active:
        index = [rows[a][position] for a in active]
        with contextlib.ExitStack() as tentative:
            for a in active if position else ():  # position 0 (every plain step's only one): nothing taken yet
                tentative.enter_context(requests[a].tentative_outputs(taken[a]))
            out = sample(logits if index == list(range(logits.shape[0])) else logits[index],
                         [requests[a] for a in active], bitmask)
        going_on = []
        for row, a in enumerate(active):
            request = requests[a]
            if row in out.errors:
                result.failed[request.request_id] = out.errors[row]
                continue
            token = out.token_ids[row]
            if request.grammar is not None and not request.grammar.accept_token(token):  # masked: cannot happen
                result.failed[request.request_id] = (f"structured_outputs: request {request.request_id!r} sampled "
                                                     f"token {token}, which its grammar does not accept")
                log.error("%s", result.failed[request.request_id])
                continue
            taken[a].append(token)
            if out.logprobs[row] is not None:
                request.output_logprobs.append(out.logprobs[row])
            if position < len(drafts[a]) and token == drafts[a][position] and not request.stops_on(token):
                going_on.append(a)
        active, position = going_on, position + 1
        bitmask = next_bitmask([requests[a] for a in active]) if active else None
    for request, tokens in zip(requests, taken):
        if request.request_id not in result.failed:
            result.token_ids[request.request_id] = tokens
    return result


def spec_rows(scheduled: list[ScheduledRequest], first: int) -> tuple[dict[int, list[int]], list[int]]:
    """``(draft_rows, packed_rows)`` of a step whose extra logits rows start at row ``first``: per index
    of a scheduled request with drafts, the logits rows of its positions before the last (which is its
    sequence's own last row), and the packed rows (in ``[0, T)``) to append to ``logits_indices``."""
    draft_rows, packed, offset = {}, [], 0
    for i, s in enumerate(scheduled):
        offset += s.num_new_tokens
        if s.spec_token_ids:
            k = len(s.spec_token_ids)
            draft_rows[i] = list(range(first + len(packed), first + len(packed) + k))
            packed.extend(range(offset - k - 1, offset - 1))
    return draft_rows, packed
