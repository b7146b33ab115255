"""Serving benchmark: ``pagedpack serve`` and, given a vLLM CPU venv, ``vllm serve`` on the same model
with the same request schedule (:mod:`serve_load`), one server at a time on this machine.

For each engine: start its server (prefix caching off on both: the schedule repeats its prompt
texts; a 2 GiB KV pool each: ``--kv-cache-memory`` / ``VLLM_CPU_KVCACHE_SPACE``), send one warm-up
request, then for each ``--rates`` value ``--num`` requests (Poisson arrivals, ``inf``: all at once)
with W1's prompt lengths cut from English text and 32-128 greedy output tokens each (eos ignored), a
fixed seed. Prints one JSON object: per engine and rate the request throughput, output tokens/s,
TTFT and inter-token latency p50/p99 (ms), and per rate pagedpack's ratios to vLLM (throughput:
higher is better for pagedpack; latency: lower is). Start at a 1-minute load below 0.8 (reported as
``load_1min``); the client shares the cores. ``--repeats N`` runs the engines N times, alternating
which goes first, and reports each figure's median over the N runs (and every run's value): on
this machine kind one run's TTFT p50 moved by up to a third from one invocation to the next.

vLLM's server is started as a module (``../shared/bench/SETUP.md`` §6: the wheel's ``vllm`` script
fails) with Intel OpenMP preloaded and no reserved core, its best configuration on 2 cores.

``python benchmarks/serve.py [--model smollm2-135m] [--dtype float32] [--rates 0.5,1,2,inf]
  [--vllm-venv /tmp/peers/vllm] [--repeats 1]``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from pagedpack.serve.remote import RemoteServer, pagedpack_serve_command

from common import cpu_model, load_1min
from serve_load import run, schedule

KV_CACHE_GIB = 2  # the KV pool of each server: equal, so that both hold as many requests at once


def _model_dir(model: str) -> str:
    if Path(model).is_dir():
        return model
    from pagedpack.models import aliases

    return str(aliases.fetch(model))


def _pagedpack(model_dir: str, args):
    def command(port):
        return pagedpack_serve_command(model_dir, "--dtype", args.dtype, "--served-model-name", "bench",
                                       "--no-enable-prefix-caching", "--max-model-len", "2048",
                                       "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", port=port)

    return command, {}


def _vllm(model_dir: str, args):
    venv = Path(args.vllm_venv)

    def command(port):
        return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                "--no-enable-prefix-caching", "--served-model-name", "bench"]

    env = {"LD_PRELOAD": str(venv / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return command, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an alias or a Hugging Face directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rates", default="0.5,1,2,inf", help="requests/s, comma-separated; inf: all at once")
    parser.add_argument("--num", type=int, default=48, help="requests per rate")
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu (../shared/bench/SETUP.md)")
    parser.add_argument("--engines", default="pagedpack,vllm", help="which to run, in this order")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every engine, the order alternating; figures are the runs' medians")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected a positive count, got {args.repeats}")
    load = load_1min()
    model_dir = _model_dir(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rates = [float(r) for r in args.rates.split(",")]
    plans = {rate: schedule(tokenizer, args.num, rate, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                            seed=args.seed) for rate in rates}
    engines = {"pagedpack": _pagedpack}
    if args.vllm_venv:
        engines["vllm"] = _vllm
    order = [e for e in args.engines.split(",") if e in engines]
    runs: dict[str, list[dict]] = {name: [] for name in order}
    for repeat in range(args.repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            command, env = engines[name](model_dir, args)
            with tempfile.TemporaryDirectory() as folder, \
                    RemoteServer(command, log_path=Path(folder) / f"{name}.log", env=env, start_s=600) as server:
                runs[name].append({str(rate): asyncio.run(run(server.url, "bench", plans[rate])) for rate in rates})
            print(json.dumps({name: runs[name][-1], "repeat": repeat}), flush=True)
    results = {name: _medians(done) for name, done in runs.items()}
    report = {"model": args.model, "dtype": args.dtype, "num": args.num,
              "output_tokens": [args.min_tokens, args.max_tokens], "repeats": args.repeats, "results": results,
              "load_1min": load, "cpus": os.cpu_count(), "machine": platform.machine(), "cpu": cpu_model()}
    if args.repeats > 1:
        report["every_run"] = runs
    if "vllm" in results and "pagedpack" in results:
        report["pagedpack_over_vllm"] = {
            rate: {key: _ratio(results["pagedpack"][rate][key], results["vllm"][rate][key])
                   for key in ("output_tokens_per_s", "request_throughput", "ttft_ms_p50", "ttft_ms_p99",
                               "itl_ms_p50", "itl_ms_p99")}
            for rate in results["pagedpack"]}
    print(json.dumps(report, indent=2))


def _medians(runs: list[dict]) -> dict:
    """Per rate, each figure's median over ``runs`` (one run: its own figures)."""
    return {rate: {key: _median([run[rate][key] for run in runs]) for key in runs[0][rate]} for rate in runs[0]}


def _median(values: list):
    known = sorted(v for v in values if v is not None)
    return round(statistics.median(known), 3) if known else None


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


if __name__ == "__main__":
    main()
