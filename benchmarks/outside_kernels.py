"""What of a lowered step program runs outside the GEMMs and the native kernels: the most an Inductor
pass over the elementwise regions between those opaque calls could take (``docs/cpu-kernels.md``).

For each ``--model``, the step program the CPU lowering built is run on two example steps (a decode
of ``--num-seqs`` sequences at context ``--context``, and 4 prompts of 512 tokens) under
``torch.profiler``; every top-level call is counted as a GEMM (oneDNN or ATen matmul), a native
kernel (``pagedpack_cpu::`` / ``pagedpack::``) or other ATen. Prints one JSON object: per model the
lowered graph's node counts and, per step, the median program time (unprofiled runs) and the
profiled time of each group, with the largest other ATen calls. Run:
``python benchmarks/outside_kernels.py [--model smollm2-135m gemma3-270m]``.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from torch.profiler import profile

from pagedpack import LLM
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import example_metadata

from common import load_1min

GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")
NATIVE_PREFIXES = ("pagedpack_cpu::", "pagedpack::")


def _group(name: str) -> str:
    return "gemm" if name in GEMM_OPS else "native" if name.startswith(NATIVE_PREFIXES) else "other"


def _node_group(node) -> str:
    """A graph node's group: a row-chunked MLP region (``call_module``), or its op's, the op named
    as the profiler names it (``mkldnn._linear_pointwise.default`` as ``mkldnn::_linear_pointwise``)."""
    if node.op == "call_module":
        return "mlp_region"
    return _group(str(node.target).replace(".default", "").replace(".", "::", 1))


def _step(runner, q_lens: list[int], context_lens: list[int], runs: int) -> dict:
    batch = example_metadata(q_lens, context_lens, block_size=runner.block_size, num_blocks=runner.num_blocks)
    inputs = batch.as_inputs()
    args = [inputs[name] for name in METADATA_INPUTS] + list(runner.kv_caches)
    with torch.inference_mode():
        runner.program(*args)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            runner.program(*args)
            times.append(time.perf_counter() - start)
        with profile() as prof:
            for _ in range(runs):
                runner.program(*args)
    groups, other = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.cpu_parent is None:
            ms = event.cpu_time_total / 1e3 / runs
            groups[_group(event.name)] += ms
            if _group(event.name) == "other":
                other[event.name] += ms
    return {"program_ms": round(statistics.median(times) * 1e3, 2),
            **{f"{g}_ms": round(groups[g], 3) for g in ("gemm", "native", "other")},
            "other_top_ms": {name: round(ms, 3) for name, ms in other.most_common(8)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=140)
    args = parser.parse_args()
    result = {"load_1min": load_1min(), "threads": torch.get_num_threads(), "models": {}}
    for model in args.model:
        runner = LLM(model, enable_prefix_caching=False).llm_engine.runner
        nodes = collections.Counter(_node_group(n) for n in runner.program.run.graph.nodes
                                    if n.op in ("call_function", "call_module"))
        result["models"][model] = {
            "graph_nodes": dict(nodes),
            "decode": _step(runner, [1] * args.num_seqs, [args.context - 1] * args.num_seqs, runs=15),
            "prefill_4x512": _step(runner, [512] * 4, [0] * 4, runs=3),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
