"""The rotary embedding in three kernels (``lowering/reference/cpu_rotary.py``): the values of
``transformers``' ``apply_rotary_pos_emb`` to rounding, which forms are fused and which are left
alone, and greedy tokens equal to the unmodified model's across the families' rotary forms."""
import pytest
import torch
import transformers as T
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedpack import LLM, SamplingParams
from pagedpack.lowering.reference import cpu_rotary

from conftest import MIXED_PROMPT_LENS, hf_greedy, random_prompts, snapshot
from test_families import SERVED


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
    sin = torch.randn(1, 10, 16, dtype=dtype) if sin is None else sin
    return torch.export.export(_Rotary(form), (q, k, cos, sin)).module(), (q, k, cos, sin)


def test_the_fused_rotary_computes_what_the_graph_did():
    gm, inputs = _graph("rotate half")
    expected = gm(*inputs)
    assert cpu_rotary.fuse_rotary(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(cpu_rotary.rotate_half_rope) == 2 and torch.ops.aten.cat.default not in targets
    for got, want in zip(gm(*inputs), expected):  # addcmul may fuse multiply and add: an ulp or so
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sin_shape", [(1, 10, 1), (3, 10, 16)])
def test_a_sin_that_does_not_fit_the_in_place_adds_is_left_alone(sin_shape):
    """From an adversarial trial: a sin of one column, or wider than x * cos, matched, and
    the fused op then failed (the CPU lowering's check caught it and dropped the whole lowering)."""
    gm, (q, k, cos, _) = _graph("rotate half", sin=torch.randn(sin_shape))
    assert cpu_rotary.fuse_rotary(gm) == 0


@pytest.mark.parametrize("form, dtype", [("interleaved", torch.float32), ("rotate half", torch.bfloat16)])
def test_other_forms_and_dtypes_are_left_alone(form, dtype):
    gm, _ = _graph(form, dtype)
    before = [n.format_node() for n in gm.graph.nodes]
    assert cpu_rotary.fuse_rotary(gm) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


# family: rotary embeddings fused (2 layers, q and k). Phi and GPT-NeoX rotate part of each head;
# Cohere's rotary is interleaved, GPT-2 and OPT have none.
FUSED = {"qwen3": 4, "gemma": 4, "phi3": 4, "phi": 4, "gpt_neox": 4, "cohere": 0, "opt": 0}


@pytest.mark.parametrize("family", FUSED)
def test_fused_rotary_steps_generate_the_unmodified_models_tokens(family):
    config_cls, config, _, _ = SERVED[family]
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config_cls(**config)).eval()
    reference = snapshot(model)
    llm = LLM(model, block_size=16, num_blocks=256, max_num_batched_tokens=96)
    assert f"{FUSED[family]} rotary embeddings in 3 kernels" in llm.report.notes[-1]
    prompts = random_prompts(MIXED_PROMPT_LENS[:8], vocab=200, seed=6)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 4), f"prompt length {len(prompt)}"
