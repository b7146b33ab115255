"""Row-chunked MLPs (``lowering/reference/cpu_mlp.py``): which subgraphs are chunked and which are left alone,
the chunked graph against the graph as it was, and greedy tokens equal to the unmodified model's
``generate`` with steps many chunks long, across the MLP forms of the families."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedpack import LLM, SamplingParams
from pagedpack.lowering.reference import cpu, cpu_mlp

from conftest import MIXED_PROMPT_LENS, hf_greedy, random_prompts, snapshot
from test_families import SERVED


class _Mlp(torch.nn.Module):
    """An MLP of ``form``: a gated one (``gated``), one with a bias and GELU (``plain``), or one the
    pass must leave alone because a row depends on more than its own row of ``x``."""

    def __init__(self, form: str, hidden: int = 16, inter: int = 40) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.fc = torch.nn.Linear(hidden, inter)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        self.scale = torch.nn.Parameter(torch.rand(inter) + 0.5)
        self.table = torch.nn.Parameter(torch.rand(64, inter))
        self.row = torch.nn.Parameter(torch.rand(1, hidden))

    def forward(self, x):
        if self.form == "gated":
            gate, up = self.gate_up(x).split(self.fc.out_features, dim=-1)
            return self.down(F.silu(gate) * up * self.scale)
        if self.form == "positive dim":  # the features' dimension by its index in x's rank
            gate, up = self.gate_up(x).chunk(2, dim=x.dim() - 1)
            return self.down(torch.tanh(gate) * torch.sigmoid(up))
        if self.form == "plain":
            return self.down(F.gelu(self.fc(x), approximate="tanh"))
        if self.form == "residual inside":  # another tensor joins the region
            return self.down(F.gelu(self.fc(x)) + x.sum(-1, keepdim=True))
        if self.form == "row table":  # a constant with a row per token
            return self.down(self.fc(x) * self.table[: x.shape[-2]])
        if self.form == "used outside":  # an intermediate is also a result
            hidden = F.relu(self.fc(x))
            return self.down(hidden), hidden
        if self.form == "token slice":  # a slice over tokens, not features
            return self.down(F.relu(self.fc(x))[..., 1:, :])
        if self.form == "constant rows":  # a linear of a constant: rows that are not x's
            return self.down(F.relu(self.fc(x)) + self.fc(self.row))
        raise ValueError(self.form)


def _graph(form: str, rows: int = 64) -> torch.fx.GraphModule:
    x = torch.randn(2, rows, 16)
    dynamic = {"x": {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}}
    return torch.export.export(_Mlp(form), (x,), dynamic_shapes=dynamic).module()


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 63])
@pytest.mark.parametrize("form", ["gated", "positive dim", "plain"])
def test_a_chunked_mlp_computes_what_the_graph_did(form, rows):
    gm = _graph(form)
    x = torch.randn(1, rows, 16)
    with torch.no_grad():
        expected = gm(x)
        assert cpu_mlp.chunk_mlps(gm, rows=8) == 1
        got = gm(x)
    assert [type(m) for m in gm.children()].count(cpu_mlp.RowChunked) == 1
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_rows_are_all_leading_dimensions():
    gm = _graph("plain")
    x = torch.randn(3, 7, 16)  # 21 rows
    with torch.no_grad():
        expected = gm(x)
        assert cpu_mlp.chunk_mlps(gm, rows=5) == 1
        torch.testing.assert_close(gm(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["residual inside", "row table", "used outside", "token slice", "constant rows"])
def test_a_region_that_is_not_row_local_is_left_alone(form):
    gm = _graph(form)
    before = [n.format_node() for n in gm.graph.nodes]
    assert cpu_mlp.chunk_mlps(gm, rows=8) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


class _ActivationWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Parameter(torch.rand(16, 16)), torch.nn.Parameter(torch.rand(16, 16))

    def forward(self, x):
        aten = torch.ops.aten
        h = aten.relu.default(aten.linear.default(x, self.up))
        return aten.linear.default(aten.linear.default(h, h), self.down)  # h's rows as a weight: rows mix


def test_a_linear_whose_weight_is_an_activation_is_left_alone():
    gm = torch.fx.symbolic_trace(_ActivationWeight())
    assert cpu_mlp.chunk_mlps(gm, rows=4) == 0


def test_a_chunk_larger_than_any_step_builds_quickly():
    """From an adversarial trial: the lowering's check added prefills until its example step was
    longer than a chunk, which for 10**9 rows never ended. Run in a child with a time bound, so a
    regression fails instead of hanging the suite."""
    script = ("from pagedpack import LLM; from pagedpack.lowering.reference import cpu; cpu.CHUNK_ROWS = 10**9; "
              "print(LLM('tiny', num_blocks=64).program.note)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MLPs run 1000000000 token rows at a time" in done.stdout and "kept the graph" not in done.stdout


# family: MLPs chunked (of 2 layers). Phi's MLP reads the GEMM it shares with q/k/v (parallel attention,
# merged), GPT-2's projections are addmm (Conv1D), Mixtral's experts are routed per token: left alone.
CHUNKED = {"gemma": 2, "qwen3": 2, "phi3": 2, "gpt_neox": 2, "opt": 2, "bloom": 2, "phi": 0, "gpt2": 0, "mixtral": 0}


@pytest.mark.parametrize("family", CHUNKED)
def test_chunked_steps_generate_the_unmodified_models_tokens(family, monkeypatch):
    """A chunk of 8 rows: every prefill step of the 96-token budget runs its MLPs in 2-12 chunks."""
    monkeypatch.setattr(cpu, "CHUNK_ROWS", 8)
    config_cls, config, _, _ = SERVED[family]
    torch.manual_seed(0)
    model = __import__("transformers").AutoModelForCausalLM.from_config(config_cls(**config)).eval()
    reference = snapshot(model)
    llm = LLM(model, block_size=16, num_blocks=256, max_num_batched_tokens=96)
    chunked = [m for m in llm.program.run.modules() if isinstance(m, cpu_mlp.RowChunked)]
    assert len(chunked) == CHUNKED[family] and all(m.rows == 8 for m in chunked)
    assert f"{len(chunked)} MLPs run 8 token rows at a time" in llm.report.notes[-1]
    prompts = random_prompts(MIXED_PROMPT_LENS[:8], vocab=200, seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 4), f"prompt length {len(prompt)}"
