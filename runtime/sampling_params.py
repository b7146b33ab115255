"""``SamplingParams``: what a request asks of the sampler (vLLM's ``SamplingParams``), checked when
made; the sampler itself is :mod:`pagedpack.runtime.sampling`. A module of its own, below the request
(:mod:`pagedpack.runtime.request` keeps one) and the sampler (which reads requests)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

# Temperatures below this are treated as greedy (dividing by them would overflow fp32).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
# Stop strings: each is searched in every request's text after every step, and the longest, less one
# character, held back from its stream; OpenAI takes up to 4, vLLM any number
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# A constraint's text (a schema's JSON, a regex, a grammar, the choices together): compiling grows with it
# (a 1 MB choice list took 20-47 s and kept 340 MB on the 258-token tiny vocabulary), so it is bounded
MAX_CONSTRAINT_CHARS = 64 * 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FLOAT32 = torch.finfo(torch.float32)
# the logits are divided by repetition_penalty in float32: a value float32 rounds to 0 or infinity
# would make a logit infinite or NaN
REPETITION_PENALTY_RANGE = (_FLOAT32.tiny, _FLOAT32.max)


def _is_real(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output text (vLLM's ``StructuredOutputsParams``): exactly one of

    json: a JSON schema (a dict, or its JSON text) the output must validate against;
    regex: a regular expression the whole output must match;
    choice: a non-empty list of strings, the output is one of them;
    grammar: an EBNF grammar (xgrammar's GBNF dialect, vLLM's ``grammar``) the output must derive;
    json_object: True, the output is any JSON object (OpenAI's ``response_format: json_object``);
    structural_tag: xgrammar's structural tag (a dict or its JSON text): free text with constrained
        segments between begin / end tags (vLLM's ``structural_tag``).

    disable_any_whitespace: JSON without whitespace between tokens (vLLM's flag, for ``json`` /
        ``json_object``); disable_additional_properties: objects without ``additionalProperties``
        in the schema admit no other keys.

    This checks the shape only and raises ``ValueError`` naming ``structured_outputs.<field>``; a
    schema or grammar the grammar engine cannot compile is refused when the request is made.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: expected exactly one of {', '.join(self.KINDS)}, "
                             f"got {', '.join(given) or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        try:
            size = len(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as err:  # an object JSON has no text for, a NaN
            raise ValueError(f"structured_outputs.{kind}: expected JSON values, got {err}") from None
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{kind}: expected at most {MAX_CONSTRAINT_CHARS} characters of "
                             f"constraint text, got {size}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as err:
                    raise ValueError(f"structured_outputs.{name}: expected a JSON object, got text that "
                                     f"does not parse ({err})") from None
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"structured_outputs.{name}: expected a JSON object, got {value!r:.80}")
            setattr(self, name, value)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name}: expected a non-empty str, got {value!r:.80}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice: expected a non-empty list of non-empty strings, "
                             f"got {self.choice!r:.80}")
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name}: expected a bool, got {value!r:.80}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick each next token of one request (vLLM names and defaults).

    n: completions of the prompt (parallel sampling, ``>= 1``): its KV is computed once and
        shared; with a ``seed``, completion ``i`` is seeded ``seed + i`` (as vLLM v1's
        ``ParentRequest``), so it equals the prompt run alone with that seed.
    temperature: ``>= 0``; ``0`` (anything below ``GREEDY_TEMPERATURE``) means greedy.
    top_p: nucleus mass in ``(0, 1]``; ``1`` disables it.
    top_k: keep the ``k`` most likely tokens; ``0`` or ``-1`` disables it.
    seed: per-request random seed, or ``None`` for the global generator.
    max_tokens: at most this many output tokens (``>= 1``).
    stop_token_ids: generating any of these finishes the request (the token is kept).
    ignore_eos: keep generating past the model's EOS token.
    stop: strings that finish the request when the generated text contains one; the text is cut
        before it (after it with ``include_stop_str_in_output``) and ``stop_reason`` is the string.
        Found across token and delta boundaries; a streamed delta never shows part of one. At most
        ``MAX_STOP_STRINGS`` (16) of at most ``MAX_STOP_CHARS`` (256) characters each; they need a
        tokenizer (a model without one takes ``stop_token_ids``).
    skip_special_tokens: leave special tokens out of the text (vLLM's default, True).
    min_tokens: until this many tokens are out, EOS and ``stop_token_ids`` cannot be sampled and
        stop strings are not looked for (``0 <= min_tokens <= max_tokens``).
    presence_penalty / frequency_penalty: in ``[-2, 2]``, subtracted from the logit of every token
        the output holds, once / per occurrence (OpenAI's definition, over the output only).
    repetition_penalty: ``> 0``; a token in the prompt or the output has a positive logit divided
        by it and a negative one multiplied (the CTRL paper's, as vLLM and ``transformers``).
    min_p: in ``[0, 1]``; drop tokens whose probability (at the temperature) is below ``min_p``
        times the most likely token's.
    logit_bias: ``{token id: bias}`` added to the logits, bias in ``[-100, 100]`` (OpenAI's range).
    logprobs: None, or the number ``0 .. 20`` of most likely tokens whose log-probability is
        returned with each generated token (plus the sampled token's own), from the model's
        logits before any penalty, bias or temperature (vLLM's default ``raw_logprobs``).
    prompt_logprobs: None, or the number ``0 .. 20`` of most likely tokens returned with each
        prompt token's own log-probability given the tokens before it (the first token has None),
        once per request in ``RequestOutput.prompt_logprobs`` (:mod:`pagedpack.runtime.prompt_logprobs`).
    extra_args: None, or a dict with string keys for what reads it besides the sampler (vLLM's field): a KV
        connector reads ``extra_args["kv_transfer_params"]`` (vLLM's ``kv_transfer_params``: where a
        request's KV comes from or goes to; :mod:`pagedpack.runtime.kv_connector`).
    structured_outputs: None, or a :class:`StructuredOutputsParams` (or a dict of its fields): the
        output is constrained to a JSON schema, regex, choice, grammar or structural tag (vLLM's field).

    Penalties, bias and ``min_tokens`` apply to greedy requests too; then temperature, ``min_p``,
    top-k and top-p, in vLLM's order.

    Raises ``ValueError`` naming the field, the expectation and the value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n: expected an int >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k < 2**63:
            raise ValueError(f"top_k: expected an int in [-1, 2**63) (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed: expected an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if self.seed is not None and self.seed + self.n > 2**64:
            raise ValueError(f"seed: with n={self.n} completions seeded seed + i, expected seed <= 2**64 - n, "
                             f"got {self.seed}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop: expected a non-empty str, a list of them or None, got {self.stop!r:.120}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: expected at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        longest = max(stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"stop: expected strings of at most {MAX_STOP_CHARS} characters, got one of "
                             f"{len(longest)}: {longest!r:.60}")
        self.stop = list(stop)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: expected a number in [-2, 2], got {getattr(self, name)!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_real(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty: expected a number in [{low:.4g}, {high:.4g}] (float32's normal "
                             f"range: the logits are divided by it), got {self.repetition_penalty!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in bias.items()):
            raise ValueError(f"logit_bias: expected a dict of token ids >= 0 to biases in [-100, 100], "
                             f"got {self.logit_bias!r:.120}")
        self.logit_bias = dict(bias)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: expected None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict)
                                                and all(isinstance(k, str) for k in self.extra_args)):
            raise ValueError(f"extra_args: expected None or a dict with string keys, got {self.extra_args!r:.120}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs: unknown fields {sorted(unknown)!r:.120}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs: expected None, a StructuredOutputsParams or a dict of its fields, "
                             f"got {self.structured_outputs!r:.120}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def processes_logits(self) -> bool:
        """Anything changes the logits before temperature (penalties, bias, ``min_tokens``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


def normalize_sampling_params(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt (None means the defaults)."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    if isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
        if len(sampling_params) != num_prompts:
            raise ValueError(f"sampling_params: expected one per prompt ({num_prompts}), got {len(sampling_params)}")
        return list(sampling_params)
    raise ValueError(f"sampling_params: expected a SamplingParams or a list of them, got {sampling_params!r:.80}")
