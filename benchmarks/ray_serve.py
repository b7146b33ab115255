"""pagedpack on Ray Serve: prefix-aware routing vs round-robin, side by side in one run.

Workload: ``--model`` (default smollm2-135m) on ``--replicas`` (2) engine replicas
(``pagedpack.serve.ray_app``, one Ray CPU each) of a Ray cluster this script starts for itself
(``ray.init(address="local")``, never another's). ``--prefixes`` (8) shared prefixes of
``--prefix-len`` (256) tokens of English prose, each followed by ``--requests-per-prefix`` (8)
unique ``--suffix-len`` (16) token questions; sent in rounds (a request of every prefix at once,
in a seeded random order, then the next round), each streamed by the ``openai`` client,
``--max-tokens`` (8) greedy tokens. Each replica's KV pool holds ``--num-blocks`` (112)
blocks, fewer than the prefixes need together (8 x 16 at the defaults), as when a deployment's
prefixes outnumber what one replica caches (with room for all of them on every replica, any
router ends up hitting). For each router (the application deployed afresh, one warm-up request
per replica first): the prefix-cache hit rate (hits / queries, in prompt tokens, from the
replicas' own counters over the workload), the median and p90 time to first token (TTFT: request
sent to first streamed token, client side) and the wall time. Prints one
JSON object, with the 1-minute load at the start.
Run: ``python benchmarks/ray_serve.py [--model smollm2-135m]``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import time

import openai
import ray
from ray import serve

from pagedpack.engine_args import EngineArgs
from pagedpack.host.child_process import free_port
from pagedpack.models.aliases import resolve
from pagedpack.models.loading import load_tokenizer
from pagedpack.serve.openai_serving import ServingConfig
from pagedpack.serve.ray_app import APP_NAME, RayServeOptions, pagedpack_app, prefix_cache_counters

from common import cpu_model, english_text, load_1min


def workload(args) -> list[list[list[int]]]:
    """Rounds of prompts (token ids): round i holds request i of every prefix, in an order of its
    own (seeded), so that no router keeps a prefix on one replica by the order alone."""
    ids = load_tokenizer(resolve(args.model))(english_text())["input_ids"]
    width = args.prefix_len + args.requests_per_prefix * args.suffix_len
    prefixes = [ids[p * width:p * width + args.prefix_len] for p in range(args.prefixes)]
    rounds = [[prefix + ids[p * width + args.prefix_len + i * args.suffix_len:][:args.suffix_len]
               for p, prefix in enumerate(prefixes)] for i in range(args.requests_per_prefix)]
    order = random.Random(0)
    return [order.sample(prompts, len(prompts)) for prompts in rounds]


async def ttft_s(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    stream = await client.completions.create(model="model", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def run_rounds(url: str, rounds, max_tokens: int) -> list[float]:
    times = []
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        for prompts in rounds:
            times += await asyncio.gather(*(ttft_s(client, p, max_tokens) for p in prompts))
    return times


def measure(args, router: str, rounds, port: int) -> dict:
    options = RayServeOptions(data_parallel_size=args.replicas, request_router=router, num_cpus=1.0,
                              routing_stats_period_s=1.0)
    engine_args = EngineArgs(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks)
    app = pagedpack_app(engine_args, ServingConfig("model"), options)
    serve.run(app, name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    try:
        warm = [[list(range(300 + 10 * r, 310 + 10 * r))] for r in range(args.replicas)]
        asyncio.run(run_rounds(url, warm, args.max_tokens))
        queries, hits = prefix_cache_counters()
        start = time.perf_counter()
        times = asyncio.run(run_rounds(url, rounds, args.max_tokens))
        wall = time.perf_counter() - start
        queries2, hits2 = prefix_cache_counters()
    finally:
        serve.delete(APP_NAME)
    ms = sorted(t * 1e3 for t in times)
    return {"prefix_cache_hit_rate": round((hits2 - hits) / max(1, queries2 - queries), 3),
            "prefix_cache_queries": queries2 - queries, "prefix_cache_hits": hits2 - hits,
            "ttft_ms_p50": round(statistics.median(ms), 1), "ttft_ms_p90": round(ms[int(0.9 * (len(ms) - 1))], 1),
            "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias or Hugging Face directory")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--requests-per-prefix", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=112, help="each replica's KV pool, in blocks")
    parser.add_argument("--routers", default="prefix-aware,round-robin", help="comma-separated, in this order")
    args = parser.parse_args()
    load = load_1min()
    rounds = workload(args)
    port = free_port()
    # token auth kept (Ray's default for a new local cluster) with a token of this run's own: a new cluster
    # otherwise writes ~/.ray/auth_token, and every `ray start` on the host then requires it
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # workers: this Python (sys.executable)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        results = {router: measure(args, router, rounds, port) for router in args.routers.split(",")}
    finally:  # the cluster is this run's own: stopped whole (serve.shutdown would print a raylet line to stdout)
        ray.shutdown()
    print(json.dumps({"model": args.model, "replicas": args.replicas, "prefixes": args.prefixes,
                      "requests_per_prefix": args.requests_per_prefix, "prefix_len": args.prefix_len,
                      "suffix_len": args.suffix_len, "max_tokens": args.max_tokens, "block_size": args.block_size,
                      "num_blocks": args.num_blocks, "load_1min_at_start": load, "cpu": cpu_model(),
                      "python": sys.version.split()[0],
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
