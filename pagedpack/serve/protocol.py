"""The OpenAI request bodies ``pagedpack serve`` takes (pydantic models) and what they become.

Field names, types and defaults are OpenAI's (``/v1/completions``, ``/v1/chat/completions``) plus
vLLM's extra parameters in the body (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``cache_salt``, ``prompt_logprobs``, ``return_tokens_as_token_ids``, ``kv_transfer_params``,
``structured_outputs``; OpenAI's ``response_format`` on both endpoints, as vLLM; chat: ``chat_template``,
``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``), and the bodies of
vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. A field the API
does not have is refused (OpenAI's "Unrecognized request argument"), so a misspelt parameter never
passes silently; the values themselves are checked by
:class:`~pagedpack.runtime.sampling.SamplingParams`, whose ``ValueError`` names the field (vLLM's
names are the API's).
"""
from __future__ import annotations

import re
import reprlib
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from pagedpack.runtime.sampling import MAX_LOGPROBS, SamplingParams
from pagedpack.runtime.sampling_params import StructuredOutputsParams


def _utf8(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("expected text encodable as UTF-8 (it holds a lone surrogate)") from None
    return text


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80


def printable(text: str) -> str:
    """``text`` with lone surrogates (which JSON can carry and UTF-8 cannot) written as ``\\udXXX``."""
    return text.encode("utf-8", "backslashreplace").decode()


def brief(value) -> str:
    """``value``'s repr cut short (costing the same for any size of value), :func:`printable`."""
    return printable(_BRIEF.repr(value))


def _one_of(expected: str) -> WrapValidator:
    """A union's failure as one error: pydantic reports each branch's, under internal tags
    (``function-after[_utf8(), str]``). When one branch failed on more than its type (a lone
    surrogate in a string, a negative token id), that error, with ``ctx["at"]`` (its path inside
    the value, ``"0.type"``) and ``ctx["got"]`` (the part that failed, :func:`brief`); else
    ``union_type``: "expected ``expected``"."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError as err:
            shaped = [e for e in err.errors() if not e["type"].endswith("_type")]
            if shaped and len({e["loc"][0] for e in shaped}) == 1:  # the value has that branch's shape
                first = shaped[0]
                message = first.get("ctx", {}).get("error") if first["type"] == "value_error" else None
                at = printable(".".join(map(str, first["loc"][1:])))  # ctx holds text: no lone surrogate
                raise PydanticCustomError(first["type"], "{message}", {
                    "message": str(message or first["msg"]), "at": at, "got": brief(first["input"])}) from None
            raise PydanticCustomError("union_type", "expected {expected}", {"expected": expected}) from None

    return WrapValidator(validate)


Text = Annotated[StrictStr, AfterValidator(_utf8)]  # every string of a body: JSON's "\ud800" is no text
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
Stop = Annotated[Text | list[Text], _one_of("a string or a list of strings")] | None


class _Body(BaseModel):
    # extra fields are refused; strict types: "1" is no int and 1 no bool, as OpenAI's API answers
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage on every chunk


class JsonSchema(_Body):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted: the output
    always follows the schema)."""

    name: Text
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (the output validates against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def structured_outputs(self) -> dict | None:
        """Its :class:`~pagedpack.runtime.sampling_params.StructuredOutputsParams` fields (None for text)."""
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(f"response_format: expected json_schema with (and only with) type json_schema, got "
                             f"type {self.type} {'with' if self.json_schema else 'without'} json_schema")
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return {"json": schema} if schema is not None else {"json_object": True}


class _SamplingBody(_Body):
    """What both endpoints share: the sampling parameters (OpenAI's, then vLLM's extras)."""

    model: Text | None = None  # None: the served model
    n: StrictInt = 1
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[Text, float] | None = None
    seed: StrictInt | None = None
    user: Text | None = None  # accepted and ignored, as vLLM does
    # vLLM's extra parameters
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    cache_salt: Text | None = None
    return_tokens_as_token_ids: StrictBool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: StrictInt | None = None  # vLLM's: the prompt tokens' logprobs, in each choice
    # vLLM's: where the request's KV comes from or goes to (prefill/decode disaggregation); its fields are the
    # server's KV connector's, which checks them (a server without one refuses it)
    kv_transfer_params: dict[Text, Any] | None = None
    # vLLM's: StructuredOutputsParams' fields (json, regex, choice, grammar, json_object, structural_tag, ...)
    structured_outputs: dict[Text, Any] | None = None
    response_format: ResponseFormat | None = None  # OpenAI's (vLLM takes it on /v1/completions too)

    def sampling_params(self, *, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's :class:`SamplingParams` (``ValueError`` naming the field for a bad value);
        ``structured_outputs``: the constraint the server puts on the output (a tool choice's)."""
        bias = None
        if self.logit_bias is not None:
            bad = [token for token in self.logit_bias if not (token.isascii() and token.isdigit())]
            if bad:
                raise ValueError(f"logit_bias: expected token ids (as strings of digits) for keys, got {bad[:5]}")
            bias = {int(token): value for token, value in self.logit_bias.items()}
        structured = self.structured_outputs
        if self.response_format is not None:
            if structured is not None:
                raise ValueError("response_format: give response_format or structured_outputs, not both")
            structured = self.response_format.structured_outputs()
        if structured_outputs is not None:
            if structured is not None:
                raise ValueError("tool_choice: a required or named tool choice constrains the output itself; "
                                 "leave response_format and structured_outputs out")
            structured = structured_outputs
        given = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "stop_token_ids": self.stop_token_ids, "logit_bias": bias,
        }
        try:
            return SamplingParams(
                **{k: v for k, v in given.items() if v is not None}, max_tokens=max_tokens, stop=self.stop,
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs, structured_outputs=structured,
                extra_args=None if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params})
        except ValueError as err:
            raise self.renamed(err) from None

    def renamed(self, err: ValueError) -> ValueError:
        """``err`` about ``structured_outputs.<field>`` named after ``response_format`` when that is
        what the request gave; ``err`` itself otherwise."""
        field, _, why = str(err).partition(": ")
        if self.response_format is None or not field.startswith("structured_outputs"):
            return err
        return ValueError(f"response_format: {why}")

    def check_unsupported(self) -> None:
        """``ValueError`` naming the field for what this server does not take (a feature, a combination)."""
        if self.stream_options is not None and not self.stream:  # OpenAI's and vLLM's answer
            raise ValueError("stream_options: can only be given with stream=true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either
    (several prompts: choice ``i * n + j`` is completion ``j`` of prompt ``i``)."""

    prompt: Annotated[Text | TokenIds | list[Text] | list[TokenIds], _one_of(
        "a string, a list of token ids, or a non-empty list of all strings or all token-id lists")]
    max_tokens: StrictInt | None = 16  # OpenAI's default; None: up to max_model_len
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: expected a string, token ids or a non-empty list of either, got []")
        return list(prompt)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ValueError("echo: not supported (the prompt is not returned with the completion); send false")
        if self.suffix is not None:
            raise ValueError("suffix: not supported (no fill-in-the-middle); leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported, got best_of={self.best_of}, n={self.n}")


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """A message; fields beyond ``role``/``content``/``name`` (e.g. ``tool_calls``) reach the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Text
    content: Annotated[Text | list[TextPart], _one_of(
        'a string or a list of text parts ({"type": "text", "text": ...})')] | None = None
    name: Text | None = None

    def as_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # OpenAI's content parts: the text parts joined
            message["content"] = "".join(part.text for part in self.content)
        return message


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _tool_name(name: str) -> str:
    if not _TOOL_NAME.fullmatch(name):
        raise ValueError("expected 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'")
    return name


def _object_schema(schema: dict) -> dict:
    if "type" in schema and schema["type"] != "object":  # OpenAI's rule: the arguments are a JSON object
        raise ValueError(f"expected the JSON schema of an object (type \"object\"), got type {brief(schema['type'])}")
    return schema


class FunctionDefinition(_Body):
    """OpenAI's function tool: ``parameters`` is the JSON schema of its arguments (an object)."""

    name: Annotated[Text, AfterValidator(_tool_name)]
    description: Text | None = None
    parameters: Annotated[dict[Text, Any], AfterValidator(_object_schema)] | None = None
    strict: StrictBool | None = None  # accepted; a named or required tool_choice is always enforced


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: that function must be called."""

    type: Literal["function"]
    function: NamedFunction


_TOOL_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def _tool_choice_word(word: str) -> str:
    if word not in ("none", "auto", "required"):
        raise ValueError(f"expected {_TOOL_CHOICES}")
    return word


ToolChoice = Annotated[Annotated[Text, AfterValidator(_tool_choice_word)] | NamedToolChoice, _one_of(_TOOL_CHOICES)]


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``: ``messages`` rendered by the chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (OpenAI's defaults)
    parallel_tool_calls: StrictBool | None = None
    # vLLM's chat extras
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        names = [tool.function.name for tool in self.tools or ()]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"tools.{i}.function.name: expected names that differ, got {brief(name)} twice")
        if self.tool_choice not in (None, "none") and not names:
            choice = repr(self.tool_choice) if isinstance(self.tool_choice, str) else "a named function"
            raise ValueError(f"tool_choice: {choice} needs tools; give tools or leave tool_choice out")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice.function.name: expected one of the tools' names ({', '.join(names)}), "
                             f"got {brief(self.tool_choice.function.name)}")
        if self.echo:
            raise ValueError("echo: not supported; send false")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens; give one of them")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, its default filled in: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter in ``lora_path`` as ``lora_name``."""

    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving the adapter ``lora_name`` (or of id ``lora_int_id``)."""

    lora_name: Text | None = None
    lora_int_id: StrictInt | None = None
