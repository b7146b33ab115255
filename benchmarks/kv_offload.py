"""KV offload benchmark: the seed design's load test over ``pagedpack serve`` with the offload tier off,
on, and on with the watermark (docs/kv-offload.md).

Workload: ``--num-prefixes`` system prompts of ``--prefix-len`` random token ids (lengths drawn in
``[lo, hi]``), each request one of them plus ``--suffix-len`` tokens of its own, streamed with
``--max-tokens`` tokens, eos ignored, greedy, through the project's own client
(:func:`serve_load.run`: TTFT and inter-token gaps as chunks arrive). The KV pool is sized to
``--pool-fraction`` of the prefixes' tokens plus one block per request's own tokens (``--num-blocks``),
so the shared prefixes do not all fit and the tier matters. For each configuration a fresh server is
started; each concurrency in ``--concurrency`` sends ``--requests-per-concurrency`` x concurrency
requests at once (at most that many in flight). Reported per point: prefix hit rate (tokens found in the
pool or loaded from the tier / tokens looked up, from ``/metrics``), tier hit rate, request and output
token throughput, TTFT p50/p99, ITL p99, and the tier's counters. One JSON object on stdout.

``python benchmarks/kv_offload.py [--model smollm2-135m] [--concurrency 50,80,100,150]`` (long: minutes
per point on 2 cores); ``--quick``: the built-in tiny model, small numbers (three server starts: about a
minute on a quiet host). ``--swap-vs-recompute``: instead, in this process, the time per block to
recompute (prefill of 512 tokens, best of 3) against copying out and storing, and loading back, with the
host and the disk tier (the figures behind docs/kv-offload.md's rule).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import tempfile
import time
from pathlib import Path

import httpx

from pagedpack.serve.remote import RemoteServer, pagedpack_serve_command

from common import cpu_model, load_1min
from serve_load import Scheduled, run

METRIC = re.compile(r"^pagedpack:(\w+?)(?:_total)?\{([^}]*)\} (\S+)$", re.M)


def _prompts(args) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(args.seed)
    lo, hi = args.prefix_len
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_prefixes)]
    return prefixes, [[rng.randrange(3, 250) for _ in range(args.suffix_len)] for _ in range(4096)]


def _metrics(url: str) -> dict[str, float]:
    """The server's counters summed over their labels (``name`` or ``name:medium``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name, labels, value in METRIC.findall(text):
        medium = re.search(r'medium="(\w+)"', labels)
        key = f"{name}:{medium.group(1)}" if medium else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _point(url: str, prefixes, suffixes, concurrency: int, args, rng: random.Random) -> dict:
    requests = [Scheduled(prefixes[rng.randrange(len(prefixes))] + suffixes[rng.randrange(len(suffixes))],
                          args.max_tokens, 0.0) for _ in range(args.requests_per_concurrency * concurrency)]
    before = _metrics(url)
    figures = asyncio.run(run(url, "bench", requests, concurrency=concurrency, timeout_s=args.timeout))
    moved = _delta(_metrics(url), before)
    queries = moved.get("prefix_cache_queries", 0.0)
    local, external = moved.get("prefix_cache_hits", 0.0), moved.get("external_prefix_cache_hits", 0.0)
    figures |= {"prefix_hit_rate": round((local + external) / queries, 3) if queries else None,
                "tier_hit_rate": round(external / queries, 3) if queries else None,
                "preemptions": moved.get("num_preemptions", 0.0),
                "tier": {k.removeprefix("kv_offload_"): round(v, 4) for k, v in moved.items()
                         if k.startswith("kv_offload_")}}
    return figures


def swap_vs_recompute(model: str, num_tokens: int = 512) -> dict:
    """Milliseconds per KV block (module docstring)."""
    import hashlib

    from pagedpack import LLM, SamplingParams
    from pagedpack.runtime.kv_connector.offload_tier import DiskTier, HostTier, gather_blocks, scatter_block

    llm = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=num_tokens,
              num_blocks=2 * num_tokens // 16 + 8, block_size=16)
    prompt, params = [(i * 7919) % 200 + 3 for i in range(num_tokens)], SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompt], params, use_tqdm=False)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    caches, ids = llm.llm_engine.runner.kv_caches, list(range(num_tokens // 16))
    hashes = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in ids]
    out = {"model": model, "block_size": 16, "recompute_ms": round(min(times) / len(ids) * 1e3, 3)}
    with tempfile.TemporaryDirectory() as folder:
        for name, tier in (("host", HostTier(1 << 34)), ("disk", DiskTier(1 << 34, folder))):
            tier.bind_layout(caches)
            start = time.perf_counter()
            tier.put(hashes, gather_blocks(caches, ids))
            if name == "disk":
                tier.flush()
            out[f"{name}_save_ms"] = round((time.perf_counter() - start) / len(ids) * 1e3, 3)
            start = time.perf_counter()
            for block_hash, block_id in zip(hashes, ids):
                scatter_block(caches, block_id, tier.get(block_hash))
            out[f"{name}_load_ms"] = round((time.perf_counter() - start) / len(ids) * 1e3, 3)
            tier.close()
        out["block_bytes"] = tier.block_bytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", default="50,80,100,150")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", default="1024,2048", help="lo,hi tokens of a system prompt")
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-concurrency", type=int, default=2)
    parser.add_argument("--pool-fraction", type=float, default=0.5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-offload-size", default="4GiB")
    parser.add_argument("--kv-offload-dir", default=None, help="default: a temporary folder (disk tier)")
    parser.add_argument("--host-tier", action="store_true", help="keep the tier in host memory, not on disk")
    parser.add_argument("--watermark", type=float, default=0.3)
    parser.add_argument("--configs", default="off,on,on+watermark")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds, per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, small numbers: checks it runs")
    parser.add_argument("--swap-vs-recompute", action="store_true",
                        help="measure per-block recompute vs save and load times of --model (no server)")
    args = parser.parse_args()
    if args.swap_vs_recompute:
        print(json.dumps({**swap_vs_recompute(args.model), "load_1min": load_1min(), "cpu": cpu_model()}))
        return
    if args.quick:
        args.model, args.concurrency, args.num_prefixes, args.prefix_len = "tiny", "8", 4, "96,128"
        args.suffix_len, args.max_tokens, args.requests_per_concurrency, args.timeout = 8, 8, 2, 60.0
        args.kv_offload_size = "16MiB"
    args.prefix_len = tuple(int(x) for x in args.prefix_len.split(","))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prefixes, suffixes = _prompts(args)
    per_request = -(-(args.suffix_len + args.max_tokens) // args.block_size)
    num_blocks = int(args.pool_fraction * sum(len(p) for p in prefixes) / args.block_size) + \
        per_request * max(concurrencies)
    max_len = max(len(p) for p in prefixes) + args.suffix_len + args.max_tokens
    report = {"model": args.model, "num_blocks": num_blocks, "block_size": args.block_size,
              "prefix_tokens": [len(p) for p in prefixes], "suffix_len": args.suffix_len,
              "max_tokens": args.max_tokens, "kv_offload_size": args.kv_offload_size,
              "tier": "host" if args.host_tier else "disk", "watermark": args.watermark, "load_1min": load_1min(),
              "cpus": os.cpu_count(), "machine": platform.machine(), "cpu": cpu_model(), "results": {}}
    start = time.perf_counter()
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as folder:
            extra = []
            if config != "off":
                extra = ["--kv-offload-size", args.kv_offload_size]
                if not args.host_tier:
                    extra += ["--kv-offload-dir", args.kv_offload_dir or str(Path(folder) / "tier")]
                if config == "on+watermark":
                    extra += ["--kv-offload-watermark", str(args.watermark)]

            def command(port, extra=extra):
                return pagedpack_serve_command("--model", args.model, "--served-model-name", "bench",
                                               "--block-size", str(args.block_size), "--num-blocks", str(num_blocks),
                                               "--max-model-len", str(max_len), "--max-num-seqs",
                                               str(max(concurrencies)), *extra, port=port)

            rng = random.Random(args.seed)
            with RemoteServer(command, log_path=Path(folder) / "server.log", start_s=600) as server:
                report["results"][config] = {
                    str(c): _point(server.url, prefixes, suffixes, c, args, rng) for c in concurrencies}
        print(json.dumps({config: report["results"][config]}), flush=True)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
