"""What changes a step's logits before temperature and sampling, batched over the requests
(vLLM v1's logits processors and penalties, with their semantics):

- ``logit_bias``: the bias added to each named token's logit;
- ``min_tokens``: while a request has fewer output tokens, its EOS (unless ``ignore_eos``) and
  ``stop_token_ids`` get ``-inf``;
- ``repetition_penalty`` ``r`` (over prompt and output tokens): a seen token's logit ``l`` becomes
  ``l / r`` if positive, ``l * r`` otherwise;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (over output tokens): ``l - f * count - p``
  for a token the output holds ``count >= 1`` times.

Each is one tensor operation over the rows that use it (token counts by ``scatter_add`` over the
padded token lists), never a Python loop over the vocabulary.
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


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float32: how often each token id occurs in each list."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)  # column ``vocab``: padding
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
        for i, tokens in enumerate(token_lists):
            padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64).clamp(max=vocab)
        counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _penalise(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    vocab, device = logits.shape[-1], logits.device
    params = [r.sampling_params for r in requests]
    output = _token_counts([r.output_token_ids for r in requests], vocab, device)
    prompt = _token_counts([r.prompt_token_ids for r in requests], vocab, device)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    seen = (output > 0) | (prompt > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - frequency * output - presence * (output > 0)
