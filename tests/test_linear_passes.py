"""The linear passes: ``merge_linears`` (one GEMM per group of projections sharing an input) and
the reference target's CPU lowering (oneDNN linears on prepacked weights; bf16 without oneDNN bf16
kernels, the native GEMM, against an fp64 reference written here): counts, shared weight memory, the
undo on a failed check, and greedy tokens equal to the unmodified model's."""
import copy
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack import LLM, SamplingParams
from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference import cpu, cpu_linear
from pagedpack.models.capture import capture
from pagedpack.models.tiny import tiny_model
from pagedpack.passes import linear_merge
from pagedpack.passes.pipeline import rewrite

from conftest import hf_greedy, random_prompts, snapshot

LAYERS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
LINEAR, ONEDNN = torch.ops.aten.linear.default, torch.ops.mkldnn._linear_pointwise.default
# bf16 linears go to the native GEMM where oneDNN has no bf16 kernels for this CPU (cpu_linear._kind)
NATIVE_BF16 = torch.bfloat16 not in cpu_linear.packable_dtypes() and native_ops() is not None


def _count(gm, target) -> int:
    """Calls of ``target`` in ``gm``'s graph and the graphs of its submodules (row-chunked MLPs)."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(n.target is target for graph in graphs for n in graph.nodes)


def _merge_row(report):
    return next(p for p in report.passes if p.name == "merge_linears")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_qkv_and_gate_up_are_merged_and_the_weights_stored_once(family):
    model = tiny_model(family)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = rewrite(capture(model))
    result.raise_if_refused()
    row = _merge_row(result.report)
    assert (row.matched, row.rewritten) == (2 * LAYERS, 2 * LAYERS)  # qkv and gate_up per layer
    gm = result.graph_module
    assert _count(gm, LINEAR) == 4 * LAYERS + 1  # qkv, o, gate_up, down per layer; the LM head
    attn = model.model.layers[0].self_attn
    merged = gm.model_model_layers_0_self_attn_q_proj_weight_merged
    assert merged.shape == (64 + 32 + 32, 64)
    assert hasattr(gm, "model_model_layers_0_self_attn_q_proj_bias_merged") == (family == "qwen2")  # qkv bias
    # the model's parameters are views of the merged tensors, their values unchanged
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


class _SeparateInputs(torch.nn.Module):
    """One causal attention layer whose q, k and v projections read three different tensors."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, input_ids, position_ids, use_cache=False):
        x = self.embed(input_ids)
        q, k, v = (proj(h).view(1, -1, 2, 8).transpose(1, 2)
                   for proj, h in ((self.q, x), (self.k, torch.tanh(x)), (self.v, 2 * x)))
        hidden = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, -1, 16)
        return SimpleNamespace(logits=self.head(hidden))


def test_projections_of_different_inputs_are_left_alone():
    result = rewrite(capture(_SeparateInputs()))
    result.raise_if_refused()
    row = _merge_row(result.report)
    assert (row.matched, row.rewritten) == (0, 0)
    assert _count(result.graph_module, LINEAR) == 4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merged_and_prepacked_step_generates_the_unmodified_models_tokens(family):
    model = tiny_model(family)
    reference = snapshot(model)
    llm = LLM(model, block_size=16, num_blocks=64, max_num_batched_tokens=64, keep_source_model=True)
    assert _merge_row(llm.report).rewritten == 2 * LAYERS
    if cpu_linear.available():
        program = llm.program.run
        assert program is not llm.rewritten.graph_module  # the exported graph keeps aten.linear
        assert _count(program, ONEDNN) == 4 * LAYERS + 1 and _count(program, LINEAR) == 0
        assert _count(llm.rewritten.graph_module, LINEAR) == 4 * LAYERS + 1
        assert any("prepacked" in note for note in llm.report.notes)
    prompts = random_prompts((1, 17, 70), seed=3)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6), f"prompt length {len(prompt)}"


def test_a_merge_that_fails_the_check_is_undone(monkeypatch):
    real = linear_merge.merge_group

    def wrong_merge(gm, linears):  # a merged weight off by 1 %: the float64 comparison must catch it
        merge = real(gm, linears)
        getattr(gm, merge.added_attrs[0]).data.mul_(1.01)
        return merge

    monkeypatch.setattr(linear_merge, "merge_group", wrong_merge)
    model = tiny_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = rewrite(capture(model))
    result.raise_if_refused()  # an optimisation that fails is undone, not a refusal
    row = _merge_row(result.report)
    assert (row.matched, row.rewritten, row.refused) == (2 * LAYERS, 0, 0)
    assert any("merge undone" in n and "float64" in n for n in result.report.notes), result.report.notes
    gm = result.graph_module
    assert _count(gm, LINEAR) == 7 * LAYERS + 1
    assert not any(name.endswith("_merged") for name, _ in gm.named_parameters())
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


@pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN is not available")
def test_a_prepacked_graph_that_differs_falls_back_to_the_rewritten_one(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "FP32_RTOL", -1.0)  # any difference at all is too much
    llm = LLM(tiny_model("llama"), num_blocks=16)
    assert llm.program.run is llm.rewritten
    assert any("kept the graph as it was" in note for note in llm.report.notes), llm.report.notes
    served = LLM.from_exported(llm.export(tmp_path / "step.pt2"), num_blocks=16)  # a .pt2's program alike
    assert served.program.note.startswith("loaded from "), served.program.note
    assert "; cpu lowering: kept the graph as it was" in served.program.note, served.program.note
    assert not any(n.target is torch.ops.mkldnn._linear_pointwise.default for n in served.program.run.graph.nodes)


@pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN is not available")
def test_prepack_linears_packs_each_weight_once():
    bf16 = torch.bfloat16 in cpu_linear.packable_dtypes() or NATIVE_BF16
    for dtype, packed in ((torch.float32, 4 * LAYERS + 1), (torch.bfloat16, (4 * LAYERS + 1) * bf16),
                          (torch.float16, 0)):
        gm = rewrite(capture(tiny_model("llama", dtype=dtype))).graph_module
        lowered = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        assert cpu_linear.prepack_linears(lowered) == packed
        assert len([name for name, _ in lowered.named_buffers() if name.endswith("_packed")]) == packed
        assert _count(gm, LINEAR) == 4 * LAYERS + 1  # the source graph is untouched


@pytest.mark.skipif(torch.bfloat16 not in cpu_linear.packable_dtypes(), reason="no oneDNN bf16 kernels here")
@pytest.mark.parametrize("rows", [1, 2, 37, 300])
def test_a_prepacked_bf16_linear_is_f_linear_s_result_bit_for_bit(rows):
    """Both are oneDNN's bf16 inner product with fp32 accumulation; packing moves the weight reorder
    from every call to lowering time and changes no bit."""
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(576, 960, dtype=torch.bfloat16)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    gm = torch.export.export(Linear(), (x,)).module()
    expected = gm(x)
    assert cpu_linear.prepack_linears(gm) == 1
    assert torch.equal(gm(x), expected)


def _bf16_linear64(x, weight, bias):
    """fp64 ``x W^T + b`` and the bound of an fp32 sum of the exact products rounded once to bf16:
    half a bf16 step of the result, plus ``K`` fp32 rounding steps of the products' absolute sum."""
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    return ref, 2.0 ** -8 * ref.abs() + 2 * weight.shape[1] * 2.0 ** -24 * magnitude + 1e-30


@pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")
@settings(max_examples=40, deadline=None)
@given(lead=st.sampled_from([(), (1,), (2, 1)]), rows=st.integers(0, 20), k=st.integers(0, 70),
       n=st.integers(1, 70), bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**31))
def test_native_bf16_linear_is_the_fp64_product_rounded_once(lead, rows, k, n, bias, strided, seed):
    """Any row count (ragged micro-kernel tiles), width and output count (a ragged last panel), leading
    dimensions, a bias or none, ``x`` a strided view: within the bound of an fp32 sum rounded once."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, 2 * k if strided else k, generator=g).bfloat16()
    x = x[..., ::2] if strided else x
    weight, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16() if bias else None
    ops = native_ops()
    got = ops.bf16_linear(x, ops.bf16_linear_pack(weight), b, n)
    assert got.shape == (*lead, rows, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    ref, bound = _bf16_linear64(x, weight, b)
    assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")
def test_native_bf16_linear_at_a_models_shapes_and_row_counts():
    """SmolLM2's gate_up and down shapes at decode and prefill row counts (several row chunks and
    threads' panel ranges), against the fp64 reference."""
    ops, g = native_ops(), torch.Generator().manual_seed(0)
    for k, n in ((576, 3072), (1536, 576)):
        weight = torch.randn(n, k, generator=g).bfloat16()
        packed = ops.bf16_linear_pack(weight)
        assert packed.shape == (-(-n // packed.shape[2]), k, packed.shape[2]) and packed.dtype == torch.bfloat16
        for rows in (1, 7, 300):
            x = torch.randn(1, rows, k, generator=g).bfloat16()
            ref, bound = _bf16_linear64(x, weight, None)
            assert ((ops.bf16_linear(x, packed, None, n).double() - ref).abs() <= bound).all(), (k, n, rows)


@pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")
@pytest.mark.parametrize("call, message", [
    (lambda o, p: o.bf16_linear_pack(torch.ones(4, 8)), "weight: expected a bfloat16 tensor [N, K], got Float"),
    (lambda o, p: o.bf16_linear(torch.ones(2, 8), p, None, 20), "x: expected a bfloat16 tensor [..., 8], got Float"),
    (lambda o, p: o.bf16_linear(torch.ones(2, 9).bfloat16(), p, None, 20), "x: expected a bfloat16 tensor [..., 8]"),
    (lambda o, p: o.bf16_linear(torch.ones(2, 8).bfloat16(), p, None, 99), "out_features: expected a count in"),
    (lambda o, p: o.bf16_linear(torch.ones(2, 8).bfloat16(), p[:0], None, -5), "expected a count in (-1, 0] for 0"),
    (lambda o, p: o.bf16_linear(torch.ones(2, 8).bfloat16(), p.float(), None, 20), "packed: expected"),
    (lambda o, p: o.bf16_linear(torch.ones(2, 8).bfloat16(), p, torch.ones(3).bfloat16(), 20),
     "bias: expected a bfloat16 tensor [20]"),
])
def test_native_bf16_linear_refuses_what_it_does_not_compute(call, message):
    ops = native_ops()
    with pytest.raises(ValueError, match=re.escape(message)):
        call(ops, ops.bf16_linear_pack(torch.ones(20, 8).bfloat16()))


@pytest.mark.skipif(not NATIVE_BF16, reason="oneDNN has bf16 kernels for this CPU (or no native kernels)")
def test_native_bf16_step_generates_the_unmodified_models_tokens():
    """A bf16 model on a CPU without oneDNN bf16 kernels: every linear runs the native GEMM, and the
    greedy tokens are the unmodified bf16 model's, one sequence at a time."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    reference = snapshot(model)
    llm = LLM(model, block_size=16, num_blocks=64, max_num_batched_tokens=64)
    assert _count(llm.program.run, native_ops().bf16_linear.default) == 4 * LAYERS + 1
    assert _count(llm.program.run, LINEAR) == 0
    prompts = random_prompts((1, 17, 70), seed=3)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6), f"prompt length {len(prompt)}"


@pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")
def test_the_bf16_excess_accepts_another_summation_order_and_flags_a_wrong_gemm():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(37, 1536, generator=g).bfloat16(), torch.randn(576, 1536, generator=g).bfloat16()
    ops = native_ops()
    packed = ops.bf16_linear_pack(weight)
    assert torch.equal(cpu_linear.unpack_bf16_weight(packed, 576), weight)
    assert cpu_linear.bf16_linear_excess(ops.bf16_linear(x, packed, None, 576), x, weight, None) <= 1
    assert cpu_linear.bf16_linear_excess((x.double() @ weight.double().T).bfloat16(), x, weight, None) <= 1
    wrong = weight.clone()
    wrong[:, 7] += 1  # one weight column off
    assert cpu_linear.bf16_linear_excess(F.linear(x, wrong), x, weight, None) > 10
    nan = F.linear(x, weight)
    nan[3, 5] = float("nan")  # a NaN where F.linear has none: off; where it has one too: equal
    assert cpu_linear.bf16_linear_excess(nan, x, weight, None) == float("inf")
    x[2, 0] = float("inf")
    assert cpu_linear.bf16_linear_excess(ops.bf16_linear(x, packed, None, 576), x, weight, None) <= 1


@pytest.mark.skipif(not NATIVE_BF16, reason="oneDNN has bf16 kernels for this CPU (or no native kernels)")
def test_a_native_bf16_linear_off_its_bound_keeps_the_graph(monkeypatch):
    """The lowering's check runs each native bf16 GEMM beside ``F.linear`` (which the rest of the lowered
    copy then sees) and keeps the graph as it was when one falls outside the bound."""
    monkeypatch.setattr(cpu_linear, "bf16_linear_excess", lambda *args: 2.0)
    llm = LLM(tiny_model("llama", dtype=torch.bfloat16), num_blocks=16)
    assert llm.program.run is llm.rewritten
    assert "native bf16 linear off its F.linear by 2 times" in llm.report.notes[-1], llm.report.notes
