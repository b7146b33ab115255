"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the logits rows a step returns besides each
sequence's last, and the log-probabilities taken from them.

The logits at position ``p`` give the log-probability of prompt token ``p + 1``, so a request
asking for prompt logprobs needs the rows of positions ``0 .. P - 2`` of its ``P``-token prompt. A
step returns them for the chunk it computes (chunked prefill: each chunk its own) after the ``B``
last rows, which alone are sampled: ``logits_indices = [last row of each sequence, *prompt rows]``
(:func:`prompt_rows`), so requests not asking cost nothing. Rows already taken are not asked for
again, so a preempted request recomputing its prompt emits nothing twice; a prefix-cache hit may
cover only positions whose rows were taken (``Request.first_missing_prompt_logprob``), since cached positions
are not computed: a new request asking for prompt logprobs takes no hit, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedpack.runtime.sampling_ops import token_logprobs

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request, ScheduledRequest


@dataclass(frozen=True)
class PromptRows:
    """Positions ``positions`` of ``request`` whose logits rows a step returns for its prompt logprobs."""

    request: Request
    positions: range


def prompt_rows(scheduled: list[ScheduledRequest]) -> tuple[list[PromptRows], list[int]]:
    """``(spans, rows)`` of one step: per request still missing prompt logprobs, the positions of its
    chunk that give them (``first missing .. min(chunk end, P - 1)``), and their packed row indices
    (in ``[0, T)``, span after span) to append to ``logits_indices``."""
    spans, rows, offset = [], [], 0
    for s in scheduled:
        first = s.request.first_missing_prompt_logprob
        if first is not None:
            start = s.request.num_computed_tokens
            positions = range(max(start, first), min(start + s.num_new_tokens, s.request.num_prompt_tokens - 1))
            if positions:
                spans.append(PromptRows(s.request, positions))
                rows.extend(range(offset + positions.start - start, offset + positions.stop - start))
        offset += s.num_new_tokens
    return spans, rows


def take_prompt_logprobs(logits: torch.Tensor, spans: list[PromptRows]) -> None:
    """Append to each span's ``request.prompt_logprobs`` the entries of its positions, from
    ``logits`` (float ``[sum of the spans' lengths, V]``, the prompt rows in span order): per
    position ``p``, ``(logprob of prompt token p + 1, its rank, [(token id, logprob)] of the top k)``
    as :func:`~pagedpack.runtime.sampling_ops.token_logprobs` gives them."""
    if not spans:
        return
    tokens = torch.tensor([s.request.prompt_token_ids[p + 1] for s in spans for p in s.positions],
                          dtype=torch.int64, device=logits.device)
    wanted = [s.request.sampling_params.prompt_logprobs for s in spans for _ in s.positions]
    entries = token_logprobs(logits, tokens, wanted)
    at = 0
    for s in spans:
        if s.positions.start != len(s.request.prompt_logprobs):
            raise RuntimeError(f"request {s.request.request_id!r}: prompt logprobs from position "
                               f"{s.positions.start}, {len(s.request.prompt_logprobs)} taken")
        s.request.prompt_logprobs.extend(entries[at:at + len(s.positions)])
        at += len(s.positions)
