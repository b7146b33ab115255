"""``pagedpack serve smollm2-135m`` (real weights, captured by the server from the alias) against
the unmodified ``transformers`` model: chat and raw completions, streamed by concurrent clients
with the official ``openai`` client, equal ``apply_chat_template`` + greedy ``generate`` run on
each prompt alone."""
import asyncio
import json
import re
import time

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
    args = ("--max-num-batched-tokens", "256", "--served-model-name", "smol", "--timeout-graceful-shutdown", "120")
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
