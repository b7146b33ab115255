"""The LoRA ops on CPU: one layer's four LoRA linears (shrink + expand) against the four base linears.

SmolLM2-135M's linears as the step graph has them: QKV merged (in 576, slices 576, 192, 192), o
(576 -> 576), gate-up merged (576 -> 1536, 1536), down (1536 -> 576); rank 16, 8 adapter slots.
For ``T`` tokens (32: a decode step, one token per sequence, the adapters interleaved; 512: a
prefill step, each adapter's tokens one contiguous run) and 1, 4 or 8 distinct adapters, times the
eight calls ``torch.ops.pagedpack.lora_shrink`` / ``lora_expand`` (inside ``checked_step``, as the
runner calls them: no per-call Python checks) with the native kernels and with the reference
kernels (``PAGEDPACK_NATIVE=0``), and the four ``F.linear`` calls of the base layer, ``x [1, T, in]``,
in fp32 and bf16. Prints one JSON object: per case the microseconds of each (the fastest batch,
:func:`linear.time_us`) and ``native / base``.
Run: ``python benchmarks/lora_ops.py [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from linear import time_us, wait_for_quiet

import pagedpack  # noqa: F401  (registers the ops)
from pagedpack.kernels.validation import checked_step

from common import cpu_model, load_1min

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
LINEARS = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)), "gate_up": (HIDDEN, (INTERMEDIATE,) * 2),
           "down": (INTERMEDIATE, (HIDDEN,))}
RANK, MAX_LORAS = 16, 8


def layer(tokens: int, adapters: int, dtype: torch.dtype):
    """The base layer's four linears and their LoRA calls, as two closures."""
    g = torch.Generator().manual_seed(0)
    if tokens == 32:
        indices = torch.arange(tokens) % adapters
    else:
        indices = torch.arange(adapters).repeat_interleave(-(-tokens // adapters))[:tokens]
    indices = indices.to(torch.int32)
    parts = []
    for k, slices in LINEARS.values():
        n = sum(slices)
        parts.append((torch.randn(1, tokens, k, generator=g).to(dtype),
                      (torch.randn(n, k, generator=g) / k**0.5).to(dtype),
                      (torch.randn(MAX_LORAS, len(slices) * RANK, k, generator=g) / k**0.5).to(dtype),
                      (torch.randn(MAX_LORAS, n, RANK, generator=g) / RANK).to(dtype), list(slices)))
    ys = [F.linear(x, w) for x, w, *_ in parts]

    def base():
        for x, w, *_ in parts:
            F.linear(x, w)

    def lora():
        for (x, _, a, b, slices), y in zip(parts, ys):
            torch.ops.pagedpack.lora_expand(y, torch.ops.pagedpack.lora_shrink(x, a, indices), b, indices, slices)

    return base, lora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument("--max-load", type=float, default=0.8)
    parser.add_argument("--max-wait", type=float, default=300.0)
    args = parser.parse_args()
    target_s = 0.05 if args.quick else 0.2
    load_start, waited = wait_for_quiet(args.max_load, args.max_wait)
    rows = []
    with torch.no_grad(), checked_step():
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in (32, 512):
                for adapters in (1, 4, 8):
                    base, lora = layer(tokens, adapters, dtype)
                    times = {"base_us": time_us(base, target_s), "native_us": time_us(lora, target_s)}
                    os.environ["PAGEDPACK_NATIVE"] = "0"
                    try:
                        times["reference_us"] = time_us(lora, target_s)
                    finally:
                        del os.environ["PAGEDPACK_NATIVE"]
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "T": tokens, "adapters": adapters,
                                 **{k: round(v, 1) for k, v in times.items()},
                                 "native_over_base": round(times["native_us"] / times["base_us"], 3),
                                 "reference_over_base": round(times["reference_us"] / times["base_us"], 3)})
    print(json.dumps({"cpu": cpu_model(), "load_1min_start": load_start, "load_1min_end": load_1min(),
                      "waited_s": waited, "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "rank": RANK, "max_loras": MAX_LORAS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
