"""Serving benchmark: ``pagedpack serve`` and, given a vLLM CPU venv, ``vllm serve`` on the same model
with the same requests, one server at a time on this machine, driven by one client.

For each engine: start its server (prefix caching off on both: the schedules repeat prompt texts; a
2 GiB KV pool each: ``--kv-cache-memory`` / ``VLLM_CPU_KVCACHE_SPACE``), send one warm-up request,
then, for each sampling setting of ``--sampling`` (``greedy``, ``t1``: temperature 1.0, the OpenAI
default, ``t0.7_p0.9``) and each load point, ``--num`` requests. Load points: ``--rates`` (Poisson
arrivals, requests/s; ``inf``: all at once) and ``--concurrency`` (all at once, at most C in flight:
saturation). Workloads: ``w1`` (:mod:`serve_load`: W1's prompt lengths cut from English text, 32-128
output tokens) or ``random`` (vLLM's ``random`` dataset: 256 random prompt tokens, 64 output tokens,
``--input-len`` / ``--output-len``); eos ignored, a fixed seed.

Clients: ``--client ours`` (:mod:`serve_load`, streamed completions) or ``--client vllm``: vLLM's own
``vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random`` from the vLLM
venv (``../shared/bench/vllm_cli.py``, SETUP.md section 7), the random workload only. Prints one JSON
object: per engine, sampling and point the request throughput, output tokens/s, TTFT and inter-token
latency p50/p99 (ms), and pagedpack's ratios to vLLM (throughput: higher is better for pagedpack;
latency: lower is). Start at a 1-minute load below 0.8 (reported as ``load_1min``); the client shares
the cores. ``--repeats N`` runs the engines N times, alternating which goes first, and reports each
figure's median over the N runs (and every run's value). ``--speculative-config JSON`` (vLLM's spelling,
given to both servers) runs each engine twice, without and with it (``pagedpack+spec``, ``vllm+spec``),
and reports each engine's ``spec_over_off`` ratios beside pagedpack's over vLLM's, with and without.

vLLM's server is started as a module (``../shared/bench/SETUP.md`` section 6: the wheel's ``vllm``
script fails) with Intel OpenMP preloaded and no reserved core, its best configuration on 2 cores.

``python benchmarks/serve.py [--model smollm2-135m] [--dtype float32] [--rates 0.5,1,2,inf]
  [--concurrency 1,4,16,64] [--sampling greedy,t1] [--workload random] [--client vllm]
  [--vllm-venv PEERS/vllm] [--repeats 1] [--speculative-config '{"method": "ngram", ...}']``
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from pagedpack.serve.remote import RemoteServer, pagedpack_serve_command

from common import cpu_model, load_1min, model_folder
from serve_load import random_schedule, run, schedule

KV_CACHE_GIB = 2  # the KV pool of each server: equal, so that both hold as many requests at once
SAMPLING = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0}, "t0.7_p0.9": {"temperature": 0.7, "top_p": 0.9}}
BENCH_DIR = Path(__file__).resolve().parents[2] / "shared" / "bench"


def _pagedpack(model_dir: str, args, spec: list[str]):
    def command(port):
        return pagedpack_serve_command(model_dir, "--dtype", args.dtype, "--served-model-name", "bench",
                                       "--no-enable-prefix-caching", "--max-model-len", "2048",
                                       "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", *spec, port=port)

    return command, {}


def _vllm(model_dir: str, args, spec: list[str]):
    venv = Path(args.vllm_venv)

    def command(port):
        return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                "--no-enable-prefix-caching", "--served-model-name", "bench", *spec]

    env = {"LD_PRELOAD": str(venv / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return command, env


def _points(args) -> list[tuple[str, float, int | None]]:
    """``(label, rate, max concurrency)`` of every load point."""
    rates = [(f"rate={r}", float(r), None) for r in args.rates.split(",") if r]
    return rates + [(f"concurrency={c}", float("inf"), int(c)) for c in args.concurrency.split(",") if c]


def _vllm_client(url: str, model_dir: str, rate: float, concurrency: int | None, sampling: dict, args) -> dict:
    """One run of vLLM's ``bench serve`` client (the random workload) against ``url``, as :func:`serve_load.run`'s
    figures."""
    with tempfile.TemporaryDirectory() as folder:
        command = [str(Path(args.vllm_venv) / "bin" / "python"), str(args.bench_dir / "vllm_cli.py"), "bench", "serve",
                   "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "bench",
                   "--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
                   "--random-output-len", str(args.output_len), "--num-prompts", str(args.num), "--ignore-eos",
                   "--seed", str(args.seed), "--request-rate", str(rate), "--percentile-metrics", "ttft,itl",
                   "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", folder,
                   "--result-filename", "result.json",
                   *(["--max-concurrency", str(concurrency)] if concurrency else []),
                   *(x for k, v in sampling.items() for x in (f"--{k.replace('_', '-')}", str(v)))]
        # the platform named: vllm-cpu's version string does not say cpu once vllm_cli.py renames it, and vLLM's
        # default platform then loads the AVX-512 kernels (SIGILL on an AVX2 host)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
        result = json.loads((Path(folder) / "result.json").read_text())
    return {"completed": result["completed"], "failed": result.get("failed", args.num - result["completed"]),
            "duration_s": round(result["duration"], 2), "request_throughput": round(result["request_throughput"], 3),
            "output_tokens_per_s": round(result["output_throughput"], 1),
            **{f"{m}_ms_{q}": round(result[f"{'median' if q == 'p50' else 'p99'}_{m}_ms"], 1)
               for m in ("ttft", "itl") for q in ("p50", "p99")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an alias or a Hugging Face directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rates", default="0.5,1,2,inf", help="requests/s, comma-separated; inf: all at once")
    parser.add_argument("--concurrency", default="", help="max requests in flight, comma-separated (saturation)")
    parser.add_argument("--sampling", default="greedy", help=f"comma-separated, of {', '.join(SAMPLING)}")
    parser.add_argument("--workload", default="w1", choices=["w1", "random"])
    parser.add_argument("--client", default="ours", choices=["ours", "vllm"])
    parser.add_argument("--num", type=int, default=48, help="requests per point")
    parser.add_argument("--min-tokens", type=int, default=32, help="w1: the fewest output tokens of a request")
    parser.add_argument("--max-tokens", type=int, default=128, help="w1: the most output tokens of a request")
    parser.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="random: output tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu (../shared/bench/SETUP.md)")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help="the shared benchmark folder")
    parser.add_argument("--engines", default="pagedpack,vllm", help="which to run, in this order")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every engine, the order alternating; figures are the runs' medians")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="each engine also runs with this speculative_config (vLLM's spelling)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected a positive count, got {args.repeats}")
    samplings = args.sampling.split(",")
    if unknown := [s for s in samplings if s not in SAMPLING]:
        parser.error(f"--sampling: expected names of {sorted(SAMPLING)}, got {unknown}")
    if args.client == "vllm" and (args.workload != "random" or not args.vllm_venv):
        parser.error("--client vllm: needs --vllm-venv and --workload random (vLLM's random dataset)")
    load = load_1min()
    model_dir = model_folder(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    points = _points(args)
    plans = {label: schedule(tokenizer, args.num, rate, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                             seed=args.seed) if args.workload == "w1" else
             random_schedule(len(tokenizer), args.num, rate, input_len=args.input_len, output_len=args.output_len,
                             seed=args.seed) for label, rate, _ in points}

    def measure(url: str) -> dict:
        out = {}
        for name in samplings:
            for label, rate, concurrency in points:
                key = f"{name} {label}"
                key += f" ({sum(k.startswith(key) for k in out) + 1})" if key in out else ""  # named twice: both kept
                out[key] = _vllm_client(url, model_dir, rate, concurrency, SAMPLING[name], args) \
                    if args.client == "vllm" else asyncio.run(run(url, "bench", plans[label], concurrency=concurrency,
                                                                  sampling=SAMPLING[name]))
        return out

    makers = {"pagedpack": _pagedpack, **({"vllm": _vllm} if args.vllm_venv else {})}
    spec = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    engines = {f"{name}{suffix}": (make, flags) for name, make in makers.items() if name in args.engines.split(",")
               for suffix, flags in [("", []), *([("+spec", spec)] if spec else [])]}
    order = list(engines)
    runs: dict[str, list[dict]] = {name: [] for name in order}
    for repeat in range(args.repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            make, flags = engines[name]
            command, env = make(model_dir, args, flags)
            with tempfile.TemporaryDirectory() as folder, \
                    RemoteServer(command, log_path=Path(folder) / f"{name}.log", env=env, start_s=600) as server:
                runs[name].append(measure(server.url))
            print(json.dumps({name: runs[name][-1], "repeat": repeat}), flush=True)
    results = {name: _medians(done) for name, done in runs.items()}
    report = {"model": args.model, "dtype": args.dtype, "num": args.num, "workload": args.workload,
              "client": args.client, "repeats": args.repeats, "speculative_config": args.speculative_config,
              "results": results, "load_1min": load,
              "cpus": os.cpu_count(), "machine": platform.machine(), "cpu": cpu_model()}
    if args.workload == "w1":
        report["output_tokens"] = [args.min_tokens, args.max_tokens]
    else:
        report["input_len"], report["output_len"] = args.input_len, args.output_len
    if args.repeats > 1:
        report["every_run"] = runs
    for suffix in ("", "+spec"):
        if f"vllm{suffix}" in results and f"pagedpack{suffix}" in results:
            report[f"pagedpack_over_vllm{suffix}"] = _ratios(results[f"pagedpack{suffix}"], results[f"vllm{suffix}"])
    for name in makers:
        if f"{name}+spec" in results and name in results:
            report[f"{name}_spec_over_off"] = _ratios(results[f"{name}+spec"], results[name])
    print(json.dumps(report, indent=2))


def _ratios(results: dict, base: dict) -> dict:
    """Per point, ``results``' throughput and latency figures over ``base``'s."""
    return {point: {key: _ratio(results[point][key], base[point][key])
                    for key in ("output_tokens_per_s", "request_throughput", "ttft_ms_p50", "ttft_ms_p99",
                                "itl_ms_p50", "itl_ms_p99")} for point in results}


def _medians(runs: list[dict]) -> dict:
    """Per point, each figure's median over ``runs`` (one run: its own figures)."""
    return {point: {key: _median([run[point][key] for run in runs]) for key in runs[0][point]} for point in runs[0]}


def _median(values: list):
    known = sorted(v for v in values if v is not None)
    return round(statistics.median(known), 3) if known else None


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


if __name__ == "__main__":
    main()
