"""Scaled KV caches (``int8``, ``fp8_e4m3``, ``fp8_e5m2``): how a row is quantized and read back.

A row is one token's keys (or values) of one KV head, ``x [head_size]``. Written as
``scale = max|x| / qmax`` in fp32 (1 for an all-zero row), ``q = x / scale`` rounded to the cache
dtype after clamping to ``[-qmax, qmax]`` (int8: to nearest, ties to even, qmax 127; fp8: the
dtype's own rounding, qmax its largest finite value; the clamp matters only where a subnormal
``max|x|`` makes the scale round down), stored as ``[q..., scale's 4 bytes]``; a row holding an infinity
or NaN is stored as zeros with a NaN scale, so it reads back as NaN (never as finite numbers)
(:data:`pagedpack.step.contract.KV_SCALE_BYTES`). Read as ``q * scale`` in fp32. One scale per
(token, head), as vLLM's per-token-head scales and OpenVINO's by-token values: no calibration,
and a block's scales move with it (copy-on-write, prefix caching). These functions are the
reference kernels' and the ground truth of the native ones (``kernels/csrc/paged_attention_cpu.cpp``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from pagedpack.step.contract import KV_SCALE_BYTES, SCALED_KV_DTYPES

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
        torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max}


def is_scaled(dtype: torch.dtype) -> bool:
    return dtype in SCALED_KV_DTYPES


def quantize_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x [..., head_size]`` (any floating dtype) -> ``[..., head_size + 4]`` of ``dtype``: the
    rows quantized, each followed by its fp32 scale's bytes (module docstring)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / QMAX[dtype]
    scale = torch.where(scale.isfinite(), torch.where(scale > 0, scale, 1.0), torch.nan)  # inf / NaN rows: NaN
    q = torch.where(scale.isfinite(), x / scale, 0.0)
    q = (q.round() if dtype == torch.int8 else q).clamp(-QMAX[dtype], QMAX[dtype]).to(dtype)
    scale_bytes = scale.contiguous().view(torch.uint8).view(dtype)  # [..., 4]
    return torch.cat([q, scale_bytes], dim=-1)


def dequantize_rows(rows: Tensor) -> Tensor:
    """``[..., head_size + 4]`` rows of a scaled cache -> ``[..., head_size]`` fp32."""
    values, scale = rows[..., :-KV_SCALE_BYTES], rows[..., -KV_SCALE_BYTES:]
    return values.float() * scale.contiguous().view(torch.float32)


def head_size(cache: Tensor) -> int:
    """The head size of a cache ``[num_blocks, block_size, num_kv_heads, row]`` (the row less its scale)."""
    return cache.shape[-1] - (KV_SCALE_BYTES if is_scaled(cache.dtype) else 0)
