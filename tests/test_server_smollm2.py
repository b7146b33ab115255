"""``pagedpack serve smollm2-135m`` (real weights, captured by the server from the alias) against
the unmodified ``transformers`` model: chat and raw completions, streamed by concurrent clients
with the official ``openai`` client, equal ``apply_chat_template`` + greedy ``generate`` run on
each prompt alone. Tool calling (``--enable-auto-tool-choice --tool-call-parser hermes``): a
required and a named ``tool_choice`` give calls whose arguments validate against the tool's
parameters, streamed calls equal whole ones, a tool's result fed back is answered. SmolLM2's chat
template does not render tools (it reads only roles and contents; vLLM renders it the same way):
tests/test_tool_calling.py renders them with a Hermes (Qwen2.5-style) template."""
import asyncio
import json
import re
import time

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import RemoteServer, fetch_alias_or_skip, hf_greedy

MAX_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 7 times 8?",
             "Write a haiku about the sea."]
RAW = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def checkpoint():
    return fetch_alias_or_skip("smollm2-135m")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = ("--max-num-batched-tokens", "256", "--served-model-name", "smol", "--timeout-graceful-shutdown", "120",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with RemoteServer("smollm2-135m", *args, log_path=tmp_path_factory.mktemp("smol") / "server.log") as remote:
        yield remote
        # idle: SIGTERM stops it at once, not when the grace period's abort timer fires (120 s - 1 s;
        # RemoteServer kills it after 30 s, and the exit status says so)
        start = time.monotonic()
        assert remote.stop() == 0, remote.log[-2000:]
        assert time.monotonic() - start < 25.0, remote.log[-2000:]


def test_concurrent_chat_and_completions_equal_transformers_greedy_alone(server, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for q in QUESTIONS]
    raws = [tokenizer(p).input_ids for p in RAW]
    expected = [tokenizer.decode(hf_greedy(model, ids, MAX_TOKENS), skip_special_tokens=True)
                for ids in chats + raws]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def chat(question):
        text = ""
        stream = await client.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                                      max_tokens=MAX_TOKENS, temperature=0, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
        return text

    async def complete(prompt):
        out = await client.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].text

    async def everyone():
        async with client:
            return await asyncio.wait_for(asyncio.gather(*map(chat, QUESTIONS), *map(complete, RAW)), 300)

    got = asyncio.run(everyone())
    assert got == expected
    assert "Paris" in got[0]


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]},
    "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
}, "required": ["name", "age", "color", "pets", "home"]}


def test_structured_outputs_with_the_openai_client(server):
    """50 concurrent chats with a JSON schema (half streamed) all validate; regex and choice match; a grammar
    that cannot finish in max_tokens ends with "length"; a schema xgrammar refuses is a 400 naming the field."""
    import jsonschema

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def person(i: int) -> tuple[str, str]:
        kwargs = dict(model="smol", messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
                      max_tokens=100, temperature=0.7, seed=i, response_format=response_format)
        if i % 2:
            out = await client.chat.completions.create(**kwargs)
            return out.choices[0].message.content, out.choices[0].finish_reason
        text, reason = "", None
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def constrained(extra: dict, max_tokens: int = 24) -> tuple[str, str]:
        out = await client.completions.create(model="smol", prompt="My favourite", max_tokens=max_tokens,
                                              temperature=0, extra_body={"structured_outputs": extra})
        return out.choices[0].text, out.choices[0].finish_reason

    async def everyone():
        async with client:
            people = await asyncio.wait_for(asyncio.gather(*map(person, range(50))), 300)
            regex = await constrained({"regex": "[A-Z][a-z]{2,8} [0-9]{2}"})
            choice = await constrained({"choice": ["cats", "dogs", "neither"]})
            unfinished = await constrained({"grammar": 'root ::= "x"{40}'}, max_tokens=4)
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
            return people, regex, choice, unfinished, bad.value

    people, regex, choice, unfinished, bad = asyncio.run(everyone())
    for text, reason in people:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text, strict=False), PERSON)  # strict=False: docs/structured-outputs.md
    assert regex[1] == "stop" and re.fullmatch("[A-Z][a-z]{2,8} [0-9]{2}", regex[0]), regex
    assert choice[1] == "stop" and choice[0] in ("cats", "dogs", "neither"), choice
    assert unfinished[1] == "length" and re.fullmatch("x+", unfinished[0]), unfinished
    assert bad.status_code == 400 and bad.body["param"] == "response_format", bad.body


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
TOOL_MAX_TOKENS = 40
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _calls(message):
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def test_a_required_tool_choice_calls_a_tool_with_valid_arguments(client):
    out = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=TOOL_MAX_TOKENS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_named_tool_choice_calls_that_tool_with_valid_arguments(client):
    out = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], max_tokens=TOOL_MAX_TOKENS,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_streamed_tool_choice_answer_equals_the_whole_one(client, tool_choice):
    """Greedy, n = 2: each choice's streamed deltas put together (content, calls by index: the first
    delta with id, type and name, then argument fragments) equal the whole answer's message."""
    ask = {"model": "smol", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice, "n": 2,
           "max_tokens": 20, "temperature": 0}
    whole = client.chat.completions.create(**ask)
    got: dict = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            content, calls, finish = got.setdefault(choice.index, ["", {}, None])
            got[choice.index][0] = content + (choice.delta.content or "")
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id.startswith("chatcmpl-tool-") and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            got[choice.index][2] = choice.finish_reason or finish
    assert sorted(got) == [0, 1]
    for choice in whole.choices:
        content, calls, finish = got[choice.index]
        assert (content or None, [tuple(c) for c in calls.values()], finish) == \
               (choice.message.content or None, _calls(choice.message), choice.finish_reason)
        if isinstance(tool_choice, dict):  # the whole output is the call's arguments, whatever the grammar made
            assert [name for name, _ in _calls(choice.message)] == ["get_time"] and choice.finish_reason != "tool_calls"


def test_a_tool_s_result_fed_back_is_answered(client):
    called = {"id": "chatcmpl-tool-0123", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [called]},
                {"role": "tool", "tool_call_id": called["id"],
                 "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
    out = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], max_tokens=16, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content
    assert out.usage.prompt_tokens > 40  # the call and its result were rendered
