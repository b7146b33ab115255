"""The sampler's tensor work, batched over rows: min-p, top-k / top-p candidates, the draw, logprobs.

Semantics (vLLM's, made exact where vLLM's kernels leave them open): tokens are ranked by their
logits, ties by token id; top-k keeps the ``k`` first of that ranking; top-p then keeps the
smallest leading set whose probability (over the top-k survivors, at the temperature, after
min-p) reaches ``top_p``; the most likely token is always kept. A row's probabilities are
``exp((logit - max) / temperature)`` normalised: the largest term is 1, so no finite temperature
overflows and a masked (``-inf``) token has probability 0.

What it costs (the vocabulary ``V`` is 32k-262k, most of a step's rows set neither top-k nor
top-p): a row without top-k / top-p is never sorted: its softmax is one pass, and the draw reads it
once more (:func:`inverse_cdf`); a greedy row's argmax is :func:`first_max`. Top-k and top-p rows
take ``torch.topk`` candidates (``k``, or a guess for top-p alone that grows until it holds the
nucleus) and sort only those.
The draw is inverse-CDF sampling with one uniform number per row, from the request's own
generator when it has a seed: exact for the distribution, and a seeded row draws the same token
whatever shares its batch.
"""
from __future__ import annotations

import math

import torch

TOP_P_GUESS = 64  # candidates tried first for a top-p row without top-k (grown 8x while short)
_BLOCK = 1024  # inverse_cdf's block: a block is picked from the block sums, then a token in it


def apply_min_p(logits: torch.Tensor, min_p: list[float], temperature: torch.Tensor) -> torch.Tensor:
    """Mask (to ``-inf``) each row's tokens whose probability at ``temperature`` is below ``min_p``
    times the row's largest: ``(logit - max) / temperature < log(min_p)``, in float64.
    ``logits`` float ``[N, V]``; ``temperature`` ``[N]`` (> 0)."""
    if not any(min_p):
        return logits
    log_min_p = torch.tensor(min_p, dtype=torch.float64, device=logits.device).log()
    scaled = (logits.double() - logits.double().amax(dim=-1, keepdim=True)) / temperature.double()[:, None]
    return logits.masked_fill(scaled < log_min_p[:, None], -math.inf)


def top_k_top_p_candidates(logits: torch.Tensor, row_max: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_ids, weights, num_kept)``: each row's top-k / top-p survivors in rank order
    (``[N, C]``, the first ``num_kept[i]`` of row ``i``) and their unnormalised probabilities
    (float32, 0 past the cut: ``exp((logit - max) / temperature)`` with a top-k, else the softmax's).

    logits: float32 ``[N, V]``; row_max: ``[N]`` its rows' maxima (finite); top_k: int64 ``[N]``
    (``<= 0`` or ``>= V``: none); top_p: float64 ``[N]`` in ``(0, 1]``; temperature: float64 ``[N]`` (> 0).
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    has_k = k < vocab
    width = max(int(k[has_k].max()) if bool(has_k.any()) else 0, 0 if bool(has_k.all()) else TOP_P_GUESS)
    # top-p's mass: over the top-k survivors (all among the candidates), else over the whole row (its
    # softmax, one pass, read at the candidates)
    whole = None if bool(has_k.all()) else probabilities(logits, row_max, temperature)
    while True:
        width = min(width, vocab)
        ids, values, outside = _ranked(logits, width)
        rank = torch.arange(width, device=logits.device)[None, :]
        weights = token_weights(values, row_max, temperature)
        if whole is not None:
            weights = torch.where(has_k[:, None], weights, whole.gather(-1, ids))
        weights.masked_fill_(rank >= k[:, None], 0)
        total = torch.where(has_k, weights.sum(-1, dtype=torch.float64), 1.0)
        probs = weights.double() / total[:, None]
        mass_before = probs.cumsum(-1) - probs
        kept = (rank < k[:, None]) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1) | (rank == 0))
        num_kept = kept.sum(-1)
        # the nucleus may reach past the candidates: a row that keeps them all, short of its top_p
        # (without a top-k), needs more
        short = ~has_k & (num_kept == width) & (mass_before[:, -1] + probs[:, -1] < top_p)
        if width == vocab or not bool(short.any()):
            break
        width *= 8
    return _exact_ties(logits, ids, values, outside, num_kept), weights.masked_fill_(~kept, 0), num_kept


def _ranked(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(ids, values, outside)``: each row's ``width`` largest logits ``[N, width]`` ranked by value,
    ties by id (``torch.topk`` orders ties as it likes: re-sorted by id, then stably by value), and
    the largest value left out ``[N]`` (None when ``width`` is the whole row)."""
    vocab = logits.shape[-1]
    values, ids = logits.topk(min(width + 1, vocab), dim=-1)
    outside = values[:, width] if width < vocab else None
    ids, order = ids[:, :width].sort(dim=-1)
    values, order = values[:, :width].gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), values, outside


def token_weights(values: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``exp((values - row_max) / temperature)``, float32 ``[N, C]`` (1 at the maximum; a temperature
    past float32's range divides as its largest value, which already makes every weight 1)."""
    scale = temperature.clamp(max=torch.finfo(torch.float32).max).float()[:, None]
    return ((values - row_max[:, None]) / scale).exp_()


def _exact_ties(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, outside: torch.Tensor | None,
                num_kept: torch.Tensor) -> torch.Tensor:
    """``ids`` with each row's kept tokens exactly the ranking's first: where the value at a row's
    cut equals the largest left out of the candidates, a token outside may share it with a lower
    id; such a row takes the lowest ids of that value (one pass over the row; rare but for
    low-precision logits)."""
    if outside is None:
        return ids
    rows = torch.arange(len(ids), device=ids.device)
    at_cut = values[rows, (num_kept - 1).clamp(min=0)]
    tied_rows = ((at_cut == outside) & (num_kept > 0)).nonzero().squeeze(-1).tolist()
    if tied_rows:
        ids = ids.clone()
    for row in tied_rows:
        m, value = int(num_kept[row]), at_cut[row]
        above = int((values[row, :m] > value).sum())
        ids[row, above:m] = (logits[row] == value).nonzero().squeeze(-1)[:m - above]
    return ids


def first_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` ``[N]``: each row's maximum and the lowest index holding it, as
    ``torch.max(dim=-1)`` gives them (NaN where a row has one) in a fifth of its time: the maxima of
    ``_BLOCK``-wide blocks (vectorised), then an index search inside the first block holding the
    row's maximum. ``logits`` float32 ``[N, V]``."""
    values, block = _blockwise(logits, torch.amax).max(dim=-1)
    inside, _ = _block_of(logits, block)
    return values, block * _BLOCK + (inside == values[:, None]).to(torch.uint8).argmax(dim=-1)


def _blockwise(x: torch.Tensor, reduce) -> torch.Tensor:
    """``[N, ceil(V / _BLOCK)]``: ``reduce(block, dim=-1)`` of each ``_BLOCK``-wide block of each row
    of ``x`` ``[N, V]`` (the last block may be shorter), without copying ``x``."""
    num_rows, vocab = x.shape
    whole = vocab // _BLOCK * _BLOCK
    parts = [reduce(x[:, :whole].reshape(num_rows, -1, _BLOCK), dim=-1)] if whole else []
    if whole < vocab:
        parts.append(reduce(x[:, whole:], dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _block_of(x: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, valid)`` ``[N, _BLOCK]``: each row's block ``block[i]`` of ``x``, and which of its
    places are in the row (a last, shorter block repeats the row's last value past its end)."""
    places = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=x.device)
    valid = places < x.shape[-1]
    return x.gather(-1, places.clamp_(max=x.shape[-1] - 1)), valid


def probabilities(logits: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, V]``: ``softmax(logits / temperature)`` of each row, computed as the softmax of
    ``(logits - row_max) / temperature`` (no finite temperature overflows it) unless every
    temperature is 1. ``row_max`` ``[N]`` finite, ``temperature`` float64 ``[N]`` (> 0)."""
    if bool((temperature == 1).all()):
        return logits.softmax(dim=-1)
    scale = temperature.clamp(max=torch.finfo(torch.float32).max).reciprocal().float()[:, None]
    return logits.sub(row_max[:, None]).mul_(scale).softmax(dim=-1)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: per row the index ``i`` with ``cdf[i - 1] <= u * total < cdf[i]`` over the
    non-negative float32 ``weights`` ``[N, V]`` (each row with a positive sum), ``u`` the float64
    ``uniform`` ``[N]`` in ``[0, 1)``: a draw from ``weights / total``. Cumulative sums in float64; a block of
    ``_BLOCK`` weights is chosen from the block sums, then a token inside it, so the work past the
    weights is ``O(V / _BLOCK + _BLOCK)`` a row. A token of weight 0 is never drawn."""
    block_sums = _blockwise(weights, torch.sum).double()  # float32 sums: rounding moves ~1e-7 of a block's mass
    block_cdf = block_sums.cumsum(-1)
    target = uniform * block_cdf[:, -1]
    block = _search(block_cdf, target)
    rows = torch.arange(len(weights), device=weights.device)
    offset = target - (block_cdf[rows, block] - block_sums[rows, block])
    inside, valid = _block_of(weights, block)
    return block * _BLOCK + _search(inside.masked_fill_(~valid, 0).cumsum(-1, dtype=torch.float64), offset)


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose ``cdf`` exceeds ``target``, at most the last index that adds
    mass (rounding can put ``target`` at or past the total)."""
    found = torch.searchsorted(cdf, target[:, None], right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(found, last).squeeze(-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token outside each row's top-k and then top-p set masked to ``-inf``
    (probabilities at temperature 1), in ``logits``' dtype: the sampler's selection as vLLM's
    function of this name returns it. top_k: int64 ``[N]`` (``<= 0`` disables); top_p: ``[N]``."""
    x = logits.float()
    ids, _, num_kept = top_k_top_p_candidates(x, x.amax(-1), top_k, top_p.double(),
                                              torch.ones(len(x), dtype=torch.float64, device=x.device))
    kept = torch.arange(ids.shape[-1], device=x.device)[None, :] < num_kept[:, None]
    rows = torch.arange(len(x), device=x.device)[:, None].expand_as(ids)
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device).index_put_((rows[kept], ids[kept]),
                                                                             torch.tensor(True))
    return logits.masked_fill(~keep, -math.inf)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]) -> list:
    """Per row with ``wanted[i]`` not None: ``(logprob of tokens[i], its rank (1 = most likely),
    [(token id, logprob)] of the top ``wanted[i]``)``, from ``log_softmax`` of ``logits`` in float32."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    out = [None] * len(wanted)
    if not rows:
        return out
    logprobs = logits[rows].float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[rows, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(max(wanted[i] for i in rows), dim=-1)
    for j, i in enumerate(rows):
        k = wanted[i]
        top_k = list(zip(top.indices[j, :k].tolist(), top.values[j, :k].tolist()))
        out[i] = (float(chosen[j, 0]), int(ranks[j]), top_k)
    return out
