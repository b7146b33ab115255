"""Tool calls read out of a chat completion's text, as vLLM's tool parsers read them.

A parser reads one completion: all at once (:meth:`ToolParser.extract_tool_calls`, a whole
answer) or as it is generated (:meth:`ToolParser.extract_tool_calls_streaming`, a stream's
deltas), and both give the same calls and content: a stream's deltas put together are the whole
answer's message. Model output is untrusted: it is read with ``json`` and ``ast`` (literals only),
never evaluated, and what is not a well-formed call stays text (``content``), never an error.

The formats (``--tool-call-parser``, vLLM's names, :data:`PARSERS`):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text
  around them (Hermes 2 Pro / 3, Qwen2.5, Qwen3, SmolLM3 templates). A call is sent when its closing
  tag has come (or, unclosed, when the completion ends); a tag's first characters are held back
  from the content until the next ones tell.
- ``pythonic``: the whole answer a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris"), add(a=1, b=2)]`` (Llama 3.2, Gemma 3 with vLLM's pythonic
  templates); values are literals (strings, numbers, lists, dicts, True / False / None). An
  answer that starts with ``[`` is held until it ends, then sent as its calls, or as text.

Whitespace at the end of the content is held back while the completion runs and dropped when it
made calls (a newline between two calls is no content).
"""
from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field


def make_tool_call_id() -> str:
    """vLLM's tool call id: ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole answer read: its ``content`` (None when it is only calls) and its ``tool_calls``."""

    content: str | None
    tool_calls: list[ToolCall]


# What a parser's scan yields: ("content", text), ("call", name) opening a call, ("arguments", text)
# adding to the open call's arguments.
Event = tuple[str, str]


class ToolParser:
    """Reads one completion's text (a new parser for each): :meth:`_scan` is a format's, the rest
    shared. ``parallel_tool_calls=False`` keeps the first call only (vLLM's filter)."""

    def __init__(self, *, parallel_tool_calls: bool = True):
        self.parallel_tool_calls = parallel_tool_calls
        self.tool_calls: list[ToolCall] = []  # what was read so far
        self._read = 0  # characters of the text given so far (streaming)
        self._held = ""  # the content's trailing whitespace, not sent yet
        self._dropping = False  # in a call past the first, without parallel_tool_calls

    def _scan(self, text: str, final: bool) -> Iterator[Event]:
        """The events of ``text`` past what earlier calls read (``text`` is the completion so far,
        each call's extending the last's); ``final``: the completion has ended."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls and content of a whole answer."""
        content = "".join(self._fold(self._scan(text, True)))
        if self.tool_calls:
            return ExtractedToolCalls(content.rstrip() or None, self.tool_calls)
        return ExtractedToolCalls(content, [])

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str, *,
                                     finished: bool = False) -> dict | None:
        """The delta message (OpenAI's: ``content`` and / or ``tool_calls``, a call's first delta with
        ``index``, ``id``, ``type``, ``function.name``, later ones ``index`` and ``function.arguments``)
        for ``delta_text``, which made ``previous_text`` (the text given so far) ``current_text``;
        None when there is nothing to send yet. ``finished``: this is the completion's last delta."""
        if len(previous_text) != self._read or len(previous_text) + len(delta_text) != len(current_text):
            raise ValueError(f"extract_tool_calls_streaming: expected the texts of one completion in order, got "
                             f"previous_text of {len(previous_text)} characters after {self._read}")
        self._read = len(current_text)
        deltas: list[dict] = []
        content = self._held + "".join(self._fold(self._scan(current_text, finished), deltas))
        stripped = content if finished and not self.tool_calls else content.rstrip()
        self._held = content[len(stripped):]
        message: dict = {"content": stripped} if stripped else {}
        if deltas:
            message["tool_calls"] = deltas
        return message or None

    def _fold(self, events: Iterator[Event], deltas: list | None = None) -> Iterator[str]:
        """The content of ``events`` (yielded), their calls added to :attr:`tool_calls` and, given
        ``deltas``, to it as OpenAI's tool call deltas (a call's events of one scan in one)."""
        for kind, value in events:
            if kind == "content":
                yield value
                continue
            if kind == "call":
                self._dropping = bool(self.tool_calls) and not self.parallel_tool_calls
                if self._dropping:
                    continue
                self.tool_calls.append(ToolCall(value, ""))
                if deltas is not None:
                    call = self.tool_calls[-1]
                    deltas.append({"index": len(self.tool_calls) - 1, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}})
            elif not self._dropping:  # arguments
                self.tool_calls[-1].arguments += value
                if deltas is not None:
                    index = len(self.tool_calls) - 1
                    if not deltas or deltas[-1]["index"] != index:
                        deltas.append({"index": index, "function": {"arguments": ""}})
                    deltas[-1]["function"]["arguments"] += value


def json_object(text: str) -> dict | None:
    """``text`` as a JSON object, or None (not JSON, not an object, NaN / Infinity, nested too deep)."""
    try:
        value = json.loads(text, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def arguments_json(arguments: dict) -> str:
    """A call's arguments as JSON text (vLLM's ``json.dumps(..., ensure_ascii=False)``); ``ValueError``
    for what is no JSON (a number that overflowed to infinity, ``1e999``) or no UTF-8 (a lone
    surrogate, ``"\\ud800"``): the caller keeps such a block as text."""
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"arguments: a lone surrogate at {err.start}") from None
    return text


def call_arguments(call: dict | None, key: str) -> str | None:
    """The arguments JSON of ``call`` (a parsed ``{"name": str, key: {...}}``), or None when it is no
    such object or its arguments are no JSON text (:func:`arguments_json`): the block stays text."""
    if call is None or not isinstance(call.get("name"), str) or not isinstance(call.get(key), dict):
        return None
    try:
        return arguments_json(call[key])
    except ValueError:
        return None


def _partial_tag(text: str, start: int, tag: str) -> int:
    """How many of ``text``'s last characters (from ``start`` on) are the beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (module docstring). A block whose
    JSON is no object with a string ``name`` and an object ``arguments`` stays text."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, **options):
        super().__init__(**options)
        self._at = 0  # the text before this is read

    def _scan(self, text: str, final: bool) -> Iterator[Event]:
        while True:
            start = text.find(self.START, self._at)
            if start < 0:
                end = len(text) - (0 if final else _partial_tag(text, self._at, self.START))
                if end > self._at:
                    yield "content", text[self._at:end]
                    self._at = end
                return
            if start > self._at:
                yield "content", text[self._at:start]
                self._at = start
            close = text.find(self.END, start + len(self.START))
            if close < 0 and not final:
                return  # the call is still coming
            body_end, after = (close, close + len(self.END)) if close >= 0 else (len(text), len(text))
            call = json_object(text[start + len(self.START):body_end])
            arguments = call_arguments(call, "arguments")
            if arguments is not None:
                yield "call", call["name"]
                yield "arguments", arguments
            else:
                yield "content", text[start:after]
            self._at = after


class PythonicToolParser(ToolParser):
    """``[f(a=1), g(b="x")]`` as the whole answer (module docstring): parsed by :mod:`ast`, every
    argument a literal (``ast.literal_eval``), every call a plain name with keyword arguments;
    anything else (an attribute, a positional argument, ``__import__('os')`` as a value) leaves the
    answer text."""

    def __init__(self, **options):
        super().__init__(**options)
        self._is_list: bool | None = None  # None until the first character that is not whitespace
        self._at = 0

    def _scan(self, text: str, final: bool) -> Iterator[Event]:
        if self._is_list is None:
            stripped = text.lstrip()
            if not stripped and not final:
                return
            self._is_list = stripped.startswith("[")
        if self._is_list:
            if not final:
                return
            calls = _pythonic_calls(text)
            if calls is not None:
                for name, arguments in calls:
                    yield "call", name
                    yield "arguments", arguments
                return
        if len(text) > self._at:
            yield "content", text[self._at:]
            self._at = len(text)


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """``text``'s ``(name, arguments JSON)`` pairs, or None if it is not a list of literal calls."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not (isinstance(tree.body, ast.List) and tree.body.elts):
            return None
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(keyword.arg is not None for keyword in node.keywords)):
                return None
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            calls.append((node.func.id, arguments_json(arguments)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        # not Python; not literals; a set, bytes or complex number (no JSON); nested too deep
        return None


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "pythonic": PythonicToolParser}
