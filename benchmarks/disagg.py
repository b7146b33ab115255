"""Prefill/decode disaggregation against one process, at the same request rate, on this machine.

Two configurations of the same model, one after the other, driven by one client (:mod:`serve_load`: streamed
completions, vLLM's ``random`` dataset shape: ``--input-len`` random prompt token ids, ``--output-len`` tokens
each, eos ignored, greedy, Poisson arrivals at ``--rate`` requests/s, a fixed seed, so both get the same
schedule):

- ``one_process``: ``pagedpack serve MODEL``;
- ``disaggregated``: ``pagedpack serve MODEL --kv-transfer-config`` ``P2pTcpConnector`` as ``kv_producer`` and
  as ``kv_consumer``, behind ``pagedpack disagg-proxy`` (the client talks to the proxy).

Every server gets the same ``--num-blocks``; prefix caching stays on (the prompts are random: no hits). The
four processes start side by side and stay up; each configuration is measured while the other's servers
sit idle (an idle server takes no CPU).
Prints one JSON object: per configuration the completed and failed requests, request throughput, output
tokens/s, TTFT and inter-token latency p50/p99 (ms); for the disaggregated one also the KV transfers
(``/metrics``: requests, bytes, mean ms per transfer, failures, from the consumer's side); the 1-minute load
when it started, the CPU. Both engines of the disaggregated run share the machine's cores (each steps with
threads following the load), so on a small host it measures the transfer's and the proxy's cost more than
disaggregation's gain (which needs an engine per set of cores: docs/disaggregation.md).

``python benchmarks/disagg.py [--model smollm2-135m] [--rate 1] [--num 32] [--input-len 256] [--output-len 32]``;
``--quick``: the built-in tiny model, 8 requests of 64 + 16 tokens at 4/s, to check it runs (48 CPU-seconds
of its processes: under a minute on an idle 2-core host, 93 s at a load of 7.9).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedpack.host.child_process import free_port
from pagedpack.serve.remote import RemoteServer, pagedpack_serve_command

from common import cpu_model, load_1min, model_folder
from serve_load import random_schedule, run


def _serve(model: str, args, *extra: str):
    return lambda port: pagedpack_serve_command(model, "--served-model-name", "bench", "--num-blocks",
                                                str(args.num_blocks), *extra, port=port)


def _connector(role: str, **fields) -> str:
    return json.dumps({"kv_connector": "P2pTcpConnector", "kv_role": role, **fields})


def _transfers(url: str) -> dict:
    """The consumer's KV transfer counters (``/metrics``)."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name.startswith("pagedpack:kv_transfer_") and s.labels.get("direction") == "received":
                values[s.name.removeprefix("pagedpack:kv_transfer_").removesuffix("_total")] = s.value
    requests = values.get("requests", 0)
    return {"requests": int(requests), "bytes": int(values.get("bytes", 0)), "failures": int(values.get("failures", 0)),
            "mean_ms": round(1000 * values.get("seconds", 0) / requests, 2) if requests else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="an alias, a Hugging Face directory or 'tiny'")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--num", type=int, default=32, help="requests per configuration")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=1024, help="each server's KV pool, in blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a configuration's run may take")
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 requests of 64 + 16 tokens at 4/s")
    args = parser.parse_args()
    if args.quick:
        args.model, args.num, args.input_len, args.output_len, args.rate, args.num_blocks = "tiny", 8, 64, 16, 4.0, 256
    for name in ("num", "input_len", "output_len", "num_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not args.rate > 0:
        parser.error(f"--rate: expected requests/s > 0, got {args.rate}")
    load = load_1min()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if args.model == "tiny":  # built in: exported once, so no server captures it again
            from pagedpack import LLM

            model, vocab = str(LLM("tiny", num_blocks=1, keep_source_model=True).export(folder / "tiny.pt2")), 256
        else:
            model = model_folder(args.model)
            from transformers import AutoTokenizer

            vocab = len(AutoTokenizer.from_pretrained(model))
        plan = random_schedule(vocab, args.num, args.rate, input_len=args.input_len, output_len=args.output_len,
                               seed=args.seed)

        def measure(url: str) -> dict:
            return asyncio.run(asyncio.wait_for(run(url, "bench", plan), args.timeout))

        with ExitStack() as stack:  # all four started side by side; an idle server takes no CPU
            def start(command, name: str) -> RemoteServer:
                server = RemoteServer(command, log_path=folder / f"{name}.log", start_s=600)
                stack.callback(server.stop)  # stopped even if another never comes up
                return server

            one = start(_serve(model, args), "one")
            producer = start(_serve(model, args, "--kv-transfer-config",
                                    _connector("kv_producer", kv_port=free_port())), "producer")
            consumer = start(_serve(model, args, "--kv-transfer-config", _connector("kv_consumer")), "consumer")
            proxy = start(lambda port: [sys.executable, "-m", "pagedpack.cli", "disagg-proxy", "--prefill",
                                        producer.url, "--decode", consumer.url, "--port", str(port),
                                        "--log-level", "warning"], "proxy")
            for server in (one, producer, consumer, proxy):
                server.__enter__()  # until /health answers
            results = {"one_process": measure(one.url)}
            results["disaggregated"] = {**measure(proxy.url), "kv_transfers": _transfers(consumer.url)}
    print(json.dumps({"model": args.model, "rate": args.rate, "num": args.num, "input_len": args.input_len,
                      "output_len": args.output_len, "num_blocks": args.num_blocks, "results": results,
                      "load_1min": load, "cpus": os.cpu_count(), "machine": platform.machine(), "cpu": cpu_model()},
                     indent=2))


if __name__ == "__main__":
    main()
