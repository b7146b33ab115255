"""One step's grammar token bitmask: filled in a worker thread while the step's model call runs,
applied by the sampler to the constrained rows only.

``LLMEngine._step`` calls :meth:`GrammarBitmasks.start` with the requests that will take a token
(in the sampler's row order) before it runs the model; a step with no constrained request gets
None (no bitmask, no thread). The sampler calls :meth:`StepBitmask.apply`, which waits for the fill
and sets every token the grammar forbids to ``-inf`` on those rows, in place (xgrammar's CPU kernel,
``apply_token_bitmask_inplace``). xgrammar's ``fill_next_token_bitmask`` holds the GIL while it
runs (measured: a Python thread makes no progress during it); the model's ops release it, so the
fill overlaps the forward all the same.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request


class StepBitmask:
    """The token bitmask of one step's sampled rows: ``bitmask`` int32 ``[N, ceil(V / 32)]`` (row
    ``i``: the ``i``-th row the sampler takes; bit ``t % 32`` of word ``t // 32`` set: token ``t``
    allowed), filled on ``rows`` only (the constrained ones) once ``future`` is done."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int], future: Future | None):
        self.bitmask, self.rows, self._future = bitmask, rows, future

    def wait(self) -> torch.Tensor:
        """The filled bitmask (raises what the fill raised)."""
        if self._future is not None:
            self._future.result()
            self._future = None
        return self.bitmask

    def select(self, positions: list[int]) -> StepBitmask | None:
        """The bitmask of the rows ``positions`` (in this order); None if none of them is constrained
        (then nothing waits for the fill)."""
        if positions == list(range(self.bitmask.shape[0])):
            return self
        constrained = set(self.rows)
        rows = [j for j, p in enumerate(positions) if p in constrained]
        return StepBitmask(self.wait()[positions], rows, None) if rows else None

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar forbids to ``-inf`` on the constrained rows of
        ``logits`` (float ``[N, V]``, CPU), in place. Logits wider than the bitmask's ``32 * W``
        tokens cannot occur: the bitmask is as wide as the model's logits."""
        xgr.apply_token_bitmask_inplace(logits, self.wait(), indices=self.rows)


class GrammarBitmasks:
    """Fills steps' bitmasks for a model whose logits are ``vocab_size`` wide, in one worker thread
    (started on the first fill)."""

    def __init__(self, vocab_size: int):
        self.words = math.ceil(vocab_size / 32)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pagedpack-grammar")
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def start(self, requests: list[Request]) -> StepBitmask | None:
        """Start filling the bitmask of ``requests`` (one row each, the sampler's order) for the rows
        whose request has a grammar (``Request.grammar``); None if none has. The matchers must not
        accept tokens until the bitmask is waited for."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        bitmask = torch.empty((len(requests), self.words), dtype=torch.int32)
        future = self._worker.submit(self._batch.batch_fill_next_token_bitmask,
                                     [requests[i].grammar for i in rows], bitmask, rows)
        return StepBitmask(bitmask, rows, future)
