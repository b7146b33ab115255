"""Tool calling without a server: the parsers (``hermes``, ``pythonic``, a named and a required
``tool_choice``) on crafted model output, whole and split into every kind of delta (the stream's
deltas put together are the whole answer's message), the required / named JSON schemas checked with
``jsonschema``, the request's checks (400s naming the field) and the tools reaching a chat template."""
import json

import jsonschema
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagedpack.models.tiny import default_model
from pagedpack.serve.app import _validation_error
from pagedpack.serve.openai_serving import ServingConfig, chat_text
from pagedpack.serve.protocol import ChatCompletionRequest
from pagedpack.serve.tool_parsers import HermesToolParser, PythonicToolParser
from pagedpack.serve.tools import NamedToolParser, RequiredToolParser, ToolCalling, required_schema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/num"},
                                                                    "b": {"$ref": "#/$defs/num"}},
                                  "required": ["a", "b"], "$defs": {"num": {"type": "number"}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: takes {}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def call(name, arguments):
    return (name, json.dumps(arguments, ensure_ascii=False))


def whole(parser, text):
    """``(content, [(name, arguments)])`` of ``text`` read at once."""
    read = parser.extract_tool_calls(text)
    return read.content, [(c.name, c.arguments) for c in read.tool_calls]


def streamed(parser, deltas):
    """``(content, [(name, arguments)])`` put together from the streamed delta messages of ``deltas``;
    checks each call's first delta has its id, type and name, and the ids are distinct."""
    content, calls, text = "", {}, ""
    for i, delta in enumerate(deltas):
        message = parser.extract_tool_calls_streaming(text, text + delta, delta, finished=i == len(deltas) - 1)
        text += delta
        if message is None:
            continue
        content += message.get("content", "")
        for d in message.get("tool_calls", ()):
            if d["index"] not in calls:
                assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                calls[d["index"]] = [d["id"], d["function"]["name"], ""]
            calls[d["index"]][2] += d["function"].get("arguments", "")
    assert len({c[0] for c in calls.values()}) == len(calls)
    return content or None, [(name, arguments) for _, name, arguments in calls.values()]


def split(text, cuts):
    """``text`` cut at the positions ``cuts`` (any, sorted here); empty deltas too."""
    points = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:])]


HERMES = [  # (text, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [call("get_weather", {"city": "Paris"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>\n',
     None, [call("get_weather", {"city": "Paris"}), call("add", {"a": 1, "b": 2.5})]),
    ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich </tool"}}</tool_call> Done.',
     "Let me check.  Done.", [call("get_weather", {"city": "Zürich </tool"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON: text
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',  # arguments no object: text
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', '<tool_call>{"name": "f", "arguments": '
     '{"x": NaN}}</tool_call>', []),
    # no JSON or no UTF-8 in the arguments (a break-it session's: 1e999 was sent as Infinity, a lone
    # surrogate made the whole answer a 500): text
    ('<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>', []),
    ('<tool_call>{"name": "ping", "arguments": {}}', None, [call("ping", {})]),  # unclosed at the end: a call
    ("a < b and <tool_ is no tag <tool_call", "a < b and <tool_ is no tag <tool_call", []),
    ("no calls at all\n", "no calls at all\n", []),
    ("", "", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_reads_calls_and_keeps_the_rest_as_text(text, content, calls):
    assert whole(HermesToolParser(), text) == (content, calls)
    assert streamed(HermesToolParser(), list(text)) == (content or None, calls)  # a character a delta


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(HERMES), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_hermes_streamed_in_any_deltas_equals_the_whole_answer(case, cuts):
    text, content, calls = case
    assert streamed(HermesToolParser(), split(text, cuts)) == (content or None, calls)


def test_a_partial_tag_is_held_back_from_the_content_until_it_is_told():
    parser, sent = HermesToolParser(), []
    text = ""
    for delta in ["Hi <", "tool", "_ca", "t", " there"]:
        message = parser.extract_tool_calls_streaming(text, text + delta, delta)
        text += delta
        sent.append(message and message.get("content"))
    assert sent == ["Hi", None, None, " <tool_cat", " there"]


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    text = HERMES[1][0]
    assert whole(HermesToolParser(parallel_tool_calls=False), text) == (None, HERMES[1][2][:1])
    assert streamed(HermesToolParser(parallel_tool_calls=False), split(text, [7, 40, 90])) == (None, HERMES[1][2][:1])


PYTHONIC = [
    ('[get_weather(city="Paris, France [FR]", unit="celsius")]', None,
     [call("get_weather", {"city": "Paris, France [FR]", "unit": "celsius"})]),
    ("[add(a=1, b=-2.5), ping()]", None, [call("add", {"a": 1, "b": -2.5}), call("ping", {})]),
    ('  [f(x={"k": [1, (2, 3), None, True]}, y=\'it\\\'s ) ]\')]\n', None,
     [call("f", {"x": {"k": [1, [2, 3], None, True]}, "y": "it's ) ]"})]),
    ("[f(a=__import__('os').system('echo pwned'))]", "[f(a=__import__('os').system('echo pwned'))]", []),
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),  # not a plain name
    ("[f(1)]", "[f(1)]", []),  # positional
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set: no JSON
    ("[f(a=1e999)]", "[f(a=1e999)]", []),  # infinity: no JSON
    ("[f(s='\\ud800')]", "[f(s='\\ud800')]", []),  # a lone surrogate: no UTF-8
    ("[f(**{'a': 1})]", "[f(**{'a': 1})]", []),
    ("[1, 2]", "[1, 2]", []),
    ("[f(a=1)] and more", "[f(a=1)] and more", []),
    ("The answer is [f(a=1)]", "The answer is [f(a=1)]", []),
    ("[" * 500 + "]" * 500, "[" * 500 + "]" * 500, []),  # nested too deep for the parser
    ("", "", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC)
def test_pythonic_reads_literal_calls_and_never_runs_code(text, content, calls, monkeypatch):
    import os

    monkeypatch.setattr(os, "system", lambda *a: pytest.fail("the model's text ran"))
    assert whole(PythonicToolParser(), text) == (content, calls)
    assert streamed(PythonicToolParser(), list(text)) == (content or None, calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(PYTHONIC[:4] + PYTHONIC[-3:]), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_pythonic_streamed_in_any_deltas_equals_the_whole_answer(case, cuts):
    text, content, calls = case
    assert streamed(PythonicToolParser(), split(text, cuts)) == (content or None, calls)


REQUIRED = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', None, [call("get_weather", {"city": "Paris"})]),
    (' [ {"parameters": {"a": 1, "b": 2}, "name": "add"} ,\n{"name": "ping", "parameters": {}} ]\n', None,
     [call("add", {"a": 1, "b": 2}), call("ping", {})]),
    ('[{"name": "get_weather", "parameters": {"city": "]}\\"{["}}]', None, [call("get_weather", {"city": ']}"{['})]),
    ("I cannot call tools.", "I cannot call tools.", []),  # not constrained (before the grammar engine)
    ('[{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),  # cut short
]


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED)
def test_a_required_choice_reads_the_json_array_of_calls(text, content, calls):
    assert whole(RequiredToolParser(), text) == (content, calls)


@settings(max_examples=100, deadline=None)
@given(case=st.sampled_from(REQUIRED), cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_a_required_choice_streamed_in_any_deltas_equals_the_whole_answer(case, cuts):
    text, content, calls = case
    assert streamed(RequiredToolParser(), split(text, cuts)) == (content or None, calls)


def test_a_named_choice_streams_the_arguments_as_generated():
    text = '{"city": "Paris", "unit": "celsius"}'
    assert whole(NamedToolParser("get_weather"), text) == (None, [("get_weather", text)])
    parser, got = NamedToolParser("get_weather"), []
    for i, delta in enumerate(split(text, [3, 11, 20])):
        previous = text[:sum(map(len, got))]
        got.append(delta)
        got_message = parser.extract_tool_calls_streaming(previous, previous + delta, delta, finished=i == 3)
        tool_call = got_message["tool_calls"][0]
        assert tool_call["function"]["arguments"] == delta and tool_call["index"] == 0
        assert ("name" in tool_call["function"]) == (i == 0)


def request(**fields):
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def test_the_required_schema_admits_the_tools_calls_and_nothing_else():
    tools = request(tools=[WEATHER, ADD, PING]).tools
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {"a": 1, "b": 2}},
            {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"town": "Paris"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "add", "parameters": {"a": "1", "b": 2}}], [{"name": "ping"}], {"name": "ping"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_schema(tools, parallel_tool_calls=False)
    jsonschema.validate(good[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    assert "$defs" in ADD["function"]["parameters"]  # moved in a copy: the request's schema is untouched
    clash = {"type": "function", "function": {"name": "sub", "parameters": {"$defs": {"num": {"type": "string"}}}}}
    with pytest.raises(ValueError, match=r"^tools\.1\.function\.parameters: its \$defs 'num'"):
        required_schema(request(tools=[ADD, clash]).tools)


def test_tool_choice_makes_the_constraint_the_parser_and_the_finish_reason():
    named = ToolCalling.for_request(request(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {
        "name": "add"}}), tool_call_parser=None)
    assert named.structured_outputs.json == ADD["function"]["parameters"]
    jsonschema.validate({"a": 1, "b": 2}, named.structured_outputs.json)
    required = ToolCalling.for_request(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False),
                                       tool_call_parser=None)
    assert required.structured_outputs.json == required_schema(request(tools=[WEATHER]).tools,
                                                               parallel_tool_calls=False)
    auto = ToolCalling.for_request(request(tools=[WEATHER]), tool_call_parser="hermes")
    assert auto.structured_outputs is None and isinstance(auto.parser(), HermesToolParser)
    assert ToolCalling.for_request(request(tools=[WEATHER], tool_choice="none"), tool_call_parser="hermes") is None
    assert ToolCalling.for_request(request(), tool_call_parser="hermes") is None
    with pytest.raises(ValueError, match='^tool_choice: "auto" tool choice requires --enable-auto-tool-choice'):
        ToolCalling.for_request(request(tools=[WEATHER]), tool_call_parser=None)
    parser = required.parser()
    parser.extract_tool_calls(REQUIRED[0][0])
    assert required.finish_reason("stop", parser) == "tool_calls" and required.finish_reason("abort", parser) == "abort"
    parser = named.parser()
    parser.extract_tool_calls('{"a": 1, "b": 2}')
    assert named.finish_reason("stop", parser) == "stop"  # vLLM's and OpenAI's answer for a named function


BAD_REQUESTS = [  # (fields, the message's start)
    ({"tools": [{"type": "function"}]}, "tools.0.function: Field required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type: Input should be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools.0.function.name: expected 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-', got 'get weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools.0.function.name: expected 1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters: Input should be a valid dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters: expected the JSON schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "paramaters": {}}}]},
     "Unrecognized request argument supplied: tools.0.function.paramaters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name: expected names that differ, got 'get_weather' twice"),
    ({"tools": [WEATHER], "tool_choice": "any"},
     'tool_choice: expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
     "got 'any'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function: Field required"),
    ({"tools": [WEATHER], "tool_choice": 1}, 'tool_choice: expected "none", "auto", "required" or {"type": '),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice.function.name: expected one of the tools' names (get_weather), got 'add'"),
    ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls: Input should be a valid boolean"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_REQUESTS)
def test_a_bad_tool_request_is_refused_naming_the_field(fields, message):
    try:
        request(**fields).check_unsupported()
    except ValidationError as err:  # as the app answers it (400)
        errors = [{**e, "loc": ("body", *e["loc"])} for e in err.errors()]
        got = str(_validation_error(RequestValidationError(errors)))
    except ValueError as err:
        got = str(err)
    else:
        pytest.fail("accepted")
    assert got.startswith(message), got


HERMES_TEMPLATE = (  # Qwen2.5's tool parts, shortened
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_tools_calls_and_results_reach_the_chat_template():
    tokenizer = default_model()[1]
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temperature": 21}'}]
    config = ServingConfig("m", chat_template=HERMES_TEMPLATE)
    text = chat_text(tokenizer, request(messages=messages, tools=[WEATHER]), config)
    assert json.dumps(WEATHER) in text  # the tool, as given
    # the arguments reach the template as an object (tojson of the JSON text would quote it)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    none = request(messages=messages, tools=[WEATHER], tool_choice="none")
    assert "<tools>" in chat_text(tokenizer, none, config)  # vLLM renders them for "none" too
    excluded = ServingConfig("m", chat_template=HERMES_TEMPLATE, exclude_tools_when_tool_choice_none=True)
    assert "<tools>" not in chat_text(tokenizer, none, excluded)
    bad = [{**messages[1], "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"^messages\.0\.tool_calls\.0\.function\.arguments: expected the JSON text"):
        chat_text(tokenizer, request(messages=bad), config)


def test_the_server_s_tool_flags_are_checked():
    with pytest.raises(ValueError, match="^--tool-call-parser: expected one of hermes, pythonic, got 'mistral'"):
        ServingConfig("m", tool_call_parser="mistral")
    with pytest.raises(ValueError, match="^--enable-auto-tool-choice: needs --tool-call-parser"):
        ServingConfig("m", enable_auto_tool_choice=True)
