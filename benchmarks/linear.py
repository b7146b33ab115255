"""A linear on CPU: ``F.linear`` vs the GEMM the CPU lowering runs on a weight prepacked once.

fp32 (default): ``F.linear`` (MKL sgemm) against oneDNN on a prepacked weight. ``--dtype bfloat16``:
``F.linear`` against what ``lowering/reference/cpu_linear.py`` picks for this CPU, oneDNN's bf16 GEMM
where oneDNN has bf16 kernels (AVX512-BF16 / AMX), else the native one
(``torch.ops.pagedpack_cpu.bf16_linear`` on ``bf16_linear_pack``'s panels).

For the linear shapes of two models (the W1 model: hidden 512, q 512, kv 128, intermediate 1408,
vocab 4096, merged qkv 768 and gate_up 2816; SmolLM2-135M: hidden 576, kv 192, intermediate
1536, vocab 49152) and row counts ``M`` of two classes, decode-like (1 .. 32) and prefill-like
(256 .. 2048), times ``F.linear(x, w)`` against the packed GEMM (oneDNN's: ``torch.ops.mkldnn._linear_pointwise(x,
packed, None, "none", [], "")`` with ``packed = torch.ops.mkldnn._reorder_linear_weight(w, None)``,
packed once, no batch-size hint: the step graph's row count varies). ``x`` is ``[1, M, K]``, as
in the step graph. The LM head runs on the gathered rows only (one per sequence), so it is
timed at decode-like ``M`` only.

Waits (up to ``--max-wait`` s) until the 1-minute load average is below ``--max-load`` and
records the load before and after (the latter includes this benchmark's own threads). Prints
one JSON object: per shape and ``M`` the microseconds of each path (the fastest of three
alternated measurements) and ``packed / f_linear`` (below 1: the packed GEMM faster), and per model
and class the geometric-mean ratio.
Run: ``python benchmarks/linear.py [--quick] [--dtype bfloat16]``.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference.cpu_linear import packable_dtypes

from common import load_1min

# (K, N) of each linear, by name.
MODELS = {
    "w1": {"q/o": (512, 512), "k/v": (512, 128), "qkv": (512, 768), "gate/up": (512, 1408),
           "gate_up": (512, 2816), "down": (1408, 512), "lm_head": (512, 4096)},
    "smollm2_135m": {"q/o": (576, 576), "k/v": (576, 192), "qkv": (576, 960), "gate/up": (576, 1536),
                     "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)},
}
DECODE_M = (1, 4, 8, 16, 32)
PREFILL_M = (256, 512, 1024, 2048)
DECODE_ONLY = {"lm_head"}


def wait_for_quiet(max_load: float, max_wait: float) -> tuple[float, float]:
    """Wait until the 1-minute load is below ``max_load`` (at most ``max_wait`` s); (load, waited s)."""
    start = time.monotonic()
    while load_1min() >= max_load and time.monotonic() - start < max_wait:
        time.sleep(5)
    return load_1min(), round(time.monotonic() - start, 1)


def time_us(fn, target_s: float, batches: int = 10) -> float:
    """Microseconds of one call: the fastest of ``batches`` batches of calls (~``target_s`` in
    all); the fastest, not the median, because other processes on the machine only ever add time
    (short batches, so that some run between their time slices)."""
    fn()
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-7)
    n = max(1, int(target_s / batches / one))
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def packed_gemm(w: torch.Tensor) -> tuple[str, object]:
    """(name, x -> x w^T): the GEMM the CPU lowering runs for ``w``'s dtype on this CPU."""
    if w.dtype in packable_dtypes():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return "onednn", lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    ops = native_ops()
    if w.dtype != torch.bfloat16 or ops is None:
        raise SystemExit(f"no packed GEMM for {w.dtype} on this CPU")
    packed = ops.bf16_linear_pack(w)
    return "native", lambda x: ops.bf16_linear(x, packed, None, w.shape[0])


def bench_shape(k: int, n: int, ms: tuple[int, ...], target_s: float, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    name, gemm = packed_gemm(w)
    rows = []
    for m in ms:
        x = torch.randn(1, m, k, generator=g).to(dtype)
        plain = lambda: F.linear(x, w)  # noqa: E731
        packed = lambda: gemm(x)  # noqa: E731
        # alternate the two paths, three times each, so that drift in the machine's speed hits both
        times = [time_us(f, target_s) for _ in range(3) for f in (plain, packed)]
        t_plain, t_packed = min(times[0::2]), min(times[1::2])
        err = (packed().float() - plain().float()).abs().max().item()
        rows.append({"M": m, "f_linear_us": round(t_plain, 1), f"{name}_us": round(t_packed, 1),
                     "ratio": round(t_packed / t_plain, 3), "max_abs_diff": err,
                     "packed_gflops": round(2 * m * k * n / t_packed / 1e3, 1)})
    return rows


def geomean(values: list[float]) -> float:
    return round(math.exp(sum(math.log(v) for v in values) / len(values)), 3) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter timings, fewer M")
    parser.add_argument("--max-load", type=float, default=0.8)
    parser.add_argument("--max-wait", type=float, default=900.0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    target_s = 0.05 if args.quick else 0.25
    decode_m, prefill_m = ((1, 8, 32), (256, 2048)) if args.quick else (DECODE_M, PREFILL_M)

    load_start, waited = wait_for_quiet(args.max_load, args.max_wait)
    results, summary = {}, {}
    with torch.no_grad():
        for model, shapes in MODELS.items():
            results[model] = {}
            ratios = {"decode": [], "prefill": []}
            for name, (k, n) in shapes.items():
                ms = decode_m if name in DECODE_ONLY else decode_m + prefill_m
                rows = bench_shape(k, n, ms, target_s, getattr(torch, args.dtype))
                results[model][f"{name} K={k} N={n}"] = rows
                for row in rows:
                    ratios["decode" if row["M"] <= 32 else "prefill"].append(row["ratio"])
            summary[model] = {cls: geomean(r) for cls, r in ratios.items()}
    print(json.dumps({
        "load_1min_start": load_start, "load_1min_end": load_1min(), "waited_s": waited,
        "load_ok": load_start < args.max_load,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "geomean_ratio_packed_over_f_linear": summary, "shapes": results,
    }, indent=1))


if __name__ == "__main__":
    main()
