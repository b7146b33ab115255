"""Latency of a request that arrives while others run, against the same request in an idle engine.

The probe (a ``--probe-len``-token prompt, ``--max-tokens`` greedy tokens) is added to an engine
where ``--background`` requests are already decoding (their prompts prefilled, each with enough
tokens left to outlast the probe), and to the same engine idle. Reported per case: time to first
token (from ``add_request`` to the delta with the probe's first token: its prefill, chunked by
``--max-num-batched-tokens``, shares steps with the others' decode), time per output token after
the first (mean of the probe's inter-token gaps) and the background requests' own time per output
token while the probe prefills. Best of ``--runs`` after one warm-up, prefix caching off (every
run repeats the prompts). Steps run in this thread, as ``LLM.generate`` runs them. Prints one JSON
object; start only when the 1-minute load is below 0.8 (reported as ``load_1min``).

``python benchmarks/latency.py [--model tiny|smollm2-135m|DIR] [--background 31] [--probe-len 512]``
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from pagedpack import LLM, SamplingParams

from common import load_1min


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="an alias (tiny, smollm2-135m, gemma3-270m) or a directory")
    parser.add_argument("--background", type=int, default=31, help="requests decoding when the probe arrives")
    parser.add_argument("--background-len", type=int, default=128, help="their prompt length")
    parser.add_argument("--probe-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32, help="the probe's greedy tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    load = load_1min()
    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.background + 1,
              enable_prefix_caching=False)
    vocab = min(llm.vocab_size, 256)
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(0, vocab, (args.probe_len,), generator=g).tolist()
    background = [torch.randint(0, vocab, (args.background_len,), generator=g).tolist()
                  for _ in range(args.background)]
    results = {}
    for case, others in (("idle", []), (f"behind {args.background} decoding", background)):
        _run(llm, probe, others, args)  # warm-up
        runs = [_run(llm, probe, others, args) for _ in range(args.runs)]
        results[case] = {key: round(min(r[key] for r in runs), 2) for key in runs[0]}
    print(json.dumps({"model": args.model, "probe_len": args.probe_len, "max_tokens": args.max_tokens,
                      "max_num_batched_tokens": args.max_num_batched_tokens, "cases_ms": results,
                      "ttft_ratio": round(results[f"behind {args.background} decoding"]["ttft"]
                                          / results["idle"]["ttft"], 2),
                      "tpot_ratio": round(results[f"behind {args.background} decoding"]["tpot"]
                                          / results["idle"]["tpot"], 2),
                      "load_1min": load, "threads": torch.get_num_threads(), "machine": platform.machine(),
                      "torch": torch.__version__}, indent=2))


def _run(llm: LLM, probe: list[int], others: list[list[int]], args) -> dict:
    """One probe; times in milliseconds."""
    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=4 * args.max_tokens + 64, ignore_eos=True)
    for i, prompt in enumerate(others):
        engine.add_request(f"bg{i}", {"prompt_token_ids": prompt}, long)
    while others and not all(len(o) for o in _outputs(engine, others)):  # every background request decodes
        engine.step()
    start = time.perf_counter()
    engine.add_request("probe", {"prompt_token_ids": probe},
                       SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    stamps, background_tokens, first = [], 0, None
    while not stamps or len(stamps) < args.max_tokens:
        for delta in engine.step():
            if delta.request_id == "probe":
                stamps += [time.perf_counter()] * len(delta.outputs[0].token_ids)
            elif first is None:
                background_tokens += len(delta.outputs[0].token_ids)
        if stamps and first is None:
            first = (stamps[0] - start, background_tokens)
    for i in range(len(others)):
        engine.abort_request(f"bg{i}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    per_background = first[0] / max(1, first[1] / max(1, len(others))) if others else 0.0
    return {"ttft": 1e3 * first[0], "tpot": 1e3 * sum(gaps) / len(gaps),
            "background_tpot_during_prefill": 1e3 * per_background}


def _outputs(engine, others) -> list[list[int]]:
    requests = {r.request_id: r for r in engine.scheduler.running}
    return [requests[f"bg{i}"].output_token_ids if f"bg{i}" in requests else [] for i in range(len(others))]


if __name__ == "__main__":
    main()
