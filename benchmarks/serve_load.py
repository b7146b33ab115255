"""One load generator for every OpenAI-compatible server (``pagedpack serve``, ``vllm serve``): the
schedule of ``../shared/bench/serve_client.py``, with per-request output lengths.

Prompts (:func:`schedule`): W1's lengths (32, 50, 128, 256, 512, 64, 16, 256, repeated) cut as token
ids from Python's own documentation (``pydoc_data.topics``) through the model's tokenizer and sent as
text, each ``max_tokens`` drawn from ``[min_tokens, max_tokens]``; or (:func:`random_schedule`) vLLM's
``random`` dataset's shape: ``input_len`` random token ids, ``output_len`` tokens each. Each request
streams tokens with eos ignored, greedy unless ``sampling`` says otherwise. Arrivals: Poisson at
``rate`` requests/s (``inf``: all at once), at most ``concurrency`` in flight when given. Every draw
comes from one ``random.Random(seed)``, so each server gets the same schedule.

Measured per request: TTFT (request sent to the first chunk with text) and the gaps between
chunks with text (inter-token latency), as the shared client measures them.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

LENGTHS = (32, 50, 128, 256, 512, 64, 16, 256)


@dataclass(frozen=True)
class Scheduled:
    prompt: str | list[int]
    max_tokens: int
    delay_s: float  # after the previous request was sent


def schedule(tokenizer, num: int, rate: float, *, min_tokens: int, max_tokens: int, seed: int = 0) -> list[Scheduled]:
    """``num`` requests as :mod:`this module <serve_load>` describes them."""
    import pydoc_data.topics as topics

    ids = tokenizer(" ".join(topics.topics[k] for k in sorted(topics.topics))).input_ids
    rng, out, offset = random.Random(seed), [], 0
    for i in range(num):
        length = LENGTHS[i % len(LENGTHS)]
        prompt = tokenizer.decode(ids[offset:offset + length])
        offset = (offset + length + 17) % (len(ids) - 600)
        delay = 0.0 if rate == float("inf") else rng.expovariate(rate)
        out.append(Scheduled(prompt, rng.randint(min_tokens, max_tokens), delay))
    return out


def random_schedule(vocab_size: int, num: int, rate: float, *, input_len: int, output_len: int,
                    seed: int = 0) -> list[Scheduled]:
    """``num`` prompts of ``input_len`` random token ids below ``vocab_size``, ``output_len`` tokens each."""
    rng = random.Random(seed)
    return [Scheduled([rng.randrange(vocab_size) for _ in range(input_len)], output_len,
                      0.0 if rate == float("inf") else rng.expovariate(rate)) for _ in range(num)]


async def stream_one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    """One streamed completion (greedy unless ``extra`` says otherwise): ``{"ok", "id", "ttft_s", "itl_s",
    "tokens", "finish_reasons" (each choice's, in order), "done" ([DONE] came), "text"}`` (``ok`` False with
    ``error`` for an HTTP error or an error event)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    start, stamps, text, usage, finish = time.perf_counter(), [], {}, None, {}
    response_id, done = None, False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code, "error": (await response.aread()).decode()[:300]}
        async for line in response.aiter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "status": 200, "error": chunk["error"]}
            response_id, usage = chunk.get("id", response_id), chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
                if choice.get("finish_reason"):
                    finish.setdefault(choice["index"], []).append(choice["finish_reason"])
    if not stamps:
        return {"ok": False, "status": 200, "error": "no text came"}
    return {"ok": True, "id": response_id, "ttft_s": stamps[0] - start,
            "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": usage["completion_tokens"] if usage else len(stamps), "finish_reasons": finish, "done": done,
            "text": text}


async def run(url: str, model: str, requests: list[Scheduled], *, timeout_s: float = 1800.0,
              headers: dict | None = None, concurrency: int | None = None, sampling: dict | None = None) -> dict:
    """Send ``requests`` on their schedule (at most ``concurrency`` in flight; ``sampling``: the body's
    sampling fields, e.g. ``{"temperature": 1.0}``, greedy without); the figures of the run (times in ms)."""
    gate = asyncio.Semaphore(concurrency or len(requests))

    async def one(r):
        async with gate:
            return await stream_one(http, model, r.prompt, r.max_tokens, **(sampling or {}))

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=headers,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as http:
        await stream_one(http, model, requests[0].prompt, 4)  # warm-up
        tasks, start = [], time.perf_counter()
        for r in requests:
            if r.delay_s:
                await asyncio.sleep(r.delay_s)
            tasks.append(asyncio.create_task(one(r)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
    ok = [r for r in results if isinstance(r, dict) and r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    itl = [x for r in ok for x in r["itl_s"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 2),
            "request_throughput": round(len(ok) / duration, 3), "output_tokens_per_s": round(tokens / duration, 1),
            "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p99": percentile(ttft, 0.99),
            "itl_ms_p50": percentile(itl, 0.5), "itl_ms_p99": percentile(itl, 0.99)}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (seconds) in ms, as the shared client takes it."""
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else None
