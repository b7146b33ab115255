"""Fixed cost of one decode step: the engine's step time minus the time spent in GEMMs.

``--num-seqs`` requests (32; prompt length ``--prompt-len``) are prefilled, then ``--steps`` decode
steps of all of them are timed through ``LLMEngine.step`` (scheduling, metadata, the step program, sampling), once
plainly and once under ``torch.profiler`` to sum the time of the matrix-multiply ops.
``fixed_overhead_ms`` = median step time - GEMM time per step (profiler overhead excluded by
taking the step time from the unprofiled run); ``outside_kernels_ms`` also subtracts the native
kernels' time (attention, cache writes, norms, rotary, activation: ``pagedpack_cpu::`` /
``pagedpack::`` ops), leaving metadata, scheduling, sampling, output processing and the step
program's Python and ATen calls. A kernel's time is its call's whole time, the ATen calls it
makes included; kernels called by another kernel count once, in their caller. Default model: the
built-in tiny one; ``--dtype`` as ``LLM``'s (the native bf16 GEMM, ``pagedpack_cpu::bf16_linear``, counts as
a GEMM). Prints one JSON object with the top ops by self time. Run:
``python benchmarks/step_overhead.py [--model M] [--dtype bfloat16] [--num-seqs N]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedpack import LLM, SamplingParams
from pagedpack.kernels.native import status

from common import load_1min

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_mkl_linear",
            "mkl::_mkl_linear", "pagedpack_cpu::bf16_linear")
NATIVE_PREFIXES = ("pagedpack_cpu::", "pagedpack::")


def _outermost_kernel_calls(events) -> tuple[list, list]:
    """``(GEMM calls, native kernel calls)`` among the profiler's ``events`` that run inside no other
    kernel call: a kernel's time includes the ATen calls it makes (its output's allocation, the
    cache write the fused QKV call makes through the dispatcher), counted once."""
    def is_kernel(e) -> bool:
        return e.name in GEMM_OPS or e.name.startswith(NATIVE_PREFIXES)

    def nested(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if is_kernel(parent):
                return True
            parent = parent.cpu_parent
        return False

    outermost = [e for e in events if is_kernel(e) and not nested(e)]
    return [e for e in outermost if e.name in GEMM_OPS], [e for e in outermost if e.name not in GEMM_OPS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="LLM's (default: the model's)")
    args = parser.parse_args()
    load = load_1min()

    llm = LLM(args.model, dtype=args.dtype)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 4, ignore_eos=True)
    for i in range(args.num_seqs):
        engine.add_request(f"r{i}", [1 + i % 50] * args.prompt_len, params)
    scheduler = engine.scheduler
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in [*scheduler.running, *scheduler.waiting]):
        engine.step()

    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    gemm_ms, native_ms = (sum(e.cpu_time_total for e in calls) / 1e3 / args.steps
                          for calls in _outermost_kernel_calls(prof.events()))
    events = prof.key_averages()
    step_ms = statistics.median(times) * 1e3
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "num_seqs": args.num_seqs, "context_len": args.prompt_len,
        "step_ms": round(step_ms, 3), "gemm_ms": round(gemm_ms, 3), "fixed_overhead_ms": round(step_ms - gemm_ms, 3),
        "native_kernels_ms": round(native_ms, 3), "outside_kernels_ms": round(step_ms - gemm_ms - native_ms, 3),
        "top_self_ms_per_step": {e.key: round(e.self_cpu_time_total / 1e3 / args.steps, 3) for e in top},
        "kernels": status(), "threads": torch.get_num_threads(), "load_1min": load,
    }, indent=1))


if __name__ == "__main__":
    main()
