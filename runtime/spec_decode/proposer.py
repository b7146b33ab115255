"""Draft tokens for the requests a step left decoding, and what their verification taught."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedpack.runtime.spec_decode.cost import StepCost, worthwhile_lengths
from pagedpack.runtime.spec_decode.lookahead import Lookahead
from pagedpack.runtime.spec_decode.ngram import propose_ngram
from pagedpack.runtime.spec_decode.stats import SpecDecodingStats
from pagedpack.runtime.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request, ScheduledRequest
    from pagedpack.runtime.spec_decode.config import SpeculativeConfig
    from pagedpack.runtime.spec_decode.draft_model import DraftModel


PRIOR_RATE = 0.5  # a request's acceptance rate before any was verified, while the engine has none either


class Proposer:
    """Proposes with ``config``'s method (after each step, :meth:`propose`), counts each proposal's
    acceptance (:meth:`observe`, into :attr:`stats`) and each decode step's time (:meth:`observe_step`,
    into :attr:`cost`, which the drafts must pay for: :mod:`.cost`); ``draft_model``: the method
    ``draft_model``'s :class:`~.draft_model.DraftModel`. ``ValueError`` naming
    ``speculative_config.method`` for a method whose library is not installed."""

    def __init__(self, config: SpeculativeConfig, draft_model: DraftModel | None = None):
        self.config, self.draft_model = config, draft_model
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.cost = StepCost()
        self._suffix = SuffixProposer(config) if config.method == "suffix" else None

    def propose(self, requests: list[Request], live_request_ids: Callable[[], set[str]]) -> None:
        """Set ``spec_token_ids`` of each of ``requests`` that decodes (its KV computed up to its last
        token, no parallel samples to fork) to its draft, of its :class:`Lookahead`'s length, less the
        drafts not worth their rows (:func:`~.cost.worthwhile_lengths`); ``live_request_ids()``: every
        request the engine still holds (a proposer's state of the others goes)."""
        if self._suffix is not None:
            self._suffix.release(live_request_ids())
        decoding = [r for r in requests if not r.is_finished and r.num_computed_tokens == r.num_tokens - 1]
        prior = self.stats.num_accepted_tokens / self.stats.num_draft_tokens if self.stats.num_draft_tokens \
            else PRIOR_RATE
        drafting, lengths = [], []
        for request in decoding:
            request.spec_token_ids = []
            if request.forks:
                continue
            if request.spec_lookahead is None:
                request.spec_lookahead = Lookahead(self.config.num_speculative_tokens, prior)
            length = request.spec_lookahead.next_length()
            if length:
                drafting.append(request)
                lengths.append(length)
        rates = [r.spec_lookahead.acceptance.rate for r in drafting]
        if self.draft_model is not None:  # its passes cost: cut the lengths first
            lengths = worthwhile_lengths(rates, lengths, len(decoding), self.cost)
            kept = [(r, n) for r, n in zip(drafting, lengths) if n]
            drafts = self.draft_model.propose([r for r, _ in kept], [n for _, n in kept])
            drafting = [r for r, _ in kept]
        else:  # a lookup may find fewer tokens than asked for: cut what it found
            drafts = [self.draft(r, n) for r, n in zip(drafting, lengths)]
            drafts = [d[:n] for d, n in zip(drafts, worthwhile_lengths(rates, [len(d) for d in drafts],
                                                                        len(decoding), self.cost))]
        for request, draft in zip(drafting, drafts):
            request.spec_token_ids = draft

    def draft(self, request: Request, length: int) -> list[int]:
        """At most ``length`` draft tokens to follow ``request``'s tokens (``ngram`` or ``suffix``)."""
        if self._suffix is not None:
            return self._suffix.draft(request, length)
        return propose_ngram(request.all_token_ids, length, self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max)

    def observe_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """A step of ``scheduled`` took ``seconds`` (from scheduling to its next drafts); timed into
        :attr:`cost` if it only decoded (each request one token and its drafts)."""
        if all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in scheduled):
            self.cost.observe(sum(s.num_new_tokens for s in scheduled), seconds)

    def observe(self, scheduled: ScheduledRequest, token_ids: list[int]) -> None:
        """``scheduled`` brought drafts and took ``token_ids``: its accepted drafts, then one more."""
        drafted, accepted = len(scheduled.spec_token_ids), len(token_ids) - 1
        self.stats.observe(drafted, accepted)
        if scheduled.request.spec_lookahead is not None:
            scheduled.request.spec_lookahead.update(drafted, accepted)
