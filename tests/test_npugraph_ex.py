"""pagedpack as npugraph_ex's ``post_grad_custom_pre_pass``, on the op emulation and the npugraph_ex
stand-in (:mod:`pagedpack.kernels.npugraph_ex_emulation`): a user's ``torch.compile`` of
:func:`paged_step` gives the reference target's logits for prefill, mixed and decode steps; a model
the rewrite refuses, or one outside FIA's limits, compiles and runs unlowered with the refusal reported.
"""
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma3TextConfig
from transformers.modeling_outputs import CausalLMOutput

from pagedpack import LLM, SamplingParams
from pagedpack.kernels.npugraph_ex_emulation import npugraph_ex_emulation_backend
from pagedpack.lowering.ascend.limits import AscendUnverifiedWarning
from pagedpack.lowering.ascend.lower import emulated_ops
from pagedpack.lowering.ascend.npugraph_ex import PagedpackPrePass, check_torch_npu_version, paged_step
from pagedpack.models.tiny import VOCAB_SIZE, tiny_model
from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.request import Request
from pagedpack.runtime.scheduler import ScheduledRequest

from conftest import assert_within_own_error, random_prompts, snapshot
from test_ascend_schema import OP_PLUGIN_V2_14, assert_only_real_arguments

BLOCK, NUM_BLOCKS = 128, 16
PROMPT_LENS = (38, 151, 201)
# Per step, (prompt index, new tokens): prefill (one chunked), then a chunked prefill of 200 beside
# two one-token steps on cached prefixes (mixed), then a decode-only step.
STEPS = {"prefill": [(0, 36), (1, 149)], "mixed": [(2, 200), (0, 1), (1, 1)], "decode": [(0, 1), (1, 1), (2, 1)]}


def _gemma3(dtype):
    config = Gemma3TextConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=24,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                              initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()


MODELS = {"llama": lambda dtype: tiny_model("llama", dtype=dtype, head_dim=128),
          "qwen2": lambda dtype: tiny_model("qwen2", dtype=dtype, head_dim=128),
          "gemma3": _gemma3}


def _run_steps(execute) -> dict[str, torch.Tensor]:
    """Each step of :data:`STEPS` through ``execute(metadata) -> logits``, fresh requests and blocks."""
    requests = [Request(str(i), p, SamplingParams()) for i, p in enumerate(random_prompts(PROMPT_LENS, seed=3))]
    kv, logits = KVCacheManager(NUM_BLOCKS, BLOCK), {}
    for name, parts in STEPS.items():
        scheduled = [ScheduledRequest(requests[i], n) for i, n in parts]
        for s in scheduled:
            assert kv.allocate_slots(s.request, s.num_new_tokens)
        logits[name] = execute(build_batch(scheduled, block_size=BLOCK, num_blocks=NUM_BLOCKS)).float()
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
    return logits


def _exact(model) -> dict[str, torch.Tensor]:
    """The fp32 copy of ``model`` run unmodified on each whole prompt: per step, the row of each
    sequence's last token of that step (causal attention: a row depends on the tokens up to it)."""
    fp32 = snapshot(model).float()
    with torch.no_grad():
        full = [fp32(torch.tensor([p])).logits[0] for p in random_prompts(PROMPT_LENS, seed=3)]
    done, rows = [0] * len(PROMPT_LENS), {}
    for name, parts in STEPS.items():
        rows[name] = torch.stack([full[i][done[i] + n - 1] for i, n in parts])
        for i, n in parts:
            done[i] += n
    return rows


def _compiled(step, pre_pass):
    torch._dynamo.reset()  # every PagedStep shares forward's code: a fresh recompile budget per model
    return torch.compile(step, backend=npugraph_ex_emulation_backend, fullgraph=True,
                         options={"post_grad_custom_pre_pass": pre_pass})


def _executor(step, run):
    """``run(*inputs, **host lengths)`` on caches of its own, as ``execute(metadata) -> logits``."""
    caches = [torch.zeros(shape, dtype=spec.dtype) for spec in step.rewritten.kv_cache_specs
              for shape in spec.cache_shapes(NUM_BLOCKS, BLOCK)]

    def execute(metadata):
        with torch.no_grad():
            return run(*metadata, *caches, **step.host_lengths(metadata))
    return execute


def _eager(step):
    """The rewritten step graph on pagedpack's own ops, what the reference target runs (host lists unused)."""
    return lambda *inputs, **host_lengths: step.rewritten(*inputs)


@pytest.fixture(scope="module")
def compiled_steps():
    """Per family (built once): the bf16 model, its step, the pre-pass, the lowered graphs and
    the compiled step's logits of every step of :data:`STEPS`."""
    built = {}

    def build(family):
        if family not in built:
            model = MODELS[family](torch.bfloat16)
            step = paged_step(model)
            pre_pass = PagedpackPrePass(max_num_tokens=8192, max_num_seqs=64, ops=emulated_ops())
            graphs = []

            def recording_pass(gm, example_inputs, config):
                pre_pass(gm, example_inputs, config)
                graphs.append(gm)
            got = _run_steps(_executor(step, _compiled(step, recording_pass)))
            built[family] = SimpleNamespace(model=model, step=step, pre_pass=pre_pass, graphs=graphs, got=got)
        return built[family]
    return build


@pytest.mark.parametrize("family", list(MODELS))
def test_pre_pass_gives_the_reference_programs_logits_on_every_step_kind(family, compiled_steps):
    """Against the rewritten step on pagedpack's own ops (the reference target's program) in bf16,
    within its own error against the unmodified model in fp32."""
    built = compiled_steps(family)
    step, pre_pass = built.step, built.pre_pass
    assert step.report.ok and all(site.rewritten for site in step.report.sites)
    reference, exact = _run_steps(_executor(step, _eager(step))), _exact(built.model)
    for name in STEPS:
        assert_within_own_error(built.got[name], reference[name], exact[name])
    assert len(pre_pass.reports) == len(STEPS) and all(r.ok for r in pre_pass.reports), pre_pass.reports
    report = pre_pass.reports[-1]
    assert len(report.sites) == len(step.report.sites) == 2, report.format()
    windowed = "window=24" in report.sites[0] and "window" not in report.sites[1]
    assert windowed == (family == "gemma3"), report.format()
    v2 = "npu_fused_infer_attention_score_v2" in report.summary
    assert v2 == (family == "gemma3"), report.summary


def test_llama_gives_the_reference_targets_logits(compiled_steps):
    """The same steps through ``LLM(target="reference")`` itself (its CPU kernels)."""
    built = compiled_steps("llama")
    reference = _run_steps(LLM(built.model, target="reference", block_size=BLOCK,
                               num_blocks=NUM_BLOCKS).llm_engine.runner.execute)
    exact = _exact(built.model)
    for name in STEPS:
        assert_within_own_error(built.got[name], reference[name], exact[name])


@pytest.mark.parametrize("family", list(MODELS))
def test_the_lowered_graphs_hold_torch_npu_2_14s_ops_and_no_pagedpack_op(family, compiled_steps):
    ops = emulated_ops()
    fia = ops.fused_infer_attention_score_v2_eager if family == "gemma3" else ops.fused_infer_attention_score_eager
    graphs = compiled_steps(family).graphs
    for gm in graphs:
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert {fia, ops.scatter_nd_update} <= targets
        assert not any(getattr(t, "namespace", None) == "pagedpack" for t in targets), targets
        assert torch.ops.higher_order.auto_functionalized_v2 not in targets
    real = OP_PLUGIN_V2_14["FIA_V2" if family == "gemma3" else "FIA"]  # torch_npu 2.14's schemas
    assert_only_real_arguments(graphs, {fia: torch._C.parse_schema(real), ops.scatter_nd_update: torch._C.parse_schema(
        OP_PLUGIN_V2_14["SCATTER_FUNCTIONAL"])})


def test_a_model_outside_fias_limits_compiles_and_runs_unlowered_with_the_refusal_reported():
    """fp32 is outside FIA's TND form (bf16): the pass refuses, the graph keeps the pagedpack ops."""
    step = paged_step(MODELS["llama"](torch.float32))
    pre_pass = PagedpackPrePass(max_num_tokens=8192, max_num_seqs=64, ops=emulated_ops())
    got = _run_steps(_executor(step, _compiled(step, pre_pass)))
    reference = _run_steps(_executor(step, _eager(step)))
    for name in STEPS:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-5)
    assert len(pre_pass.reports) == len(STEPS) and not any(r.ok for r in pre_pass.reports)
    assert "bfloat16" in pre_pass.reports[0].refusal, pre_pass.reports[0].refusal


class _Bidirectional(torch.nn.Module):
    """An encoder-style site (SDPA, no mask, not causal): the rewrite refuses it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, input_ids, position_ids, use_cache=False):
        x = F.one_hot(input_ids, 16).float()
        q, k, v = self.proj(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return CausalLMOutput(logits=F.scaled_dot_product_attention(q, k, v).sum(1))


def test_a_refused_model_compiles_and_runs_unrewritten_with_the_refusal_in_the_report():
    model = _Bidirectional().eval()
    step = paged_step(model)
    assert not step.report.ok and "bidirectional" in step.report.refusal()
    pre_pass = PagedpackPrePass(max_num_tokens=8192, max_num_seqs=64, ops=emulated_ops())
    compiled = _compiled(step, pre_pass)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9])
    metadata = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
                               seq_lens=torch.tensor([6], dtype=torch.int32))
    inputs = [tokens, torch.arange(6), metadata.cu_seqlens_q, metadata.seq_lens, torch.zeros(1, 1, dtype=torch.int32),
              torch.arange(6), torch.tensor([5])]
    with torch.no_grad():
        got = compiled(*inputs, **step.host_lengths(metadata))
        expected = model(tokens[None], torch.arange(6)[None]).logits[0, [5]]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert pre_pass.reports and "0 paged attention site(s)" in pre_pass.reports[-1].refusal


def test_unknown_npugraph_ex_options_are_refused_as_npugraph_ex_does():
    compiled = torch.compile(torch.nn.Linear(2, 2), backend=npugraph_ex_emulation_backend,
                             options={"post_grad_custom_pre_pas": None})
    with pytest.raises(Exception, match="Invalid option 'post_grad_custom_pre_pas'"):
        compiled(torch.ones(2))


@pytest.mark.parametrize("version, warns", [("2.10.0.post4", False), ("2.14.0", False), ("2.15.0rc1", True),
                                            ("3.0.0+git1234", True)])
def test_torch_npu_newer_than_the_checked_schemas_warns(version, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_torch_npu_version(version)
    assert any(issubclass(w.category, AscendUnverifiedWarning) for w in caught) == warns
