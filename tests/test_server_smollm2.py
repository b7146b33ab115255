"""``pagedpack serve smollm2-135m`` (real weights, captured by the server from the alias) against
the unmodified ``transformers`` model: chat and raw completions, streamed by concurrent clients
with the official ``openai`` client, equal ``apply_chat_template`` + greedy ``generate`` run on
each prompt alone."""
import asyncio
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
