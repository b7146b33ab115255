"""``speculative_config``: vLLM's ``SpeculativeConfig`` fields that pagedpack runs, with vLLM's defaults."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pagedpack.inputs import parse_config

MAX_SPECULATIVE_TOKENS = 32  # draft tokens a request may bring to one step
MAX_NGRAM = 64  # the longest n-gram prompt lookup matches

MAX_TREE_DEPTH = 1024  # suffix decoding: the deepest suffix tree (the longest match and draft)
MAX_CACHED_REQUESTS = 1_000_000  # suffix decoding: the most responses the global tree keeps

# vLLM's methods pagedpack does not run yet, and why
NOT_YET = {
    "eagle": "EAGLE heads are not implemented yet",
    "eagle3": "EAGLE-3 heads are not implemented yet",
    "mtp": "MTP layers are not implemented yet",
    "medusa": "Medusa heads are not supported",
    "mlp_speculator": "MLP speculators are not supported",
}
METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """What proposes draft tokens and how many (vLLM's ``speculative_config``, the same names and defaults).

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the earliest earlier occurrence
    of the request's longest suffix n-gram, :mod:`pagedpack.runtime.spec_decode.ngram`) or ``"suffix"``
    (suffix decoding over the request's prompt and output and the recent responses of all requests,
    Arctic Inference's suffix trees, :mod:`pagedpack.runtime.spec_decode.suffix`) or ``"draft_model"``
    (a smaller model's greedy tokens, :mod:`pagedpack.runtime.spec_decode.draft_model`; the method when
    only ``model`` is given, as vLLM infers it). ``model``: the draft model (a path or an alias, or in
    Python a ``transformers`` model, as ``LLM``'s ``model``), ``draft_model`` only.
    ``num_speculative_tokens``: the most draft tokens per request per step (1 .. 32; required for
    ``ngram`` and ``draft_model``; ``suffix``: ``suffix_decoding_max_tree_depth`` if not given, capped at 32).
    ``prompt_lookup_min`` / ``prompt_lookup_max`` (``ngram``): the n-gram lengths matched (1 .. 64;
    both 5 when neither is given, else the one given for both).
    ``suffix_decoding_max_tree_depth`` (24): the longest context matched and draft taken;
    ``suffix_decoding_max_cached_requests`` (10,000; 0: none): the recent responses the global tree keeps;
    ``suffix_decoding_max_spec_factor`` (1.0): a draft is at most this times its match's length;
    ``suffix_decoding_min_token_prob`` (0.1): draft tokens whose estimated probability is lower are cut.
    ``ValueError`` naming ``speculative_config.<field>`` for a field unknown, missing or out of range,
    and for a method vLLM has that pagedpack does not run (saying which are missing)."""

    method: str | None = None
    model: object = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "ngram" if self.model is None else "draft_model"
        if not isinstance(self.method, str):
            raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {self.method!r:.80}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, torch.nn.Module)):
            raise ValueError(f"speculative_config.model: expected a path, an alias or a transformers model, got "
                             f"{self.model!r:.80}")
        if self.method in NOT_YET:
            raise ValueError(f"speculative_config.method: {NOT_YET[self.method]}; expected one of {METHODS}, "
                             f"got {self.method!r}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {self.method!r:.80}")
        if self.method == "draft_model" and (self.model is None or self.model == ""):
            raise ValueError(f"speculative_config.model: method 'draft_model' needs the draft model (a path, an alias "
                             f"or a transformers model), got {self.model!r:.80}")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model: only method 'draft_model' takes a model; method "
                             f"{self.method!r} got {self.model!r:.80}")
        _check_number("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1, MAX_TREE_DEPTH)
        _check_number("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0,
                      MAX_CACHED_REQUESTS)
        _check_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0, 1e6, float)
        _check_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0, float)
        if self.method == "suffix" and self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(self.suffix_decoding_max_tree_depth, MAX_SPECULATIVE_TOKENS)
        _check_number("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _check_number(name, getattr(self, name), 1, MAX_NGRAM)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: expected at most prompt_lookup_max="
                             f"{self.prompt_lookup_max}, got {self.prompt_lookup_min}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from JSON text (the command line's), a dict, or a config; None passes."""
        return parse_config(cls, value, "speculative_config")

    def describe(self) -> str:
        """One line for people: the method, its draft length and what it matches."""
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            matched = f"{low if low == high else f'{low}- to {high}'}-gram prompt lookup"
        elif self.method == "suffix":
            matched = f"suffix trees of depth {self.suffix_decoding_max_tree_depth}"
        else:  # a path as repr shows it: its control characters escaped, never sent to a terminal as they are
            path = isinstance(self.model, (str, os.PathLike))
            matched = f"draft model {repr(os.fspath(self.model)) if path else type(self.model).__name__}"
        return f"{self.method}, up to {self.num_speculative_tokens} draft tokens per request and step ({matched})"

    def scratch_blocks_per_seq(self, block_size: int) -> int:
        """Blocks of ``block_size`` tokens a draft model's proposal writes past what its sequence
        holds (:mod:`~pagedpack.runtime.spec_decode.draft_model`): ``ceil(num_speculative_tokens / block_size)``."""
        return math.ceil(self.num_speculative_tokens / block_size)


def _check_number(name: str, value, low, high, kind: type = int) -> None:
    """``value`` is a ``kind`` (an int where ``kind`` is float too; never a bool) in ``[low, high]``."""
    kinds = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        what = "an int" if kind is int else "a number"
        raise ValueError(f"speculative_config.{name}: expected {what} from {low} to {high}, got {value!r:.80}")
