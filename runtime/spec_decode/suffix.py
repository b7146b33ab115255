"""The ``suffix`` proposer: suffix decoding (Oliaro et al., 2024, arXiv:2411.04975), as vLLM's, on
Arctic Inference's suffix trees (``arctic_inference.suffix_decoding``, the implementation vLLM imports;
built from source on a CPU-only machine: ``pip install pagedpack[suffix]``).

Each live request has a suffix tree of its prompt and output; a global tree keeps the responses of the
last ``suffix_decoding_max_cached_requests`` requests (first in, first out). A draft continues the
request's last ``suffix_decoding_max_tree_depth`` tokens along the likelier of its own tree's and the
global tree's best match, at most ``suffix_decoding_max_spec_factor`` times the match's length, cut
where a token's estimated probability falls below ``suffix_decoding_min_token_prob``: agentic and
repetitive workloads, whose outputs repeat earlier ones, are where it wins over prompt lookup.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedpack.runtime.request import Request
    from pagedpack.runtime.spec_decode.config import SpeculativeConfig


class SuffixProposer:
    """Drafts of ``config``'s suffix decoding; ``ValueError`` naming ``speculative_config.method`` where
    Arctic Inference is not installed."""

    def __init__(self, config: SpeculativeConfig):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError:
            raise ValueError("speculative_config.method: 'suffix' needs Arctic Inference's suffix trees; "
                             "pip install pagedpack[suffix] (arctic-inference), or use 'ngram'") from None
        self.config = config
        self.cache = SuffixDecodingCache(max_tree_depth=config.suffix_decoding_max_tree_depth,
                                         max_cached_requests=config.suffix_decoding_max_cached_requests)
        self._seen: dict[str, int] = {}  # request id -> its output tokens the trees hold

    def draft(self, request: Request, length: int) -> list[int]:
        """At most ``length`` draft tokens to follow ``request``'s tokens (``[]``: no confident match)."""
        cache, request_id = self.cache, request.request_id
        if request_id not in cache.active_requests:
            if request_id in cache.cached_requests:  # an id used again: its old response goes
                cache.evict_cached_response(request_id)
            cache.start_request(request_id, request.prompt_token_ids)
            self._seen[request_id] = 0
        seen = self._seen[request_id]
        if request.num_output_tokens > seen:
            cache.add_active_response(request_id, request.output_token_ids[seen:])
            self._seen[request_id] = request.num_output_tokens
        config = self.config
        context = request.all_token_ids[-config.suffix_decoding_max_tree_depth:]
        return cache.speculate(request_id, context, max_spec_tokens=length,
                               max_spec_factor=config.suffix_decoding_max_spec_factor,
                               min_token_prob=config.suffix_decoding_min_token_prob).token_ids

    def release(self, live_request_ids: set[str]) -> None:
        """Stop the trees of requests no longer live (their responses stay in the global tree)."""
        for request_id in [i for i in self._seen if i not in live_request_ids]:
            self.cache.stop_request(request_id)
            del self._seen[request_id]
