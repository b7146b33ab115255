"""The rotary embedding in one kernel (``lowering/reference/cpu_rotary.py``,
``kernels/csrc/rotary_cpu.cpp``): the native kernel against an fp64 reference written here and
against ``transformers``' ``apply_rotary_pos_emb`` (bit for bit in bf16 / fp16), the fp32
three-kernel fallback, which forms are fused and which are left alone, and greedy tokens equal to
the unmodified model's across the families' rotary forms."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference import cpu_rotary

from test_families import assert_cpu_lowering_keeps_greedy_tokens


class _Rotary(torch.nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, q, k, cos, sin):
        if self.form == "interleaved":  # GPT-J's pairs (x0, x1) -> (-x1, x0): not rotate-half
            rotated = torch.stack((-q[..., 1::2], q[..., ::2]), dim=-1).flatten(-2)
            return q * cos + rotated * sin, k
        return apply_rotary_pos_emb(q, k, cos, sin)  # transformers' rotate-half form


def _graph(form: str, dtype=torch.float32, sin=None):
    q, k = torch.randn(1, 4, 10, 16, dtype=dtype), torch.randn(1, 2, 10, 16, dtype=dtype)
    cos = torch.randn(1, 10, 16, dtype=dtype)
    sin = torch.randn(1, 10, 16, dtype=dtype) if sin is None else sin.to(dtype)
    return torch.export.export(_Rotary(form), (q, k, cos, sin)).module(), (q, k, cos, sin)


needs_native = pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * cos.double() + torch.cat([-x2, x1], -1) * sin.double()


@needs_native
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_native_rope_is_the_fp64_rope_rounded_and_the_graphs_bit_for_bit(tokens):
    """x as the graph hands it over: q of a packed q/k/v projection, viewed [1, H, T, D]; the output
    laid out so that its [T, H, D] view is contiguous."""
    g = torch.Generator().manual_seed(tokens)
    projection = torch.randn(1, tokens, 9 * 64 + 2 * 3 * 64, generator=g) * 4
    angles = torch.randn(1, tokens, 64, generator=g) * 10
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = projection.to(dtype)[..., :576].view(1, tokens, 9, 64).transpose(1, 2)
        cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
        got = native_ops().rotate_half_rope(x, cos, sin)
        assert got.dtype == dtype and got[0].transpose(0, 1).is_contiguous()
        torch.testing.assert_close(got.double(), _rope64(x, cos, sin), rtol=2e-6 if dtype == torch.float32 else
                                   2.0 ** -7, atol=1e-5 if dtype == torch.float32 else 2.0 ** -7 * 4)
        if dtype != torch.float32:  # each product and the sum rounded where the graph rounds them
            assert torch.equal(got, apply_rotary_pos_emb(x, x, cos[:, 0], sin[:, 0])[0])  # it unsqueezes dim 1


@needs_native
@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8)), "got Float, BFloat16, Float"),
    ((torch.randn(2, 8, dtype=torch.float64),) * 3, "expected one dtype of float32, bfloat16, float16, got Double"),
    ((torch.randn(2, 7),) * 3, r"x \[2, 7\]: expected a last dimension of even size"),
    ((torch.randn(2, 8), torch.randn(3, 8), torch.randn(2, 8)), r"cos \[3, 8\], sin \[2, 8\]: expected shapes"),
])
def test_native_rope_refuses_what_it_does_not_compute(args, message):
    with pytest.raises(ValueError, match=message):
        native_ops().rotate_half_rope(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_rotary_computes_what_the_graph_did(dtype):
    if native_ops() is None and dtype != torch.float32:
        pytest.skip("no native CPU kernels (no C++ compiler)")
    gm, inputs = _graph("rotate half", dtype)
    expected = gm(*inputs)
    assert cpu_rotary.fuse_rotary(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    fused = native_ops().rotate_half_rope.default if native_ops() is not None else cpu_rotary.rotate_half_rope
    assert targets.count(fused) == 2 and torch.ops.aten.cat.default not in targets
    for got, want in zip(gm(*inputs), expected):
        if dtype == torch.float32:  # a multiply and an add may be fused: an ulp or so
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want)


def test_without_native_kernels_fp32_rotary_runs_in_three_kernels_and_other_dtypes_are_left_alone(monkeypatch):
    monkeypatch.setattr(cpu_rotary, "native_ops", lambda: None)
    gm, inputs = _graph("rotate half")
    expected = gm(*inputs)
    assert cpu_rotary.fuse_rotary(gm) == 2
    assert [n.target for n in gm.graph.nodes].count(cpu_rotary.rotate_half_rope) == 2
    for got, want in zip(gm(*inputs), expected):  # addcmul may fuse multiply and add: an ulp or so
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    gm, _ = _graph("rotate half", torch.bfloat16)
    assert cpu_rotary.fuse_rotary(gm) == 0


@pytest.mark.parametrize("sin_shape", [(1, 10, 1), (3, 10, 16)])
def test_a_sin_that_does_not_fit_the_in_place_adds_is_left_alone(sin_shape):
    """From an adversarial trial: a sin of one column, or wider than x * cos, matched, and
    the fused op then failed (the CPU lowering's check caught it and dropped the whole lowering)."""
    gm, (q, k, cos, _) = _graph("rotate half", sin=torch.randn(sin_shape))
    assert cpu_rotary.fuse_rotary(gm) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_forms_are_left_alone(dtype):
    gm, _ = _graph("interleaved", dtype)
    before = [n.format_node() for n in gm.graph.nodes]
    assert cpu_rotary.fuse_rotary(gm) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


# family: rotary embeddings fused (2 layers, q and k). Phi and GPT-NeoX rotate part of each head;
# Cohere's rotary is interleaved, GPT-2 and OPT have none.
FUSED = {"qwen3": 4, "gemma": 4, "phi3": 4, "phi": 4, "gpt_neox": 4, "cohere": 0, "opt": 0}


@pytest.mark.parametrize("family", FUSED)
def test_fused_rotary_steps_generate_the_unmodified_models_tokens(family):
    assert_cpu_lowering_keeps_greedy_tokens(family, f"{FUSED[family]} rotary embeddings fused", seed=6)
