"""What changes a step's logits before temperature and sampling, batched over the requests
(vLLM v1's logits processors and penalties, with their semantics):

- ``logit_bias``: the bias added to each named token's logit;
- ``min_tokens``: while a request has fewer output tokens, its EOS (unless ``ignore_eos``) and
  ``stop_token_ids`` get ``-inf``;
- ``repetition_penalty`` ``r`` (over prompt and output tokens): a seen token's logit ``l`` becomes
  ``l / r`` if positive, ``l * r`` otherwise;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (over output tokens): ``l - f * count - p``
  for a token the output holds ``count >= 1`` times.

Each is one tensor operation over the rows that use it, never a loop over the vocabulary: the
penalties touch only each request's distinct seen tokens (``unique`` over ``(row, token)`` keys), so
a row costs what its prompt and output hold, not the vocabulary's size.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` ``[N, V]`` (row ``i``: ``requests[i]``) with every request's bias, ``min_tokens``
    mask and penalties applied: a float32 copy, or ``logits`` itself when no request has any."""
    params = [r.sampling_params for r in requests]
    if not any(p.processes_logits for p in params):
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    rows, cols, values = [], [], []
    for i, (request, p) in enumerate(zip(requests, params)):
        rows += [i] * len(p.logit_bias)
        cols += list(p.logit_bias)
        values += list(p.logit_bias.values())
        if request.num_output_tokens < p.min_tokens:
            eos = [] if p.ignore_eos or request.eos_token_id is None else [request.eos_token_id]
            stops = [*p.stop_token_ids, *eos]
            rows += [i] * len(stops)
            cols += stops
            values += [-math.inf] * len(stops)
    inside = [(r, c, v) for r, c, v in zip(rows, cols, values) if c < vocab]  # ids past the logits: no such token
    if inside:
        r, c, v = zip(*inside)
        index = (torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device))
        logits.index_put_(index, torch.tensor(v, dtype=logits.dtype, device=logits.device), accumulate=True)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        logits[penalised] = _penalise(logits[penalised], [requests[i] for i in penalised])
    return logits


def _penalise(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The penalties of ``requests`` on their rows of ``logits`` (float32 ``[n, V]``, changed in place),
    touching only the tokens each request has seen: ``O(prompt + output tokens)``, not ``O(V)``."""
    vocab, device = logits.shape[-1], logits.device
    params = [r.sampling_params for r in requests]
    seen_rows, seen_cols = _pairs([[*r.prompt_token_ids, *r.output_token_ids] for r in requests], vocab, device)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[seen_rows]
    values = logits[seen_rows, seen_cols]
    logits[seen_rows, seen_cols] = torch.where(values > 0, values / repetition, values * repetition)
    out_rows, out_cols, counts = _pairs([r.output_token_ids for r in requests], vocab, device, counts=True)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[out_rows]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[out_rows]
    logits[out_rows, out_cols] -= frequency * counts + presence
    return logits


def _pairs(token_lists: list[list[int]], vocab: int, device, *, counts: bool = False):
    """``(rows, cols[, counts])``: each distinct ``(i, token)`` of ``token_lists[i]`` with ``token <
    vocab`` once (and how often it occurs), as int64 (float32 counts) tensors on ``device``."""
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64)
    keys = (rows * vocab + tokens)[tokens < vocab].unique(return_counts=counts)
    keys, found = keys if counts else (keys, None)
    rows, cols = (keys // vocab).to(device), (keys % vocab).to(device)
    return (rows, cols, found.to(device=device, dtype=torch.float32)) if counts else (rows, cols)
