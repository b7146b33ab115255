"""Draft and acceptance counters over an engine's life, vLLM's spec decode metrics by name."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """``num_drafts``: proposals verified (a request's drafts in one step); ``num_draft_tokens``: their
    tokens; ``num_accepted_tokens``: those accepted; ``num_accepted_tokens_per_pos[i]``: proposals whose
    draft token ``i`` was accepted (vLLM's ``spec_decode_num_*``). Acceptance rate: accepted over draft
    tokens; mean acceptance length: ``1 + num_accepted_tokens / num_drafts`` tokens per step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, drafted: int, accepted: int) -> None:
        """One proposal of ``drafted`` >= 1 tokens whose first ``accepted`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1
