"""How many draft tokens a request gets, adapted to what it accepted (per request, on the host).

A request starts at ``num_speculative_tokens``. After a step that accepted every draft token it
may get one more (up to that number); after one that accepted ``a`` of more, ``a + 1``. A step that
accepted none also pauses its proposals for ``2**misses - 1`` steps (``misses``: such steps in a row,
the pause at most :data:`MAX_PAUSE`), so text that the proposer cannot predict stops paying for the
rows that verify its drafts, and a request whose text turns predictable is tried again soon.
Its acceptance rate per draft token (:class:`~pagedpack.runtime.spec_decode.cost.Acceptance`) is
counted too, for the step's cost to weigh its drafts against (:mod:`.cost`).
"""
from __future__ import annotations

from pagedpack.runtime.spec_decode.cost import Acceptance

MAX_PAUSE = 15


class Lookahead:
    """One request's draft length (the module docstring)."""

    def __init__(self, num_speculative_tokens: int, prior_rate: float):
        self.maximum = self.length = num_speculative_tokens
        self.acceptance = Acceptance(prior_rate)
        self.misses = 0
        self.pause = 0

    def next_length(self) -> int:
        """The draft length of the request's next proposal (0 while paused; a call counts one step)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.length

    def update(self, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` >= 1 draft tokens and accepted the first ``accepted`` of them."""
        self.length = min(self.maximum, self.length + 1) if accepted == drafted else accepted + 1
        self.misses = 0 if accepted else self.misses + 1
        self.pause = min(2 ** self.misses - 1, MAX_PAUSE)
        self.acceptance.update(drafted, accepted)
