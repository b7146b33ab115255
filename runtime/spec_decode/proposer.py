"""Draft tokens for the requests a step left decoding, and what their verification taught."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedpack.runtime.spec_decode.lookahead import Lookahead
from pagedpack.runtime.spec_decode.ngram import propose_ngram
from pagedpack.runtime.spec_decode.stats import SpecDecodingStats
from pagedpack.runtime.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request, ScheduledRequest
    from pagedpack.runtime.spec_decode.config import SpeculativeConfig


class Proposer:
    """Proposes with ``config``'s method (after each step, :meth:`propose`) and counts each
    proposal's acceptance (:meth:`observe`, into :attr:`stats`). ``ValueError`` naming
    ``speculative_config.method`` for a method whose library is not installed."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self._suffix = SuffixProposer(config) if config.method == "suffix" else None

    def propose(self, requests: list[Request], live_request_ids: Callable[[], set[str]]) -> None:
        """Set ``spec_token_ids`` of each of ``requests`` that decodes (its KV computed up to its last
        token, no parallel samples to fork) to its draft, of its :class:`Lookahead`'s length;
        ``live_request_ids()``: every request the engine still holds (a proposer's state of the others goes)."""
        if self._suffix is not None:
            self._suffix.release(live_request_ids())
        for request in requests:
            if request.is_finished or request.forks or request.num_computed_tokens != request.num_tokens - 1:
                continue
            if request.spec_lookahead is None:
                request.spec_lookahead = Lookahead(self.config.num_speculative_tokens)
            length = request.spec_lookahead.next_length()
            request.spec_token_ids = self.draft(request, length) if length else []

    def draft(self, request: Request, length: int) -> list[int]:
        """At most ``length`` draft tokens to follow ``request``'s tokens."""
        if self._suffix is not None:
            return self._suffix.draft(request, length)
        return propose_ngram(request.all_token_ids, length, self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max)

    def observe(self, scheduled: ScheduledRequest, token_ids: list[int]) -> None:
        """``scheduled`` brought drafts and took ``token_ids``: its accepted drafts, then one more."""
        drafted, accepted = len(scheduled.spec_token_ids), len(token_ids) - 1
        self.stats.observe(drafted, accepted)
        if scheduled.request.spec_lookahead is not None:
            scheduled.request.spec_lookahead.update(drafted, accepted)
