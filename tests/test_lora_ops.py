"""The LoRA ops (kernels/lora.py): native and reference kernels against a per-token fp64 loop written
here, opcheck, the argument checks, and an export with a dynamic token count."""
import os
import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedpack  # noqa: F401  (registers the ops)
from pagedpack.kernels import native
from pagedpack.kernels.validation import checked_step

from conftest import assert_rounded_close

ops = torch.ops.pagedpack
HAS_NATIVE = native.native_ops() is not None
KERNELS = [pytest.param(True, id="native", marks=pytest.mark.skipif(not HAS_NATIVE, reason=native.status())),
           pytest.param(False, id="reference")]


def kernels(use_native: bool):
    """The native kernels (where built) or the reference ones (``PAGEDPACK_NATIVE=0``)."""
    return mock.patch.dict(os.environ, {"PAGEDPACK_NATIVE": "1" if use_native else "0"})


def make(tokens, in_features, slices, rank, max_loras, dtype, indices, seed=0):
    g = torch.Generator().manual_seed(seed)
    out_features = sum(slices)
    return dict(x=torch.randn(1, tokens, in_features, generator=g).to(dtype),
                y=torch.randn(1, tokens, out_features, generator=g).to(dtype),
                lora_a=(torch.randn(max_loras, len(slices) * rank, in_features, generator=g) / 4).to(dtype),
                lora_b=(torch.randn(max_loras, out_features, rank, generator=g) / 4).to(dtype),
                lora_indices=torch.tensor(indices, dtype=torch.int32), slice_sizes=list(slices))


def loop_reference(x, y, lora_a, lora_b, lora_indices, slice_sizes, buffer=None):
    """Token by token in fp64: ``A_slot x[t]``, and ``y[t]`` plus ``B_slot,s`` times slice ``s`` of ``buffer[t]``
    (the op's buffer when given, else the exact one). Returns both."""
    x, y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
    exact = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    buffer = exact if buffer is None else buffer.reshape(exact.shape).double()
    rank, out = lora_b.shape[2], y.clone()
    for t, slot in enumerate(lora_indices.tolist()):
        if slot < 0:
            continue
        exact[t] = lora_a[slot].double() @ x[t]
        offset = 0
        for s, n in enumerate(slice_sizes):
            out[t, offset:offset + n] += lora_b[slot, offset:offset + n].double() @ buffer[t, s * rank:(s + 1) * rank]
            offset += n
    return exact, out


def run_ops(case):
    buffer = ops.lora_shrink(case["x"], case["lora_a"], case["lora_indices"])
    return buffer, ops.lora_expand(case["y"], buffer, case["lora_b"], case["lora_indices"], case["slice_sizes"])


def check_against_loop(case, buffer, out):
    """The shrink to fp32's error; the expand, on the op's own buffer, to fp32's error (fp32) or the exact
    result rounded once (bf16, fp16); rows of slot -1: zeros and ``y`` exactly."""
    exact_buffer, exact = loop_reference(**case, buffer=buffer)
    assert buffer.dtype == torch.float32 and buffer.shape == (*case["x"].shape[:-1], case["lora_a"].shape[1])
    torch.testing.assert_close(buffer.double().reshape(exact_buffer.shape), exact_buffer, rtol=1e-5, atol=1e-5)
    assert out.dtype == case["y"].dtype and out.shape == case["y"].shape and out.is_contiguous()
    out2, y2 = out.reshape(exact.shape), case["y"].reshape(exact.shape)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out2.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        assert_rounded_close(out2, exact)
    unused = case["lora_indices"] < 0
    assert torch.equal(out2[unused], y2[unused]) and not buffer.reshape(exact_buffer.shape)[unused].any()


@st.composite
def cases(draw):
    """A step: N tokens, 1-3 slices, any rank and width, slots -1 or in use, in runs (prefill) or mixed."""
    tokens, max_loras = draw(st.integers(1, 40)), draw(st.integers(1, 4))
    slots = st.integers(-1, max_loras - 1)
    if draw(st.booleans()):  # runs of one slot, as a prefill sequence's tokens
        runs = draw(st.lists(st.tuples(slots, st.integers(1, 12)), min_size=1, max_size=5))
        indices = [s for s, n in runs for _ in range(n)][:tokens]
        tokens = len(indices)
    else:
        indices = draw(st.lists(slots, min_size=tokens, max_size=tokens))
    slices = draw(st.lists(st.integers(1, 70), min_size=1, max_size=3))
    return make(tokens, draw(st.integers(1, 80)), slices, draw(st.sampled_from([1, 2, 5, 8, 16])), max_loras,
                draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), indices,
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("use_native", KERNELS)
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_ops_equal_the_per_token_loop(use_native, case):
    with kernels(use_native):
        check_against_loop(case, *run_ops(case))


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "prefill"])
def test_smollm2_qkv_in_threads(use_native, dtype, layout):
    """SmolLM2-135M's merged QKV (576 -> 576, 192, 192), rank 16, 64 tokens over 4 of 6 slots and
    slot -1, interleaved (decode) or in runs (prefill), on 2 threads (work split across items)."""
    slots = [0, 3, -1, 5, 2]
    indices = ([slots[t % 5] for t in range(64)] if layout == "decode"
               else [slots[t * 5 // 64] for t in range(64)])
    case = make(64, 576, (576, 192, 192), 16, 6, dtype, indices)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernels(use_native):
            check_against_loop(case, *run_ops(case))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("use_native", KERNELS)
def test_no_adapter_returns_zeros_and_a_copy_of_y(use_native):
    case = make(5, 8, (6, 4), 2, 2, torch.bfloat16, [-1] * 5)
    with kernels(use_native):
        buffer, out = run_ops(case)
    assert torch.equal(buffer, torch.zeros(1, 5, 4)) and torch.equal(out, case["y"])
    assert out.data_ptr() != case["y"].data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indices", [[1], [-1], [0, -1, 1, 1, 0]], ids=["N=1", "N=1-unused", "N=5"])
def test_opcheck(dtype, indices):
    case = make(len(indices), 12, (10, 6), 4, 2, dtype, indices)
    torch.library.opcheck(ops.lora_shrink.default, (case["x"], case["lora_a"], case["lora_indices"]))
    buffer = ops.lora_shrink(case["x"], case["lora_a"], case["lora_indices"])
    torch.library.opcheck(ops.lora_expand.default, (case["y"], buffer, case["lora_b"], case["lora_indices"],
                                                    case["slice_sizes"]))


def _bad(change):
    case = dict(make(5, 8, (6, 4), 2, 3, torch.float32, [0, 1, -1, 2, 0]), **change)
    if "buffer" not in case:
        case["buffer"] = torch.zeros(1, 5, 4)
    return case


@pytest.mark.parametrize("op, change, message", [
    ("shrink", {"x": torch.tensor(1.0)}, "lora_shrink: x: expected a tensor [..., features]"),
    ("shrink", {"x": torch.zeros(1, 5, 8, dtype=torch.int32)}, "lora_shrink: x: expected dtype float32 or"),
    ("shrink", {"lora_a": torch.zeros(4, 8)}, "lora_shrink: lora_a: expected a rank-3 tensor"),
    ("shrink", {"lora_a": torch.zeros(3, 4, 8, dtype=torch.bfloat16)},
     "lora_shrink: lora_a: expected the dtype of x (float32), got bfloat16"),
    ("shrink", {"lora_a": torch.zeros(3, 4, 7)}, "lora_shrink: lora_a: expected [max_loras, S*R, in_features] with 8"),
    ("shrink", {"lora_indices": torch.zeros(5, dtype=torch.int64)}, "lora_shrink: lora_indices: expected dtype int32"),
    ("shrink", {"lora_indices": torch.zeros(4, dtype=torch.int32)}, "lora_shrink: lora_indices: expected N=5 entries"),
    ("shrink", {"lora_indices": torch.tensor([0, 3, -1, 0, 0], dtype=torch.int32)},
     "lora_shrink: lora_indices: expected slots in [0, 3) or -1"),
    ("expand", {"lora_indices": torch.tensor([0, -2, -1, 0, 0], dtype=torch.int32)},
     "lora_expand: lora_indices: expected slots in [0, 3) or -1"),
    ("expand", {"slice_sizes": [6, 3]}, "lora_expand: slice_sizes: expected positive sizes summing to out_features=10"),
    ("expand", {"slice_sizes": [10, 0]}, "lora_expand: slice_sizes: expected positive sizes"),
    ("expand", {"buffer": torch.zeros(1, 5, 6)}, "lora_expand: buffer: expected shape (1, 5, 4)"),
    ("expand", {"buffer": torch.zeros(1, 4, 4)}, "lora_expand: buffer: expected shape (1, 5, 4)"),
    ("expand", {"buffer": torch.zeros(1, 5, 4, dtype=torch.bfloat16)}, "lora_expand: buffer: expected dtype float32"),
    ("expand", {"lora_b": torch.zeros(3, 9, 2)}, "lora_expand: lora_b: expected [max_loras, out_features, R] with 10"),
    ("expand", {"y": torch.zeros(1, 5, 10, dtype=torch.float16)}, "lora_expand: lora_b: expected the dtype of y"),
])
@pytest.mark.parametrize("use_native", KERNELS)
def test_bad_arguments_are_refused_by_name(op, change, message, use_native):
    case = _bad(change)
    with kernels(use_native), pytest.raises(ValueError, match=re.escape(message)):
        if op == "shrink":
            ops.lora_shrink(case["x"], case["lora_a"], case["lora_indices"])
        else:
            ops.lora_expand(case["y"], case["buffer"], case["lora_b"], case["lora_indices"], case["slice_sizes"])


@pytest.mark.skipif(not HAS_NATIVE, reason=native.status())
def test_inside_the_runner_s_step_the_native_kernels_still_check_the_slots():
    """In :func:`checked_step` the Python checks are skipped; the native kernels refuse a slot they would read
    outside ``lora_a`` / ``lora_b`` with."""
    case = _bad({"lora_indices": torch.tensor([0, 1, -1, 3, 0], dtype=torch.int32)})
    with checked_step():
        with pytest.raises(ValueError, match=r"lora_shrink: lora_indices: expected slots in \[0, 3\) or -1, got "
                                             r"lora_indices\[3\]=3"):
            ops.lora_shrink(case["x"], case["lora_a"], case["lora_indices"])
        with pytest.raises(ValueError, match=r"lora_expand: lora_indices: expected slots in \[0, 3\)"):
            ops.lora_expand(case["y"], case["buffer"], case["lora_b"], case["lora_indices"], case["slice_sizes"])
        with pytest.raises(ValueError, match="lora_expand: slice_sizes: expected sizes summing to out_features=10"):
            ops.lora_expand(case["y"], case["buffer"], case["lora_b"], case["lora_indices"], [6, 3])


class LoRALinear(torch.nn.Module):
    """A merged linear (slices 6, 4) with its adapters, as the step graph calls the ops."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(8, 10, bias=False)

    def forward(self, x, lora_indices, lora_a, lora_b):
        buffer = ops.lora_shrink(x, lora_a, lora_indices)
        return ops.lora_expand(self.base(x), buffer, lora_b, lora_indices, [6, 4])


def test_export_with_a_dynamic_token_count():
    case = make(5, 8, (6, 4), 2, 3, torch.float32, [0, 1, -1, 2, 0])
    module = LoRALinear().eval()
    tokens = torch.export.Dim("T", min=1, max=4096)
    args = (case["x"], case["lora_indices"], case["lora_a"], case["lora_b"])
    program = torch.export.export(module, args, dynamic_shapes=({1: tokens}, {0: tokens}, None, None))
    other = make(9, 8, (6, 4), 2, 3, torch.float32, [2, 2, -1, 0, 1, 1, -1, 0, 2], seed=1)
    for c in (case, other):
        args = (c["x"], c["lora_indices"], c["lora_a"], c["lora_b"])
        torch.testing.assert_close(program.module()(*args), module(*args))
