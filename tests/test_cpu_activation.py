"""A gated MLP's ``silu(gate) * up`` / ``gelu_tanh(gate) * up`` in one native kernel
(``lowering/reference/cpu_activation.py``, ``kernels/csrc/silu_and_mul_cpu.cpp``): the kernels against
fp64 references written here and against ATen's two ops (bit for bit where they take the same exp),
which products are fused and which are left alone, and greedy tokens equal to the unmodified model's
across the families' MLPs."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference.cpu_activation import fuse_gated_activations
from pagedpack.passes.cleanup import strip_export_checks

from test_families import assert_cpu_lowering_keeps_greedy_tokens

pytestmark = pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")


# the cases of :func:`_gate_up`: any row count and width (rows of whole vectors and ragged tails)
_GATE_UP = dict(rows=st.integers(0, 40), inter=st.integers(1, 100), merged=st.booleans(),
                dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31))


def _gate_up(rows: int, inter: int, merged: bool, dtype: torch.dtype, seed: int):
    """``(gate, up)`` ``[rows, inter]``: the halves of a merged gate/up output (views with a row
    stride) or two tensors of their own; gate values wide enough to reach both tails of the activation."""
    g = torch.Generator().manual_seed(seed)
    if merged:
        y = torch.randn(1, rows, 2 * inter, generator=g) * 6
        gate, up = y[..., :inter], y[..., inter:]
    else:
        gate, up = torch.randn(rows, inter, generator=g) * 6, torch.randn(rows, inter, generator=g)
    return gate.to(dtype), up.to(dtype)


def _silu_and_mul64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.double()
    return g / (1 + torch.exp(-g)) * up.double()


@settings(max_examples=30, deadline=None)
@given(**_GATE_UP)
def test_native_silu_and_mul_is_atens_two_ops(rows, inter, merged, dtype, seed):
    """The halves of a merged gate/up output (views with a row stride) or two tensors of their own,
    any row count and width (rows of whole vectors and ragged tails): ATen's ``silu`` then ``mul``
    bit for bit, and in fp32 the fp64 product to a few ulps. (Under ATen's parallel threshold, so
    that its scalar tails are the rows' own: past it, each thread's share ends in one, which may
    move an fp32 value by an ulp.)"""
    gate, up = _gate_up(rows, inter, merged, dtype, seed)
    got = native_ops().silu_and_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    if merged or dtype != torch.float32:
        # a contiguous fp32 pair is one flat run for ATen: its tail (scalar exp) falls elsewhere
        assert torch.equal(got, F.silu(gate) * up)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), _silu_and_mul64(gate, up), rtol=4e-7, atol=1e-7)


def _gelu_tanh_and_mul64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.double()
    return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * up.double()


@settings(max_examples=30, deadline=None)
@given(**_GATE_UP)
def test_native_gelu_tanh_and_mul_is_atens_two_ops(rows, inter, merged, dtype, seed):
    """Gemma's ``gelu(gate, approximate="tanh") * up``: ATen's two ops to within their own variation
    (ATen's result moves with the layout where ``1 + tanh`` cancels: a very negative gate gives a
    product of about 1e-7 or of 0, whichever tanh the element met), and the fp64 product to a few of
    the dtype's steps and fp32's own cancellation there."""
    gate, up = _gate_up(rows, inter, merged, dtype, seed)
    got = native_ops().gelu_tanh_and_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    step = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    # fp32's cancellation in 1 + tanh (the kernel and ATen compute in fp32): a few fp32 steps of
    # 0.5 * |gate * up|; and the dtype's smallest subnormal where a value underflows (fp16: 2^-24)
    subnormal = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    slack = 8 * 2.0 ** -23 * 0.5 * (gate.double() * up.double()).abs() + 2 * subnormal * (1 + up.double().abs())
    want = (F.gelu(gate, approximate="tanh") * up).double()
    assert ((got.double() - want).abs() <= 2 * step * want.abs() + slack).all()
    ref = _gelu_tanh_and_mul64(gate, up)
    bound = 4 * step * ref.abs() + slack
    assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8)),
     "silu_and_mul: gate, up: expected one dtype of float32, bfloat16, float16, got BFloat16, Float"),
    ((torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)), "got Double, Double"),
    ((torch.randn(2, 8), torch.randn(2, 7)), r"silu_and_mul: gate \[2, 8\], up \[2, 7\]: expected one shape"),
    ((torch.randn(2, 8), torch.randn(8)), r"gate \[2, 8\], up \[8\]: expected one shape \[\.\.\., I\]"),
])
def test_native_silu_and_mul_refuses_what_it_does_not_compute(args, message):
    with pytest.raises(ValueError, match=message):
        native_ops().silu_and_mul(*args)
    with pytest.raises(ValueError, match=message.replace("silu_and_mul", "gelu_tanh_and_mul")):
        native_ops().gelu_tanh_and_mul(*args)


class _Mlps(torch.nn.Module):
    """A merged gated MLP (SiLU first, as Llama; ``up * silu(gate)``, as Phi-3; GELU's tanh form, as
    Gemma), and products the pass must leave alone: a SiLU with a second user, a broadcast ``up``,
    GELU's erf form, a product of transposed operands (ATen's keeps their layout, which the ``view``
    after it needs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate_up = torch.nn.Linear(16, 80, bias=False)
        self.down = torch.nn.Linear(40, 16, bias=False)
        self.scale = torch.nn.Parameter(torch.rand(40))

    def forward(self, x):
        gate, up = self.gate_up(x).split(40, dim=-1)
        llama = self.down(F.silu(gate) * up)
        phi3 = self.down(up * F.silu(gate))
        shared = F.silu(up)
        kept = shared * gate + shared
        broadcast = F.silu(gate) * self.scale
        gelu = F.gelu(gate) * up
        gemma = self.down(F.gelu(gate, approximate="tanh") * up)
        transposed = (F.silu(gate.transpose(-1, -2)) * up.transpose(-1, -2)).transpose(-1, -2).view(-1)
        return llama, phi3, kept, broadcast, gelu, gemma, transposed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_products_compute_what_the_graph_did(dtype):
    x = torch.randn(3, 5, 16).to(dtype)
    gm = torch.export.export(_Mlps().to(dtype), (x,)).module()
    strip_export_checks(gm)
    expected = gm(x)
    assert fuse_gated_activations(gm) == 3
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(native_ops().silu_and_mul.default) == 2
    assert targets.count(native_ops().gelu_tanh_and_mul.default) == 1
    assert targets.count(torch.ops.aten.silu.default) == 3  # the shared, the broadcast, the transposed one
    assert targets.count(torch.ops.aten.gelu.default) == 1  # the erf form
    for got, want in zip(gm(x), expected, strict=True):
        assert torch.equal(got, want)


# family: silu(gate) * up (Gemma: gelu_tanh(gate) * up) fused in the 2-layer models (one a layer);
# GPT-NeoX's MLPs are not gated.
FUSED = {"llama": 2, "qwen3": 2, "mistral": 2, "phi3": 2, "gemma": 2, "gemma3": 2, "gpt_neox": 0}


@pytest.mark.parametrize("family", FUSED)
def test_fused_activation_steps_generate_the_unmodified_models_tokens(family):
    assert_cpu_lowering_keeps_greedy_tokens(family, f"{FUSED[family]} silu / gelu_tanh(gate) * up fused", seed=7)
