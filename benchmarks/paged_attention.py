"""Paged attention alone: ``pagedpack::paged_attention`` vs SDPA on the same K/V stored contiguously.

Decode (one query row per sequence) of 32 sequences at each KV length (fp32, and bf16 at 512 and
2048), one prefill of a 512-token prompt, and bf16 prefills of 512 and 2048 tokens (the BRGEMM flash path), for the W1
head shape (8 query / 2 KV heads, head_dim 64) and SmolLM2-135M's
(9 / 3, 64). ``native`` is the C++ kernel (``kernels/csrc``) called as the CPU-lowered step
calls it; ``native_via_op`` the same through the ``pagedpack::paged_attention`` custom op (its
Python layer and checks); ``reference`` the PyTorch reference kernel (``PAGEDPACK_NATIVE=0``);
``sdpa_contiguous`` ``F.scaled_dot_product_attention`` with ``enable_gqa`` on K/V already laid out
``[B, Hkv, L, D]`` (no paging: the floor). Blocks of a sequence are scattered over the pool (a
random permutation). Prints one JSON object with milliseconds per call (median of ``--repeat``)
and the ratios.

``kv_cache_dtypes``: the native decode kernel over caches of each ``kv_cache_dtype`` (an fp32
query; the caches written by ``reshape_and_cache``, which quantizes int8 / fp8 rows), 8 sequences at
1k, 4k and 16k tokens of context, SmolLM2's heads, and each time against the fp32 cache's.

Run: ``python benchmarks/paged_attention.py [--block-size 16] [--repeat 20] [--only kernels|kv_cache_dtypes]``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.inputs import KV_CACHE_DTYPES
from pagedpack.kernels.native import native_ops, status

from common import load_1min

SHAPES = {"w1": (8, 2, 64), "smollm2-135m": (9, 3, 64)}


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def _case(num_heads, num_kv_heads, head_dim, q_len, kv_len, num_seqs, block_size, repeat,
          dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-kv_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    k = torch.randn(num_seqs, kv_len, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_seqs, kv_len, num_kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs * q_len, num_heads, head_dim, generator=g)
    table = torch.randperm(num_blocks, generator=g).view(num_seqs, blocks_per_seq).int()
    k, v, q = k.to(dtype), v.to(dtype), q.to(dtype)
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    for b in range(num_seqs):
        for p in range(kv_len):
            key_cache[table[b, p // block_size], p % block_size] = k[b, p]
            value_cache[table[b, p // block_size], p % block_size] = v[b, p]
    cu = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((num_seqs,), kv_len, dtype=torch.int32)
    scale = head_dim**-0.5
    args = (q, key_cache, value_cache, table, cu, lens, scale)

    def paged():
        return torch.ops.pagedpack.paged_attention(*args)

    def direct():  # what the CPU-lowered step graph calls (no custom-op Python layer)
        return torch.ops.pagedpack_cpu.paged_attention(*args)

    q4 = q.view(num_seqs, q_len, num_heads, head_dim).transpose(1, 2)
    k4, v4 = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    mask = None
    if q_len > 1 and kv_len > q_len:
        mask = torch.arange(kv_len)[None] <= torch.arange(q_len)[:, None] + (kv_len - q_len)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=q_len > 1 and mask is None,
                                              scale=scale, enable_gqa=True)

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # a sanity check; tests/test_native_kernels.py proves
    torch.testing.assert_close(paged(), sdpa().transpose(1, 2).reshape_as(q), atol=tolerance, rtol=tolerance)
    native_ms = _median_ms(direct, repeat)
    op_ms = _median_ms(paged, repeat)
    os.environ["PAGEDPACK_NATIVE"] = "0"
    reference_ms = _median_ms(paged, max(3, repeat // 4))
    del os.environ["PAGEDPACK_NATIVE"]
    sdpa_ms = _median_ms(sdpa, repeat)
    return {"dtype": str(dtype).removeprefix("torch."), "q_len": q_len, "kv_len": kv_len, "num_seqs": num_seqs,
            "native_ms": native_ms, "native_via_op_ms": op_ms,
            "reference_ms": reference_ms, "sdpa_contiguous_ms": sdpa_ms,
            "native_vs_sdpa": round(native_ms / sdpa_ms, 2), "reference_vs_sdpa": round(reference_ms / sdpa_ms, 2)}


def _kv_dtype_row(num_heads, num_kv_heads, head_dim, kv_len, num_seqs, block_size, repeat) -> dict:
    """Decode time of the native kernel per KV cache dtype, the same keys and values written into each."""
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-kv_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    table = torch.randperm(num_blocks, generator=g).view(num_seqs, blocks_per_seq).int()
    slots = (table.long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :kv_len].flatten()
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    lens = torch.full((num_seqs,), kv_len, dtype=torch.int32)
    row = {"kv_len": kv_len, "num_seqs": num_seqs}
    for name in ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2"):
        dtype = KV_CACHE_DTYPES[name]
        width = head_dim + (4 if dtype.itemsize == 1 else 0)
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, width, dtype=dtype) for _ in range(2)]
        for start in range(0, len(slots), 1 << 16):  # K/V seeded per chunk: the same for every dtype
            chunk = slots[start:start + (1 << 16)]
            kv = torch.randn(2, len(chunk), num_kv_heads, head_dim, generator=torch.Generator().manual_seed(start))
            torch.ops.pagedpack_cpu.reshape_and_cache(kv[0], kv[1], *caches, chunk)
        call = functools.partial(torch.ops.pagedpack_cpu.paged_attention, q, *caches, table, cu, lens, head_dim**-0.5)
        row[f"{name}_ms"] = _median_ms(call, repeat)
        row[f"{name}_vs_float32"] = round(row[f"{name}_ms"] / row["float32_ms"], 2)
        del caches, call
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--only", choices=["kernels", "kv_cache_dtypes"], default=None)
    args = parser.parse_args()
    if native_ops() is None:
        raise SystemExit(f"no native kernels: {status()}")
    load = load_1min()
    result = {"kernels": status(), "threads": torch.get_num_threads(), "load_1min": load,
              "block_size": args.block_size, "cases": {}}
    for name, (h, hkv, d) in SHAPES.items() if args.only != "kv_cache_dtypes" else ():
        rows = [_case(h, hkv, d, 1, kv, 32, args.block_size, args.repeat) for kv in (16, 128, 512, 2048)]
        rows += [_case(h, hkv, d, 1, kv, 32, args.block_size, args.repeat, torch.bfloat16) for kv in (512, 2048)]
        rows.append(_case(h, hkv, d, 512, 512, 1, args.block_size, args.repeat))
        rows += [_case(h, hkv, d, n, n, 1, args.block_size, args.repeat, torch.bfloat16) for n in (512, 2048)]
        result["cases"][f"{name} (H={h}, Hkv={hkv}, D={d})"] = rows
    if args.only != "kernels":
        h, hkv, d = SHAPES["smollm2-135m"]
        result["kv_cache_dtypes"] = [_kv_dtype_row(h, hkv, d, kv, 8, args.block_size, args.repeat)
                                     for kv in (1024, 4096, 16384)]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
