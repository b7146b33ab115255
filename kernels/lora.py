"""The multi-LoRA ops: each token of a packed step takes the adapter in its slot.

A linear ``y = x W^T`` with LoRA adapters in ``max_loras`` slots computes, for token ``t`` in slot
``lora_indices[t]``, ``y[t] + (x[t] A^T) B^T`` per output slice (a merged QKV or gate-up linear has
``S`` slices, each with its own adapter pair; the scaling is folded into ``B``). The step graph
(:mod:`pagedpack.passes.lora`, contract: :class:`pagedpack.step.contract.LoRASpec`) calls the two
halves after the base linear:

* ``lora_shrink(x, lora_a, lora_indices) -> buffer``: ``buffer[t] = lora_a[slot] @ x[t]``, all ``S``
  slices' ``A`` stacked along the rank, zeros where the slot is -1.
* ``lora_expand(y, buffer, lora_b, lora_indices, slice_sizes) -> out``: ``out = y + delta``, with
  ``delta[t, off_s:off_s + n_s] = buffer[t, s R:(s + 1) R] @ lora_b[slot, off_s:off_s + n_s, :]^T``
  for slice ``s`` of ``n_s = slice_sizes[s]`` output columns at offset ``off_s``.

Semantics of punica's and vLLM's ``sgmv_shrink`` / ``sgmv_expand`` (tokens grouped in runs of one
adapter, prefill) and ``bgmv_shrink`` / ``bgmv_expand`` (one adapter per token, decode), with the
expand's slices of vLLM's ``add_expand`` (``output_slices``) and ``add_inputs=True``; a slot of -1
(vLLM's ``lora_indices == -1``) adds nothing.

Shapes and dtypes (``N`` tokens: the product of the leading dims; ``[1, T, ...]`` in step graphs):

* ``x [..., in_features]``, float32, bfloat16 or float16; ``lora_a [max_loras, S * R, in_features]``
  of ``x``'s dtype; the shrink's output float32 ``[..., S * R]`` (accumulated in fp32).
* ``y [..., out_features]`` (the base linear's output), ``buffer [..., S * R]`` float32 (the shrink's
  output), ``lora_b [max_loras, out_features, R]`` of ``y``'s dtype, ``slice_sizes``: ``S`` positive
  ints summing to ``out_features``; the output is a new tensor of ``y``'s shape and dtype: ``delta``
  computed in fp32, added to ``y`` in fp32, rounded once.
* ``lora_indices [N]`` int32: each token's slot in ``[0, max_loras)``, or -1.

Both ops are functional. Shape, dtype and device checks run in the fake kernels (symbolic ``N``
under ``torch.export``) and the real ones, except inside the runner's step
(:func:`pagedpack.kernels.validation.checked_step`); every failure is
``ValueError("<op>: <arg>: expected ..., got ...")``. The slots are checked on every call: by the
native kernels (no sync on a CPU), and by the reference kernels once they have read the slots in use
(which they need to group the tokens anyway). When no token has an adapter, shrink returns zeros and
expand a copy of ``y``, without a product. On the CPU, fp32 and bf16 run the native kernels
(``kernels/csrc/lora_cpu.cpp``: tokens grouped per slot, register-tiled fp32 loops, threads over
(slot, tokens, columns) items) when they build; otherwise, and for fp16, the reference kernels here:
one fp32 GEMM per slot (per slot and slice in the expand) over that slot's gathered rows.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.native import native_ops
from pagedpack.kernels.ops import _check_dtype, _check_rank, _check_same_device, _require
from pagedpack.kernels.validation import arguments_checked

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NATIVE_LORA_DTYPES = (torch.float32, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_indices(op: str, lora_indices: Tensor, tokens) -> None:
    _check_rank(op, "lora_indices", lora_indices, "[N]")
    _check_dtype(op, "lora_indices", lora_indices, (torch.int32,))
    _require(lora_indices.shape[0] == tokens, op, "lora_indices", f"N={tokens} entries (one per token)",
             lora_indices.shape[0])


def _check_weights(op: str, arg: str, t: Tensor, layout: str, act_arg: str, act: Tensor, dim: int) -> None:
    """``t`` (``lora_a`` / ``lora_b``) is rank 3 of ``act``'s dtype, its dim ``dim`` ``act``'s features."""
    _require(act.dim() >= 1, op, act_arg, "a tensor [..., features]", f"shape {tuple(act.shape)}")
    _check_dtype(op, act_arg, act, _DTYPES)
    _check_rank(op, arg, t, layout)
    _require(t.dtype == act.dtype, op, arg, f"the dtype of {act_arg} ({_name(act.dtype)})", _name(t.dtype))
    _require(t.shape[dim] == act.shape[-1], op, arg, f"{layout} with {act.shape[-1]} features as {act_arg}",
             f"shape {tuple(t.shape)}")


def _check_shrink(x: Tensor, lora_a: Tensor, lora_indices: Tensor) -> None:
    op = "lora_shrink"
    _check_same_device(op, x=x, lora_a=lora_a, lora_indices=lora_indices)
    _check_weights(op, "lora_a", lora_a, "[max_loras, S*R, in_features]", "x", x, 2)
    _check_indices(op, lora_indices, math.prod(x.shape[:-1]))


def _check_expand(y: Tensor, buffer: Tensor, lora_b: Tensor, lora_indices: Tensor, slice_sizes: Sequence[int]) -> None:
    op = "lora_expand"
    _check_same_device(op, y=y, buffer=buffer, lora_b=lora_b, lora_indices=lora_indices)
    _check_weights(op, "lora_b", lora_b, "[max_loras, out_features, R]", "y", y, 1)
    out_features = y.shape[-1]
    _require(len(slice_sizes) >= 1 and all(n > 0 for n in slice_sizes) and sum(slice_sizes) == out_features, op,
             "slice_sizes", f"positive sizes summing to out_features={out_features}", list(slice_sizes))
    _check_dtype(op, "buffer", buffer, (torch.float32,))
    columns = len(slice_sizes) * lora_b.shape[2]
    _require(buffer.dim() == y.dim() and tuple(buffer.shape[:-1]) == tuple(y.shape[:-1])
             and buffer.shape[-1] == columns, op, "buffer",
             f"shape {(*y.shape[:-1], columns)} (y's leading dims, S*R = {len(slice_sizes)}*{lora_b.shape[2]})",
             f"shape {tuple(buffer.shape)}")
    _check_indices(op, lora_indices, math.prod(y.shape[:-1]))


def _native(*tensors: Tensor):
    """``torch.ops.pagedpack_cpu`` for CPU fp32 / bf16 tensors when the library is built, else None."""
    if not is_cpu(tensors[0]) or any(t.dtype not in NATIVE_LORA_DTYPES for t in tensors):
        return None
    return native_ops()


def _slot_rows(op: str, lora_indices: Tensor, max_loras: int) -> list[tuple[int, Tensor]]:
    """``(slot, rows)`` of each slot in use (rows: int64 token indices), after checking the slots."""
    idx = lora_indices.long()
    slots = torch.unique(idx).tolist()
    _require(all(-1 <= s < max_loras for s in slots), op, "lora_indices", f"slots in [0, {max_loras}) or -1",
             f"slots {slots}")
    return [(s, (idx == s).nonzero()[:, 0]) for s in slots if s >= 0]


@torch.library.custom_op("pagedpack::lora_shrink", mutates_args=())
def lora_shrink(x: Tensor, lora_a: Tensor, lora_indices: Tensor) -> Tensor:
    """Each token's input times its slot's stacked ``A``: ``out[t] = lora_a[lora_indices[t]] @ x[t]``.

    Args:
        x: ``[..., in_features]``, float32, bfloat16 or float16 (``N`` tokens in the leading dims).
        lora_a: ``[max_loras, S*R, in_features]``, ``x``'s dtype.
        lora_indices: int32 ``[N]``, slots in ``[0, max_loras)`` or -1 (no adapter: a zero row).

    Returns:
        float32 ``[..., S*R]``, accumulated in fp32.

    Raises:
        ValueError: a rank, shape, dtype or device mismatch, or a slot out of range, naming the argument.
    """
    if not arguments_checked():
        _check_shrink(x, lora_a, lora_indices)
    native = _native(x, lora_a)
    if native is not None:
        return native.lora_shrink(x, lora_a, lora_indices)
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_zeros(x2.shape[0], lora_a.shape[1], dtype=torch.float32)
    for slot, rows in _slot_rows("lora_shrink", lora_indices, lora_a.shape[0]):
        out[rows] = x2[rows].float() @ lora_a[slot].float().T
    return out.reshape(*x.shape[:-1], lora_a.shape[1])


@lora_shrink.register_fake
def _(x, lora_a, lora_indices):
    _check_shrink(x, lora_a, lora_indices)
    return x.new_empty((*x.shape[:-1], lora_a.shape[1]), dtype=torch.float32)


@torch.library.custom_op("pagedpack::lora_expand", mutates_args=())
def lora_expand(y: Tensor, buffer: Tensor, lora_b: Tensor, lora_indices: Tensor, slice_sizes: Sequence[int]) -> Tensor:
    """``y`` plus each token's shrunk input times its slot's ``B``, slice by slice.

    Args:
        y: ``[..., out_features]``, float32, bfloat16 or float16 (the base linear's output; not mutated).
        buffer: float32 ``[..., S*R]`` with ``y``'s leading dims (:func:`lora_shrink`'s output).
        lora_b: ``[max_loras, out_features, R]``, ``y``'s dtype.
        lora_indices: int32 ``[N]``, slots in ``[0, max_loras)`` or -1 (no adapter: ``y``'s row).
        slice_sizes: the ``S`` slices' output columns, in order, summing to ``out_features``.

    Returns:
        A new contiguous tensor of ``y``'s shape and dtype: ``y + delta`` in fp32, rounded once.

    Raises:
        ValueError: a rank, shape, dtype or device mismatch, slice sizes that do not sum to
            ``out_features``, or a slot out of range, naming the argument.
    """
    if not arguments_checked():
        _check_expand(y, buffer, lora_b, lora_indices, slice_sizes)
    native = _native(y, lora_b)
    if native is not None:
        return native.lora_expand(y, buffer, lora_b, lora_indices, slice_sizes)
    groups = _slot_rows("lora_expand", lora_indices, lora_b.shape[0])
    if not groups:
        return y.clone(memory_format=torch.contiguous_format)
    rank = lora_b.shape[2]
    buf = buffer.reshape(-1, buffer.shape[-1])
    out = y.reshape(-1, y.shape[-1]).to(torch.float32, copy=True)
    for slot, rows in groups:
        b = lora_b[slot].float()
        slices = b.split(list(slice_sizes))
        out[rows] += torch.cat([buf[rows, s * rank:(s + 1) * rank] @ bs.T for s, bs in enumerate(slices)], dim=1)
    return out.to(y.dtype).reshape(y.shape)


@lora_expand.register_fake
def _(y, buffer, lora_b, lora_indices, slice_sizes):
    _check_expand(y, buffer, lora_b, lora_indices, slice_sizes)
    return torch.empty_like(y, memory_format=torch.contiguous_format)
