"""Draft tokens for the requests a step left decoding, and what their verification taught."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedpack.runtime.spec_decode.lookahead import Lookahead
from pagedpack.runtime.spec_decode.ngram import propose_ngram
from pagedpack.runtime.spec_decode.stats import SpecDecodingStats

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request, ScheduledRequest
    from pagedpack.runtime.spec_decode.config import SpeculativeConfig


class Proposer:
    """Proposes with ``config``'s method (after each step, :meth:`propose`) and counts each
    proposal's acceptance (:meth:`observe`, into :attr:`stats`)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecDecodingStats(config.num_speculative_tokens)

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` of each of ``requests`` that decodes (its KV computed up to its last
        token, no parallel samples to fork) to its draft, of its :class:`Lookahead`'s length."""
        config = self.config
        for request in requests:
            if request.is_finished or request.forks or request.num_computed_tokens != request.num_tokens - 1:
                continue
            if request.spec_lookahead is None:
                request.spec_lookahead = Lookahead(config.num_speculative_tokens)
            length = request.spec_lookahead.next_length()
            request.spec_token_ids = propose_ngram(request.all_token_ids, length, config.prompt_lookup_min,
                                                   config.prompt_lookup_max) if length else []

    def observe(self, scheduled: ScheduledRequest, token_ids: list[int]) -> None:
        """``scheduled`` brought drafts and took ``token_ids``: its accepted drafts, then one more."""
        drafted, accepted = len(scheduled.spec_token_ids), len(token_ids) - 1
        self.stats.observe(drafted, accepted)
        if scheduled.request.spec_lookahead is not None:
            scheduled.request.spec_lookahead.update(drafted, accepted)
