"""Sampling parameters and the sampler that turns one step's logits into next tokens.

Semantics follow vLLM: ``temperature == 0`` is greedy (argmax), otherwise the probabilities are
the softmax of ``logits / temperature``, restricted by min-p, top-k and then top-p (nucleus), and a
token is drawn (:mod:`pagedpack.runtime.sampling_ops`: exact ties, what each row costs). A
request with a ``seed`` draws from its own ``torch.Generator`` so its tokens do not depend on
which other requests share the batch. A request whose logits leave no token to draw fails alone
(``SamplerOutput.errors``); the step's other rows take their tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedpack.runtime.logits_processors import process_logits
from pagedpack.runtime.sampling_ops import (
    apply_min_p,
    first_max,
    inverse_cdf,
    probabilities,
    token_logprobs,
    top_k_top_p_candidates,
)
from pagedpack.runtime.sampling_params import (  # noqa: F401  (re-exported: pagedpack.runtime.sampling's names)
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    normalize_sampling_params,
)

if TYPE_CHECKING:
    from pagedpack.runtime.grammar_bitmask import StepBitmask
    from pagedpack.runtime.request import Request

@dataclass
class SamplerOutput:
    """One step's sample: ``token_ids`` (one per row) and, per row, None or the sampled token's
    ``(logprob, rank)`` with the top-``logprobs`` ``[(token id, logprob), ...]`` (``logprobs``);
    ``errors``: the rows that could take no token (row -> why; their ``token_ids`` entry is meaningless)."""

    token_ids: list[int]
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    """``Sampler()(logits [N, V], requests) -> list[int]``: one next token per row
    (:meth:`sample` also returns log-probabilities and the rows that failed).

    Row ``i`` of ``logits`` (any float dtype) belongs to ``requests[i]``. Penalties, bias and
    ``min_tokens`` (:mod:`pagedpack.runtime.logits_processors`) apply first, then the grammar
    bitmask of the constrained rows (``grammar``: a :class:`~pagedpack.runtime.grammar_bitmask.StepBitmask`,
    None when no row is constrained; the same as vLLM's mask-first order, as ``-inf`` stays ``-inf``
    under bias and penalties); a row whose maximum
    is then not finite (NaN, ``+inf``, or every token masked) fails alone, named in
    ``SamplerOutput.errors``. Greedy rows take the argmax (the lowest id among tied maxima); the
    others are drawn as :mod:`pagedpack.runtime.sampling_ops` describes. Seeded requests draw from
    ``request.generator`` (created on first use, on the logits' device), the others from torch's
    global generator.
    """

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        return self.sample(logits, requests).token_ids

    def sample(self, logits: torch.Tensor, requests: list[Request],
               grammar: StepBitmask | None = None) -> SamplerOutput:
        """``logits`` ``[N, V]``: its constrained rows may be masked in place (unless a request
        asks for logprobs, which stay the raw logits')."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits: expected shape [{len(requests)}, vocab] (one row per request), "
                f"got {tuple(logits.shape)}"
            )
        raw = logits
        # fp32 (exact from bf16 / fp16, the same first-max index): ATen's CPU max over bf16 rows took 3x the
        # conversion plus fp32's (1.12 vs 0.35 ms for 12 x 49,152)
        logits = process_logits(logits, requests).float()
        if grammar is not None:
            if logits is raw and any(requests[i].sampling_params.logprobs is not None for i in grammar.rows):
                logits = logits.clone()
            grammar.apply(logits)
        row_max, tokens = first_max(logits)
        errors = {} if bool(torch.isfinite(row_max).all()) else {
            i: _no_token(requests[i], float(row_max[i])) for i in (~torch.isfinite(row_max)).nonzero()[:, 0].tolist()}
        params = [r.sampling_params for r in requests]
        rows = [i for i, p in enumerate(params) if not p.is_greedy and i not in errors]
        if rows:
            whole = len(rows) == len(requests)
            tokens[rows] = _draw(logits if whole else logits[rows], row_max if whole else row_max[rows],
                                 [requests[i] for i in rows])
        wanted = [None if i in errors else p.logprobs for i, p in enumerate(params)]
        return SamplerOutput(tokens.tolist(), token_logprobs(raw, tokens, wanted), errors)


def _draw(logits: torch.Tensor, row_max: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One token per row of ``logits`` (float32 ``[n, V]``, ``row_max`` its rows' finite maxima):
    min-p, then top-k / top-p candidates where a row has them, then the inverse-CDF draw."""
    params = [r.sampling_params for r in requests]
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    logits = apply_min_p(logits, [p.min_p for p in params], temperature)
    uniform = _uniforms(requests, device)
    narrowed = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if not narrowed:
        return inverse_cdf(probabilities(logits, row_max, temperature), uniform)
    drawn = torch.empty(len(requests), dtype=torch.int64, device=device)
    full = [j for j in range(len(requests)) if j not in set(narrowed)]
    if full:
        drawn[full] = inverse_cdf(probabilities(logits[full], row_max[full], temperature[full]), uniform[full])
    top_k = torch.tensor([params[j].top_k for j in narrowed], dtype=torch.int64, device=device)
    top_p = torch.tensor([params[j].top_p for j in narrowed], dtype=torch.float64, device=device)
    whole = len(narrowed) == len(requests)
    ids, weights, _ = top_k_top_p_candidates(logits if whole else logits[narrowed],
                                             row_max if whole else row_max[narrowed], top_k, top_p,
                                             temperature if whole else temperature[narrowed])
    drawn[narrowed] = ids.gather(-1, inverse_cdf(weights, uniform[narrowed])[:, None])[:, 0]
    return drawn


def _uniforms(requests: list[Request], device) -> torch.Tensor:
    """float64 ``[n]`` in ``[0, 1)``: one number per request, a seeded one's from its own generator."""
    uniform = torch.rand(len(requests), dtype=torch.float64, device=device)
    for j, request in enumerate(requests):
        seed = request.sampling_params.seed
        if seed is not None:
            if request.generator is None:
                request.generator = torch.Generator(device=device).manual_seed(seed)
            uniform[j] = torch.rand(1, dtype=torch.float64, device=device, generator=request.generator)[0]
    return uniform


def _no_token(request: Request, row_max: float) -> str:
    """Why ``request``'s row can take no token (its logits' maximum ``row_max`` is not finite)."""
    p = request.sampling_params
    if row_max == -math.inf and p.structured_outputs is not None:
        why = (f"its structured_outputs grammar allows no token but EOS, and min_tokens={p.min_tokens} bans EOS until "
               "then" if request.num_output_tokens < p.min_tokens else "its structured_outputs grammar and logit_bias "
               "leave every token masked")
    elif row_max == -math.inf:
        why = (f"every token is masked: until min_tokens={p.min_tokens} its stop_token_ids and EOS are banned, "
               "and they cover the vocabulary") if p.min_tokens else "every logit is -inf"
    else:
        why = f"the largest of its logits is {row_max} after the model, logit_bias and penalties"
    return f"sampling: request {request.request_id!r} can take no token ({why})"
