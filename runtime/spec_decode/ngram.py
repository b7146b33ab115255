"""The ``ngram`` proposer: prompt lookup decoding (Saxena, 2023), as vLLM's ``NgramProposer``.

The draft for a request is the ``k`` tokens that followed the earliest earlier occurrence of the
longest n-gram ending its tokens, ``prompt_lookup_min <= n <= prompt_lookup_max`` (fewer than ``k``
when that occurrence is near the end; none without an occurrence). It costs the request's length
per step, on the host, and nothing on the model: text that copies spans of its prompt or of
itself (rewrites, code edits, summaries quoting their source) is where it wins.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """At most ``k`` draft tokens to follow ``token_ids`` (the module docstring); ``[]`` if none."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    last = len(tokens) - 1
    if k < 1 or last < min_n:
        return []
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # where an earlier 1-gram equal to the last token ends
    found, n = None, 1
    while ends.size:  # ends: where the suffix n-gram also ends earlier, ascending
        if n >= min_n:
            found = int(ends[0])
        if n == max_n:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[last - n]]
        n += 1
    return [] if found is None else tokens[found + 1:found + 1 + k].tolist()
