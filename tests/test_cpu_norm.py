"""RMSNorm in one native kernel (``lowering/reference/cpu_norm.py``, ``kernels/csrc/rms_norm_cpu.cpp``):
the kernels against an fp64 reference written here, which subgraphs are fused and which are left
alone, conversions that convert nothing dropped, and greedy tokens equal to the unmodified model's
across the families' norms."""
import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference.cpu_norm import fuse_rms_norms
from pagedpack.passes.cleanup import drop_noop_conversions, strip_export_checks

from test_families import assert_cpu_lowering_keeps_greedy_tokens

pytestmark = pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")


def _rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(1, 576), (7, 13), (2, 3, 64), (0, 32), (300, 576)])
def test_native_rms_norm_is_the_fp64_norm_rounded(shape):
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    weight, eps = torch.randn(shape[-1], generator=g), 1e-6
    ops = native_ops()
    torch.testing.assert_close(ops.rms_norm(x, weight, eps).double(), _rms_norm64(x, weight, eps),
                               rtol=2e-6, atol=2e-6)
    normed, total = ops.fused_add_rms_norm(x, residual, weight, eps)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed.double(), _rms_norm64(x + residual, weight, eps), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_low_precision_rms_norm_is_transformers_norm_to_its_rounding(dtype):
    """LlamaRMSNorm computes the norm in fp32, rounds it to the dtype and multiplies by the weight
    in the dtype; the kernel rounds at those points, so only the sum of squares' rounding (which
    may move an fp32 1 / rms by an ulp, and a value across a rounding boundary) can differ."""
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(300, 576, generator=g) * 3).to(dtype), torch.randn(300, 576, generator=g).to(dtype)
    norm = LlamaRMSNorm(576, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        ops = native_ops()
        normed, total = ops.fused_add_rms_norm(x, residual, norm.weight, 1e-6)
        assert torch.equal(total, x + residual)
        for got, want in ((ops.rms_norm(x, norm.weight, 1e-6), norm(x)), (normed, norm(x + residual))):
            assert got.dtype == dtype and (got == want).float().mean() > 0.999
            torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_native_rms_norm_reads_a_strided_input():
    x, weight = torch.randn(64, 10).t(), torch.randn(64)
    torch.testing.assert_close(native_ops().rms_norm(x, weight, 1e-5).double(), _rms_norm64(x, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8)),
     "rms_norm: input, weight: expected one dtype of float32, bfloat16, float16, got BFloat16, Float"),
    ((torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)), "got Double, Double"),
    ((torch.randn(2, 8), torch.randn(7)), r"rms_norm: input \[2, 8\], weight \[7\]: expected weight \[D\] for input"),
    ((torch.randn(2, 8), torch.randn(2, 8)), r"expected weight \[D\] for input \[\.\.\., D\]"),
])
def test_native_rms_norm_refuses_what_it_does_not_compute(args, message):
    with pytest.raises(ValueError, match=message):
        native_ops().rms_norm(*args, 1e-6)


def test_native_fused_add_refuses_a_residual_of_another_shape():
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual \[2, 4\] Float: expected input's shape"):
        native_ops().fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.randn(8), 1e-6)


class _Block(torch.nn.Module):
    """Two norms as a decoder layer has them: the first of its input, the second of ``x + residual``."""

    def __init__(self, norm=LlamaRMSNorm) -> None:
        super().__init__()
        self.first, self.second = norm(16, eps=1e-5), norm(16, eps=1e-6)
        with torch.no_grad():
            for module in (self.first, self.second):
                module.weight.copy_(torch.randn(16))

    def forward(self, x, residual):
        h = x + residual
        return self.first(x), self.second(h), h * 2


def _graph(norm=LlamaRMSNorm, dtype=torch.float32):
    """The block's exported graph without export's asserts, as the CPU lowering first makes it."""
    torch.manual_seed(0)
    inputs = (torch.randn(3, 5, 16, dtype=dtype), torch.randn(3, 5, 16, dtype=dtype))
    gm = torch.export.export(_Block(norm).to(dtype), inputs).module()
    strip_export_checks(gm)
    return gm, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_norms_compute_what_the_graph_did(dtype):
    gm, inputs = _graph(dtype=dtype)
    expected = gm(*inputs)
    # an fp32 model's norms cast to fp32 and back (converting nothing); a bf16 / fp16 one's convert
    assert drop_noop_conversions(gm) == (4 if dtype == torch.float32 else 0)
    assert fuse_rms_norms(gm) == (2, 1)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.rsqrt.default not in targets and torch.ops.aten.pow.Tensor_Scalar not in targets
    assert torch.ops.aten.to.dtype not in targets
    ops = native_ops()
    assert targets.count(ops.rms_norm.default) == 1 and targets.count(ops.fused_add_rms_norm.default) == 1
    for got, want in zip(gm(*inputs), expected, strict=True):
        assert got.dtype == want.dtype
        tolerance = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # at most a rounding step
        torch.testing.assert_close(got, want, rtol=tolerance, atol=1e-6)


class _SumNorm(LlamaRMSNorm):
    """A norm by the sum of squares, not their mean: not an RMSNorm."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.variance_epsilon))


def test_gemmas_one_plus_weight_is_the_weight_of_a_fused_norm():
    gm, inputs = _graph(GemmaRMSNorm)
    expected = gm(*inputs)
    drop_noop_conversions(gm)
    assert fuse_rms_norms(gm) == (2, 0)  # 1 + weight is computed after the residual add: not fused with it
    for got, want in zip(gm(*inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_norms_are_left_alone(dtype):
    """A norm of another formula."""
    gm, _ = _graph(_SumNorm, dtype)
    drop_noop_conversions(gm)
    before = [n.format_node() for n in gm.graph.nodes]
    assert fuse_rms_norms(gm) == (0, 0)
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_conversions_that_convert_are_kept():
    class Casts(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float32) * 2, x.to(torch.float64), x.to(torch.float32, copy=True)

    x = torch.randn(4)
    gm = torch.export.export(Casts(), (x,)).module()
    strip_export_checks(gm)
    assert drop_noop_conversions(gm) == 1
    kept = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.ops.aten.to.dtype,
                                                                                  torch.ops.aten._to_copy.default)]
    assert len(kept) == 2
    got = gm(x)
    assert torch.equal(got[0], x * 2) and got[1].dtype == torch.float64 and got[2].data_ptr() != x.data_ptr()


# family: (RMSNorms replaced, of them with their residual add) in the 2-layer models: two a layer and the
# final one, all but the first layer's input norm after a residual add; Qwen3 adds q/k norms over each
# head; Gemma computes its 1 + weight after the add; GPT-NeoX's are LayerNorms.
NORMS = {"llama": (5, 4), "qwen3": (9, 4), "mistral": (5, 4), "phi3": (5, 4), "gemma": (5, 0), "gpt_neox": (0, 0)}


@pytest.mark.parametrize("family", NORMS)
def test_fused_norm_steps_generate_the_unmodified_models_tokens(family):
    norms, fused = NORMS[family]
    note = f"{norms} RMSNorms as native kernels ({fused} with their residual add)"
    assert_cpu_lowering_keeps_greedy_tokens(family, note, seed=7)
