"""``speculative_config``: vLLM's ``SpeculativeConfig`` fields that pagedpack runs, with vLLM's defaults."""
from __future__ import annotations

from dataclasses import dataclass

from pagedpack.inputs import parse_config

MAX_SPECULATIVE_TOKENS = 32  # draft tokens a request may bring to one step
MAX_NGRAM = 64  # the longest n-gram prompt lookup matches

# vLLM's methods pagedpack does not run yet, and why
NOT_YET = {
    "suffix": "suffix decoding is not implemented yet",
    "draft_model": "draft models are not implemented yet",
    "eagle": "EAGLE heads are not implemented yet",
    "eagle3": "EAGLE-3 heads are not implemented yet",
    "mtp": "MTP layers are not implemented yet",
    "medusa": "Medusa heads are not supported",
    "mlp_speculator": "MLP speculators are not supported",
}


@dataclass
class SpeculativeConfig:
    """What proposes draft tokens and how many (vLLM's ``speculative_config``, the same names).

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the earliest earlier occurrence
    of the request's longest suffix n-gram, :mod:`pagedpack.runtime.spec_decode.ngram`).
    ``num_speculative_tokens``: the most draft tokens per request per step (1 .. 32; required).
    ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram lengths matched (1 .. 64; vLLM's
    defaults: both 5 when neither is given, else the one given for both).
    ``ValueError`` naming ``speculative_config.<field>`` for a field unknown, missing or out of range,
    and for a method vLLM has that pagedpack does not run (saying which are missing)."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "ngram"
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config.method: {NOT_YET[self.method]}; expected 'ngram', "
                             f"got {self.method!r}")
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method: expected 'ngram', got {self.method!r:.80}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _check_int(name, getattr(self, name), MAX_NGRAM)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: expected at most prompt_lookup_max="
                             f"{self.prompt_lookup_max}, got {self.prompt_lookup_min}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from JSON text (the command line's), a dict, or a config; None passes."""
        return parse_config(cls, value, "speculative_config")


def _check_int(name: str, value, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"speculative_config.{name}: expected an int from 1 to {maximum}, got {value!r:.80}")
