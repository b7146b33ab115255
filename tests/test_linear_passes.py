"""The linear passes: ``merge_linears`` (one GEMM per group of projections sharing an input) and
the reference target's CPU lowering (oneDNN linears on prepacked weights): counts, shared weight
memory, the undo on a failed check, and greedy tokens equal to the unmodified model's."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedpack import LLM, SamplingParams
from pagedpack.lowering.reference import cpu, cpu_linear
from pagedpack.models.capture import capture
from pagedpack.models.tiny import tiny_model
from pagedpack.passes import linear_merge
from pagedpack.passes.pipeline import rewrite

from conftest import hf_greedy, random_prompts, snapshot

LAYERS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
LINEAR, ONEDNN = torch.ops.aten.linear.default, torch.ops.mkldnn._linear_pointwise.default


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
    bf16 = torch.bfloat16 in cpu_linear.packable_dtypes()  # where oneDNN has bf16 kernels for this CPU
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
