"""Tool calling in ``/v1/chat/completions``, as vLLM serves it: what a request's ``tools`` and
``tool_choice`` make of its prompt, its sampling and its answer.

- The prompt: the tools go to the chat template (``apply_chat_template(..., tools=...)``), with
  ``tool_choice: "none"`` too unless the server excludes them then
  (``--exclude-tools-when-tool-choice-none``); an assistant message's ``tool_calls`` arguments
  (OpenAI's JSON text) reach the template as objects, as vLLM passes them.
- ``"auto"``: the model decides; its text is read by the server's ``--tool-call-parser``
  (:mod:`pagedpack.serve.tool_parsers`), which needs ``--enable-auto-tool-choice``.
- A named function: the output is constrained to its ``parameters`` schema (structured outputs)
  and is that call's arguments.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  one of the tools each (:func:`required_schema`, vLLM's ``_get_json_schema_from_tool``), and
  read as the calls.

A completion that made calls finishes with ``"tool_calls"`` (``"auto"``, ``"required"``); a named
function's keeps its own (``"stop"``), as vLLM and OpenAI answer.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

from pagedpack.runtime.sampling_params import StructuredOutputsParams
from pagedpack.serve.protocol import ChatCompletionRequest, ChatMessage, ChatTool, NamedToolChoice, brief
from pagedpack.serve.tool_parsers import PARSERS, Event, ToolParser, call_arguments, json_object

_EMPTY_OBJECT = {"type": "object", "properties": {}}  # a function without parameters takes {}


def required_schema(tools: list[ChatTool], *, parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of ``tool_choice: "required"``'s output: a non-empty array (of one item
    without ``parallel_tool_calls``) of ``{"name": <a tool's name>, "parameters": <its
    schema>}``. The tools' ``$defs`` are moved to the top (their ``$ref`` s point there);
    ``ValueError`` naming the tool when two define one name differently."""
    defs: dict = {}
    items = []
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(tool.function.parameters) or _EMPTY_OBJECT
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools.{i}.function.parameters: its $defs {name!r} differs from an earlier "
                                 "tool's; give shared definitions one schema")
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """A named ``tool_choice``: the whole output is that function's arguments, sent as generated."""

    def __init__(self, name: str, **options):
        super().__init__(**options)
        self.name = name
        self._at: int | None = None  # None: the call not opened yet

    def _scan(self, text: str, final: bool) -> Iterator[Event]:
        if self._at is None:
            yield "call", self.name
            self._at = 0
        if len(text) > self._at:
            yield "arguments", text[self._at:]
            self._at = len(text)


class RequiredToolParser(ToolParser):
    """``tool_choice: "required"``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects,
    each sent as a call once it has closed. Text that does not start with ``[`` is content (an
    output the grammar did not constrain); in the array, an item that is no such object is content
    as written, as is what follows the array."""

    def __init__(self, **options):
        super().__init__(**options)
        self._state = "start"  # "start" (leading whitespace), "text", "array", "after" (the array closed)
        self._at = 0  # the text before this is read
        self._scanned = 0  # the characters scanned (the array's structure)
        self._depth = 0  # brackets open
        self._in_string = self._escape = False

    def _scan(self, text: str, final: bool) -> Iterator[Event]:
        if self._state == "start":
            stripped = text.lstrip()
            if not stripped and not final:
                return
            self._state = "array" if stripped.startswith("[") else "text"
            if self._state == "array":
                self._at = self._scanned = len(text) - len(stripped) + 1
                self._depth = 1
        if self._state == "array":
            yield from self._items(text)
        if self._state == "array" and final or self._state in ("text", "after"):
            if len(text) > self._at:  # an item cut short (the completion ended), or text
                yield "content", text[self._at:]
                self._at = len(text)

    def _items(self, text: str) -> Iterator[Event]:
        """The array's items that closed in ``text`` past what was scanned."""
        for i in range(self._scanned, len(text)):
            char = text[i]
            if self._in_string:
                self._escape, self._in_string = (False, True) if self._escape else (char == "\\", char != '"')
                if not self._in_string and self._depth == 1:  # a string item: text
                    yield "content", text[self._at:i + 1]
                    self._at = i + 1
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                if self._depth == 1:
                    self._at = i  # an item starts
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1:
                    yield from self._item(text[self._at:i + 1])
                    self._at = i + 1
                elif self._depth == 0:  # the array closed
                    self._state, self._at, self._scanned = "after", i + 1, i + 1
                    return
            elif self._depth == 1 and (char.isspace() or char == ","):
                self._at = i + 1  # between items
            elif self._depth == 1:  # an item that is no object: text
                yield "content", text[self._at:i + 1]
                self._at = i + 1
        self._scanned = len(text)

    @staticmethod
    def _item(raw: str) -> Iterator[Event]:
        item = json_object(raw)
        arguments = call_arguments(item, "parameters")
        if arguments is not None:
            yield "call", item["name"]
            yield "arguments", arguments
        else:
            yield "content", raw


@dataclass(frozen=True)
class ToolCalling:
    """What one request's tool choice does to its sampling and answer (:meth:`for_request`)."""

    choice: str  # "auto", "required" or "named"
    function: str | None  # the named function
    auto_parser: str | None  # "auto": the parser's name (PARSERS)
    parallel_tool_calls: bool
    structured_outputs: StructuredOutputsParams | None

    @classmethod
    def for_request(cls, body: ChatCompletionRequest, *, tool_call_parser: str | None) -> ToolCalling | None:
        """None when the answer is plain text (no tools, ``tool_choice: "none"``); ``ValueError``
        naming ``tool_choice`` for ``"auto"`` on a server without a parser (``tool_call_parser``:
        the server's, with ``--enable-auto-tool-choice``; None otherwise)."""
        choice, parallel = body.effective_tool_choice, body.parallel_tool_calls is not False
        if choice == "none":
            return None
        if choice == "auto":
            if tool_call_parser is None:  # vLLM's answer
                raise ValueError('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                 "--tool-call-parser to be set")
            return cls("auto", None, tool_call_parser, parallel, None)
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            tool = next(t for t in body.tools if t.function.name == name)  # checked by the request
            schema = copy.deepcopy(tool.function.parameters) or _EMPTY_OBJECT
            return cls("named", name, None, parallel, StructuredOutputsParams(json=schema))
        schema = required_schema(body.tools, parallel_tool_calls=parallel)
        return cls("required", None, None, parallel, StructuredOutputsParams(json=schema))

    def parser(self) -> ToolParser:
        """A new parser for one completion."""
        if self.choice == "named":
            return NamedToolParser(self.function, parallel_tool_calls=self.parallel_tool_calls)
        kind = PARSERS[self.auto_parser] if self.choice == "auto" else RequiredToolParser
        return kind(parallel_tool_calls=self.parallel_tool_calls)

    def finish_reason(self, reason: str | None, parser: ToolParser) -> str | None:
        """The completion's finish reason once ``parser`` read it: ``"tool_calls"`` when it made
        calls (not a named function's), else the engine's."""
        if reason in ("stop", "length") and self.choice != "named" and parser.tool_calls:
            return "tool_calls"
        return reason


def template_tools(body: ChatCompletionRequest, *, exclude_when_none: bool) -> list[dict] | None:
    """The tools the chat template gets (OpenAI's shape), None for none."""
    if not body.tools or (exclude_when_none and body.effective_tool_choice == "none"):
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template gets them (vLLM's): a missing ``content`` is ``""``, and
    an assistant message's ``tool_calls[].function.arguments`` (JSON text) an object. ``ValueError``
    naming the message's field for ``tool_calls`` that are no list of calls, or arguments that are
    no JSON object."""
    out = []
    for i, message in enumerate(messages):
        message_dict = message.as_dict()
        message_dict.setdefault("content", "")
        calls = message_dict.get("tool_calls")
        if message.role == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"messages.{i}.tool_calls: expected a list of tool calls, got {brief(calls)}")
            message_dict["tool_calls"] = [_template_call(f"messages.{i}.tool_calls.{j}", call)
                                          for j, call in enumerate(calls)]
        out.append(message_dict)
    return out


def _template_call(where: str, call) -> dict:
    """One call of an assistant message (at ``where``) as the template gets it."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ValueError(f'{where}: expected {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}, '
                         f"got {brief(call)}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        parsed = json_object(arguments) if arguments else {}
        if parsed is None:
            raise ValueError(f"{where}.function.arguments: expected the JSON text of an object, got {brief(arguments)}")
        arguments = parsed
    elif arguments is None:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
