"""Soak run of ``pagedpack serve`` (localhost only, bounded in count and time): many requests over
minutes at a fraction of the measured saturation rate, with random cancellations, random ``n``,
streamed and whole answers, and a few bad requests. Prints one JSON object.

Checks, each reported: every request got a complete answer (each of its ``n`` completions with one
finish reason, ``max_tokens`` tokens: eos is ignored; a stream ends with ``[DONE]``), a clean 400
(the bad ones), or was cancelled by its client; none lost (an error, a timeout, a missing
``[DONE]``) and none answered twice (response ids unique); the server's RSS after warm-up, at its
peak, at each minute of the soak and at the end (growth = end / after warm-up; and end / after the
soak's own first minute, whose mix of n, cancellations and step sizes the warm-up lacks); running /
waiting requests and KV usage back to 0 at the end (``/metrics``).

Poison requests (2 %): sampling values at the edge of what validation lets through (issue 51's:
``top_p`` 1e-46, ``repetition_penalty`` rounded to 0 by float32 or dividing a biased logit to
infinity, every token a stop token until ``min_tokens``): each must get a 400, its own error, or
its answer, and no other request may lose its answer. Stalled clients (``--stalled-clients``, at
the start): a stream of ``n=200, max_tokens=1000, logprobs=20`` whose client reads nothing for
``--stall-seconds`` and then closes; the server pauses it (backpressure) and aborts it after its
stall timeout: its RSS growth while held is reported (``stalled_rss_mib``), and the RSS at the end
must come back within the soak's own growth.

Saturation: ``--saturation-num`` requests all at once (the ``serve_load`` schedule); the soak rate
is ``--load`` times that request throughput, divided by the soak requests' mean ``n``, unless
``--rate`` is given.

``python benchmarks/soak.py [--model smollm2-135m] [--num 2000] [--minutes 10] [--load 0.9]``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pagedpack.serve.remote import RemoteServer, pagedpack_serve_command

from common import load_1min
from serve_load import run, schedule, stream_one

N_CHOICES = (1, 1, 2, 3)  # n of a request, drawn uniformly
MEAN_N = sum(N_CHOICES) / len(N_CHOICES)
BAD = ({"temperature": -1}, {"top_p": 0}, {"n": 0}, {"max_tokens": "many"}, {"logprobs": 99})
POISON = ({"top_p": 1e-46}, {"repetition_penalty": 1e-40}, {"repetition_penalty": 1.2e-38, "logit_bias": {"7": 100}},
          {"stop_token_ids": list(range(49152)), "min_tokens": 3}, {"temperature": 1e-300, "min_p": 5e-324})


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class RssWatch:
    """Samples the server's RSS every ``period_s`` in a thread: ``peak`` since :meth:`reset`, and
    ``minutes``: the RSS at each whole minute since then (is growth a plateau or a leak?)."""

    def __init__(self, pid: int, period_s: float = 0.5):
        self.pid, self.period_s, self.peak, self._stop = pid, period_s, 0, threading.Event()
        self.minutes: list[int] = []
        self._start = time.monotonic()
        threading.Thread(target=self._run, daemon=True).start()

    def reset(self) -> int:
        self.peak = now = rss_bytes(self.pid)
        self.minutes, self._start = [], time.monotonic()
        return now

    def _run(self):
        while not self._stop.wait(self.period_s):
            now = rss_bytes(self.pid)
            self.peak = max(self.peak, now)
            if time.monotonic() - self._start >= 60 * (len(self.minutes) + 1):
                self.minutes.append(now)

    def stop(self):
        self._stop.set()


async def one(http: httpx.AsyncClient, i: int, prompt: str, rng: random.Random, tally: dict) -> None:
    """Request ``i``: bad (2%), cancelled after a random wait (10%), else answered in whole or streamed."""
    n, max_tokens, stream = rng.choice(N_CHOICES), rng.randint(16, 64), rng.random() < 0.7
    body = {"model": "soak", "prompt": prompt, "n": n, "max_tokens": max_tokens, "stream": stream,
            "temperature": rng.choice((0.0, 0.8)), "seed": i, "ignore_eos": True}
    roll = rng.random()
    if roll < 0.02:
        response = await http.post("/v1/completions", json={**body, **rng.choice(BAD)})
        ok = response.status_code == 400 and response.json()["error"]["param"]
        tally["bad_refused" if ok else "lost"] += 1
        return
    if roll > 0.98:  # a poison request: refused, failed alone, or answered (never another's loss)
        response = await http.post("/v1/completions", json={**body, "stream": False, **rng.choice(POISON)})
        outcome = {400: "poison_refused", 500: "poison_failed_alone", 200: "poison_served"}.get(response.status_code)
        tally[outcome or "lost"] = tally.get(outcome or "lost", 0) + 1
        return
    work = asyncio.ensure_future(_answer(http, body, stream))
    if roll < 0.12:
        await asyncio.sleep(rng.uniform(0.0, 3.0))
        if not work.done():
            work.cancel()
            tally["cancelled"] += 1
            return
    try:
        response_id, complete = await work
    except (httpx.HTTPError, asyncio.TimeoutError, KeyError, ValueError) as err:
        tally["lost"] += 1
        tally.setdefault("errors", []).append(f"{type(err).__name__}: {err}"[:200])
        return
    if response_id in tally["ids"]:
        tally["duplicated"] += 1
    tally["ids"].add(response_id)
    tally["complete" if complete(n, max_tokens) else "lost"] += 1


async def _answer(http: httpx.AsyncClient, body: dict, stream: bool):
    """``(response id, check(n, max_tokens))`` of one request."""
    if not stream:
        response = (await http.post("/v1/completions", json=body)).raise_for_status().json()
        choices = response["choices"]
        return response["id"], lambda n, m: (len(choices) == n and all(c["finish_reason"] == "length" for c in choices)
                                             and response["usage"]["completion_tokens"] == n * m)
    extra = {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens")}
    r = await stream_one(http, body["model"], body["prompt"], body["max_tokens"], **extra)
    if not r["ok"]:
        raise ValueError(f"stream failed: {r['error']}")
    return r["id"], lambda n, m: (r["done"] and r["tokens"] == n * m and sorted(r["finish_reasons"]) == list(range(n))
                                  and all(f == ["length"] for f in r["finish_reasons"].values()))


async def stalled_client(port: int, seconds: float) -> None:
    """A stream of 200 completions of 1,000 tokens with logprobs whose client reads nothing for
    ``seconds``, then closes."""
    body = json.dumps({"model": "soak", "prompt": "Once upon a time", "n": 200, "max_tokens": 1000, "logprobs": 20,
                       "stream": True, "ignore_eos": True}).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await asyncio.sleep(seconds)
    writer.close()


async def soak(url: str, prompts: list[str], rate: float, num: int, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    tally = {"complete": 0, "cancelled": 0, "bad_refused": 0, "lost": 0, "duplicated": 0, "ids": set()}
    start, tasks = time.monotonic(), []
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as http:
        for i in range(num):
            if time.monotonic() - start > seconds:
                break
            tasks.append(asyncio.create_task(one(http, i, prompts[i % len(prompts)], random.Random(rng.random()),
                                                 tally)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    tally["sent"], tally["duration_s"] = len(tasks), round(time.monotonic() - start, 1)
    del tally["ids"]
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num", type=int, default=2000, help="most requests")
    parser.add_argument("--minutes", type=float, default=10.0, help="most minutes of sending")
    parser.add_argument("--load", type=float, default=0.9, help="fraction of the saturation rate")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default: --load x saturation)")
    parser.add_argument("--saturation-num", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stalled-clients", type=int, default=1, help="never-reading streams at the start")
    parser.add_argument("--stall-seconds", type=float, default=60.0, help="how long each holds its stream")
    args = parser.parse_args()
    load = load_1min()
    with tempfile.TemporaryDirectory() as folder, RemoteServer(
            lambda port: pagedpack_serve_command(args.model, "--served-model-name", "soak", port=port),
            log_path=Path(folder) / "server.log", start_s=600) as server:
        from transformers import AutoTokenizer

        from pagedpack.models import aliases

        model_dir = args.model if Path(args.model).is_dir() else str(aliases.fetch(args.model))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        saturation = asyncio.run(run(server.url, "soak", schedule(tokenizer, args.saturation_num, float("inf"),
                                                                  min_tokens=16, max_tokens=64, seed=args.seed)))
        # saturation was measured with n = 1: a soak request is MEAN_N completions of as many tokens
        rate = args.rate or args.load * saturation["request_throughput"] / MEAN_N
        watch = RssWatch(server.process.pid)
        after_warmup = watch.reset()
        stalled = {}
        if args.stalled_clients:
            asyncio.run(_stall(server.port, args.stalled_clients, args.stall_seconds))
            stalled = {"held_peak": watch.peak >> 20, "after_close": rss_bytes(server.process.pid) >> 20}
        prompts = [s.prompt for s in schedule(tokenizer, 64, float("inf"), min_tokens=1, max_tokens=1)]
        tally = asyncio.run(soak(server.url, prompts, rate, args.num, args.minutes * 60, args.seed))
        time.sleep(1.0)
        end, peak, minutes = rss_bytes(server.process.pid), watch.peak, [m >> 20 for m in watch.minutes]
        watch.stop()
        metrics = httpx.get(f"{server.url}/metrics").text
        idle = {name: _sample(metrics, f"pagedpack:{name}") for name in
                ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        crashed = "Traceback" in server.log
    print(json.dumps({"model": args.model, "saturation": saturation, "rate": round(rate, 3), **tally,
                      "rss_mib": {"after_warmup": after_warmup >> 20, "peak": peak >> 20, "end": end >> 20,
                                  "growth": round(end / after_warmup - 1, 4), "each_minute": minutes,
                                  "growth_after_first_minute": round(end / (minutes[0] << 20) - 1, 4)
                                  if minutes else None},
                      "stalled_rss_mib": {"clients": args.stalled_clients, "seconds": args.stall_seconds,
                                          "before": after_warmup >> 20, **stalled},
                      "at_end": idle, "server_traceback": crashed, "load_1min": load}, indent=2))


async def _stall(port: int, clients: int, seconds: float) -> None:
    await asyncio.gather(*(stalled_client(port, seconds) for _ in range(clients)))
    await asyncio.sleep(2.0)  # the server sees the closes and lets the requests go


def _sample(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


if __name__ == "__main__":
    main()
