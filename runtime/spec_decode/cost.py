"""Which draft tokens are worth their verification rows: a step's measured cost against each draft's
chance of being accepted (on the host, after each step).

A verification row is not free. Where a step's time grows with its rows (a CPU's GEMMs are
compute-bound from a few rows: SmolLM2-135M in bf16 on 2 AVX2 cores from about 6, so 8 decoding
streams already fill them), a draft that is likely rejected costs more time than it is expected to
save. The engine measures its decode steps (:class:`StepCost`: seconds against rows, a least-squares
line refitted as steps come, older steps weighing less) and keeps each draft only if it raises the
expected tokens per second of the next step (:func:`worthwhile_lengths`):

- a step of ``R`` rows takes ``T(R) = t0 + c * R`` seconds;
- request ``i``'s draft token ``j`` (1-based) is kept with probability ``p_i ** j``, its acceptance
  rate per token (:class:`Acceptance`) to the power of the drafts before and including it: it adds
  that many expected tokens and one row;
- from the step without drafts (``B`` rows, ``B`` tokens), draft tokens are added in order of
  expected tokens while each raises tokens per second: ``p_i ** j * T(R) > c * E``, ``E`` the
  expected tokens of what is kept so far. Sorted this way, the first draft that fails ends the
  choice (a greedy ratio maximisation: each kept draft only raises ``E / T``).

This is goodput-driven speculation as SmartSpec (Liu et al., 2024, "Optimizing Speculative Decoding
for Serving Large Language Models Using Goodput") formulates it, with the cost fitted online rather
than profiled. Until the line is known (too few decode steps of different row counts), every draft
is kept, as without this module.
"""
from __future__ import annotations

DECAY = 0.97  # per decode step measured: a step 100 steps back weighs 5 %
MIN_WEIGHT = 24.0  # decode steps (weighted; 47 in a row) before the line is trusted
MIN_ROW_SPREAD = 0.25  # rows**2: the weighted variance of the row counts needed to fit a slope
PRIOR_TOKENS = 2.0  # an Acceptance starts as this many draft tokens at the engine-wide rate


class StepCost:
    """Seconds per step against its rows (``t0 + c * rows``), fitted by exponentially weighted least
    squares over decode steps (:data:`DECAY` per step). :attr:`per_row` is ``c`` in seconds (None
    until :data:`MIN_WEIGHT` steps with a spread of row counts came; the last fit is kept when later
    steps all have the same rows)."""

    def __init__(self):
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.per_row: float | None = None
        self.intercept = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (one per sequence plus its draft tokens) took ``seconds``."""
        self._w = DECAY * self._w + 1.0
        self._x = DECAY * self._x + rows
        self._y = DECAY * self._y + seconds
        self._xx = DECAY * self._xx + rows * rows
        self._xy = DECAY * self._xy + rows * seconds
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if self._w >= MIN_WEIGHT and spread >= MIN_ROW_SPREAD:
            self.per_row = max(0.0, (self._xy / self._w - mean_x * mean_y) / spread)
            self.intercept = max(0.0, mean_y - self.per_row * mean_x)

    def seconds(self, rows: int) -> float:
        """The fitted time of a step of ``rows`` rows (needs :attr:`per_row`)."""
        return self.intercept + self.per_row * rows


class Acceptance:
    """One request's acceptance rate per draft token, counted over its verified drafts (each position
    up to and including the first rejected one), older steps weighing less (:data:`DECAY` per step),
    starting from :data:`PRIOR_TOKENS` tokens at a prior rate."""

    def __init__(self, prior: float):
        self.accepted, self.tried = PRIOR_TOKENS * prior, PRIOR_TOKENS

    def update(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` >= 1 draft tokens were accepted (the first ``accepted``)."""
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafted)

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


def worthwhile_lengths(rates: list[float], lengths: list[int], num_decoding: int, cost: StepCost) -> list[int]:
    """How many of its ``lengths[i]`` draft tokens request ``i`` (acceptance rate ``rates[i]``) keeps in a
    step of ``num_decoding`` decoding requests: those worth their rows (the module docstring); all
    while ``cost.per_row`` is unknown."""
    if cost.per_row is None:
        return list(lengths)
    candidates = sorted(((p ** j, i) for i, (p, n) in enumerate(zip(rates, lengths)) for j in range(1, n + 1)),
                        key=lambda c: -c[0])
    rows = tokens = float(num_decoding)
    kept = [0] * len(lengths)
    for value, i in candidates:
        if value * cost.seconds(rows) <= cost.per_row * tokens:
            break
        kept[i] += 1
        rows, tokens = rows + 1, tokens + value
    return kept
