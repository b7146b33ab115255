"""Tensor parallelism on this machine: ``LLM(..., tensor_parallel_size=N)`` against N = 1, side by side.

For each ``--tp`` size (default 1 and 2) on W1 (``../shared/bench/workload.py``: 32 prompts of W1's
lengths, 32 greedy tokens, EOS ignored) or ``--model M`` (W1's lengths cut from English text),
prints JSON: the generation time (one warm-up run, best of ``--runs``), steps and mean step time,
each rank's peak RSS during the runs (``VmHWM`` of rank 0 and of each worker process), the KV
bytes per token of one rank, whether the tokens equal N = 1's, and the collectives' share of rank
0's wall time (``torch.profiler`` over one more run: the CPU time of the ``_c10d_functional``
all-reduce, all-gather and wait ops, which includes waiting for the slower rank). A size the model cannot be
split over is reported with the refusal. Intra-op threads: the CPUs divided by N on every rank.
Prefix caching off (the timed runs repeat the warm-up's prompts). Start below a 1-minute load of
0.8 (reported). Run: ``python benchmarks/tensor_parallel.py [--model smollm2-135m --tp 1 3 2]``.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from pagedpack import LLM, SamplingParams
from pagedpack.runtime.cpu_threads import allowed_cpus

from common import cpu_model, load_1min, peak_rss_mb, reset_peak_rss, w1_workload

REPO = Path(__file__).resolve().parent.parent
_COLLECTIVE_OPS = ("all_reduce", "all_gather_into_tensor", "wait_tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an alias or a Hugging Face directory; default: W1's model")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (first: the baseline)")
    parser.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench")
    parser.add_argument("--w1-dir", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    args.workload, args.repeat = "w1", 1
    load = load_1min()
    model, prompts = w1_workload(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, baseline = {}, None
    for tp in args.tp:
        try:
            llm = LLM(model, block_size=16, enable_prefix_caching=False, tensor_parallel_size=tp)
        except ValueError as err:
            rows[f"tp{tp}"] = {"refused": str(err)}
            continue
        rows[f"tp{tp}"], outputs = _measure(llm, prompts, params, args.runs)
        baseline = outputs if baseline is None else baseline
        rows[f"tp{tp}"]["tokens_equal_first"] = outputs == baseline
        if llm.ranks.workers is not None:
            llm.ranks.workers.close()
        del llm
    first = rows[f"tp{args.tp[0]}"].get("seconds")
    print(json.dumps({
        "model": str(args.model or "W1"), "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
        "new_tokens_per_request": args.max_tokens, "sizes": rows,
        "time_ratio_to_first": {k: round(r["seconds"] / first, 2) for k, r in rows.items() if "seconds" in r and first},
        "load_1min": load, "host": cpu_model(), "cpus": len(allowed_cpus()), "machine": platform.machine(),
    }, indent=2))


def _measure(llm: LLM, prompts, params, runs: int) -> tuple[dict, list]:
    workers = llm.ranks.workers
    pids = ["self"] + ([rank.process.pid for rank in workers.ranks] if workers is not None else [])

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    run()  # warm-up
    for pid in pids:
        reset_peak_rss(pid)
    steps_before, best = llm.get_stats().num_steps, float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        outputs = run()
        best = min(best, time.perf_counter() - start)
    steps = (llm.get_stats().num_steps - steps_before) // runs
    rss = [peak_rss_mb(pid) for pid in pids]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        profiled = time.perf_counter() - start
    collective_us = sum(e.cpu_time_total for e in prof.key_averages()
                        if "_c10d_functional" in e.key and any(op in e.key for op in _COLLECTIVE_OPS))
    return {"seconds": round(best, 3), "generated_tokens_per_s": round(len(prompts) * params.max_tokens / best, 1),
            "steps": steps, "mean_step_ms": round(1000 * best / steps, 2), "peak_rss_mb_per_rank": rss,
            "kv_bytes_per_token_per_rank": llm.bytes_per_token,
            "collective_share_of_wall": round(collective_us / 1e6 / profiled, 3)}, outputs


if __name__ == "__main__":
    main()
