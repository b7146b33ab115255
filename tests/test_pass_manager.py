"""The pass manager: a report row per pass with match counts, graph dumps, the table of attention
patterns, unmatched softmaxes with reasons, and the post-condition (vLLM-style pass tests)."""
import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig
from transformers.models.falcon.modeling_falcon import FalconAttention

from pagedpack import LLM, SamplingParams
from pagedpack.compiler import compile_cache
from pagedpack.kernels.attention_params import AttentionParams
from pagedpack.models.capture import capture
from pagedpack.models.tiny import FAMILIES, VOCAB_SIZE, tiny_model
from pagedpack.passes import paged_attention
from pagedpack.passes.attention_sites import ATTENTION_PATTERNS, HEADS_FIRST, MERGED_HEADS, find_attention_sites
from pagedpack.passes.manager import Pass, PassManager, PassResult
from pagedpack.passes.pipeline import STEP_PIPELINE, UnsupportedModelError, rewrite, step_pipeline
from pagedpack.passes.varlen import VARLEN_PIPELINE, rewrite_varlen
from pagedpack.passes.verify import CAUSAL, classify_site, sample_values
from pagedpack.runtime.request import Request

from conftest import hf_greedy, hf_last_logits, random_prompts, run_cli, run_step, snapshot
from test_families import REFUSED, SERVED, family_model

LAYERS = 3
SITE_PASSES = ("find_attention", "verify_attention", "paged_attention")
_SMALL = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)


def _rows(report) -> dict:
    return {p.name: p for p in report.passes}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_pass_reports_its_matches(family, attn):
    model = tiny_model(family, attn_implementation=attn, num_hidden_layers=LAYERS)
    result = rewrite(capture(model))
    report = result.report
    assert result.ok, report.format()
    assert [p.name for p in report.passes] == [p.name for p in STEP_PIPELINE]
    rows = _rows(report)
    for name in SITE_PASSES:
        assert rows[name].matched == LAYERS, name
    assert rows["paged_attention"].rewritten == LAYERS
    assert rows["no_attention_left"].matched == 0
    assert all(p.refused == 0 and p.ms >= 0 for p in report.passes)
    assert {s.form for s in report.sites} == {attn}
    assert all(f"{p.name} " in report.format() for p in STEP_PIPELINE)
    assert not report.unmatched_softmaxes


def test_patterns_name_their_family_and_implementation():
    assert len({p.name for p in ATTENTION_PATTERNS}) == len(ATTENTION_PATTERNS)
    assert all(p.families and p.implementation in ("sdpa", "eager") for p in ATTENTION_PATTERNS)
    # Llama scales the eager scores by a multiplication (eager_attention_forward).
    for attn, pattern in (("sdpa", "sdpa"), ("eager", "eager_mul_scale")):
        graph = capture(tiny_model("llama", attn_implementation=attn)).graph_module.graph
        assert [s.pattern for s in find_attention_sites(graph)] == [pattern] * 2


def test_varlen_pipeline_reports_its_matches():
    gm = capture(tiny_model("llama", num_hidden_layers=LAYERS)).graph_module
    sample = (torch.zeros(1, 7, dtype=torch.long), torch.arange(7)[None])
    report = rewrite_varlen(gm, sample, 7)
    assert report.ok, report.format()
    assert [p.name for p in report.passes] == [p.name for p in VARLEN_PIPELINE]
    rows = _rows(report)
    assert rows["find_attention"].matched == rows["varlen_attention"].rewritten == LAYERS
    assert rows["no_attention_left"].refused == 0


# Before transformers 5.25, Falcon's own eager attention took an ``alibi`` argument and added it to the
# scores, beside the copy in the mask (FalconModel.forward); 5.25 puts it in the mask only and uses the
# shared eager_attention_forward.
FALCON_EAGER_ADDS_ALIBI = "alibi" in inspect.signature(FalconAttention.forward).parameters
# (family, attn_implementation): the ATTENTION_PATTERNS entry its sites match
ALIBI = {("bloom", "eager"): "eager_baddbmm", ("mpt", "eager"): "eager_masked_fill",
         ("falcon-alibi", "eager"): "eager_alibi_falcon" if FALCON_EAGER_ADDS_ALIBI else "eager_mul_scale",
         ("falcon-alibi", "sdpa"): "sdpa"}
# The slopes of 4 heads in BLOOM's build_alibi_tensor, MPT's build_mpt_alibi_tensor and Falcon's.
SLOPES = 0.25 ** torch.arange(1.0, 5.0)


def _alibi_model(family, attn):
    return family_model({**SERVED, **REFUSED}, family, attn)


@pytest.mark.parametrize("family, attn", list(ALIBI))
def test_alibi_patterns_name_their_family_and_layout(family, attn):
    sites = find_attention_sites(capture(_alibi_model(family, attn)).graph_module.graph)
    assert [s.pattern for s in sites] == [ALIBI[family, attn]] * 2
    assert {s.layout for s in sites} == {MERGED_HEADS if family == "bloom" else HEADS_FIRST}


# family: the ATTENTION_PATTERNS entry of each layer's site, and whether the site reads k^T only
SCORE_FORMS = {"granite_swa": (["eager_lse_sink"] * 2, False),
               "mimo_v2_flash": (["eager_row_max", "eager_sinks"], False),
               "openai-gpt": (["eager_keep_mask"] * 2, True), "gpt_neox_japanese": (["eager_baddbmm"] * 2, False)}


@pytest.mark.parametrize("family", SCORE_FORMS)
def test_score_forms_name_their_pattern(family):
    """Each score form of tests/test_families.py's SERVED is its own entry of the table (none a special case
    in a pass); GPT-NeoX-Japanese's q and k merged to [H, T, D] are read before the merge, so the site is
    [1, H, T, D] like its probs @ v."""
    sites = find_attention_sites(capture(family_model(SERVED, family, "eager")).graph_module.graph)
    patterns, key_transposed = SCORE_FORMS[family]
    assert [s.pattern for s in sites] == patterns
    assert {(s.layout, s.key_transposed, s.refusal) for s in sites} == {(HEADS_FIRST, key_transposed, None)}


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_slopes_are_read_off_the_bias_and_emitted_as_buffers(family):
    result = rewrite(capture(_alibi_model(family, "eager")))
    assert result.ok, result.report.format()
    assert [s.params for s in result.report.sites] == ["alibi"] * 2
    gm = result.graph_module
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.pagedpack.paged_attention.default]
    assert len(calls) == 2
    for call in calls:
        slopes = AttentionParams.from_node(call).alibi_slopes
        assert slopes.op == "get_attr"
        torch.testing.assert_close(gm.get_buffer(slopes.target), SLOPES, rtol=1e-6, atol=0)


@pytest.mark.parametrize("attn, factor", [("sdpa", 1), ("eager", 2 if FALCON_EAGER_ADDS_ALIBI else 1)])
def test_falcon_alibi_is_read_and_refused_for_its_bfloat16_bias(attn, factor):
    """On the short sample the slopes are alibi / sqrt(head_dim) (the float mask carries it) or,
    before transformers 5.25, twice that in eager (which added alibi * inv_norm_factor to the scores
    and the mask's copy again, modeling_falcon); build_alibi_tensor rounds slope * key_pos to
    bfloat16, which the probe past 256 positions sees: refused."""
    captured = capture(_alibi_model("falcon-alibi", attn))
    sites = find_attention_sites(captured.graph_module.graph)
    nodes = {n for s in sites for n in s.sampled_nodes}
    values = sample_values(captured.graph_module, lambda n: n in nodes, captured.sample(7))
    for site in sites:
        assert classify_site(site, values, 7) == (CAUSAL, None)
        torch.testing.assert_close(site.alibi_slopes, factor * SLOPES / 4, rtol=1e-6, atol=0)
    result = rewrite(captured)
    assert result.report.stopped_at == "verify_attention"
    assert len(result.report.refused) == 2
    assert all(s.reason.startswith("score bias is not ALiBi") and "T=261" in s.reason for s in result.report.refused)


def test_the_op_check_is_tied_to_the_sites_own_float64_error(monkeypatch):
    """The reference op must reproduce a site's output to a small multiple of what the site itself
    loses in float32 against its own nodes run in float64: an op off by 2e-5 of 1 + the output's
    magnitude (a fifth of the fixed 1e-4 this check had, far above fp32 rounding) is refused."""
    captured = capture(tiny_model("llama"))
    [site, _] = find_attention_sites(captured.graph_module.graph)
    values = sample_values(captured.graph_module, lambda n: n in site.sampled_nodes, captured.sample(7))
    assert classify_site(site, values, 7) == (CAUSAL, None)
    op = torch.ops.pagedpack.varlen_attention

    def slightly_off(*args, **kwargs):
        out = op(*args, **kwargs)
        return out + 2e-5 * (1 + out.abs().max())

    monkeypatch.setattr(torch.ops.pagedpack, "varlen_attention", slightly_off)
    kind, reason = classify_site(site, values, 7)
    assert kind is None and "float64 run of the original graph" in reason, reason


class _QuadraticBias(torch.nn.Module):
    """One eager causal attention layer whose additive mask carries ``0.01 * key_pos ** 2``: a
    score bias, but not ALiBi."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB_SIZE, 16), torch.nn.Linear(16, VOCAB_SIZE)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, input_ids, position_ids, use_cache=False):
        x = self.embed(input_ids)
        n = x.shape[1]
        j = torch.arange(n)
        mask = torch.where(j[None, :] <= j[:, None], 0.01 * j.float() ** 2, float("-inf"))
        q, k, v = self.qkv(x).view(1, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.35 + mask
        return SimpleNamespace(logits=self.head(torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2)
                                                .reshape(1, n, 16)))


def test_a_bias_that_is_not_alibi_is_refused_by_name():
    captured = capture(_QuadraticBias())
    before = captured.graph_module.code
    result = rewrite(captured)
    [site] = result.report.sites
    assert site.reason.startswith("score bias is not ALiBi") and "T=7" in site.reason
    assert result.report.stopped_at == "verify_attention" and result.graph_module.code == before


@pytest.mark.parametrize("family, params", [("bloom", "alibi"), ("openai-gpt", "")])
def test_varlen_pipeline_serves_merged_head_alibi_and_transposed_key_sites(family, params):
    """BLOOM's [H, T, D] sites, GPT-1's whose key is only k^T, packed without a cache: each sequence's
    logits as if run alone."""
    model = family_model(SERVED, family, "eager")
    captured = capture(model)
    gm = captured.graph_module
    report = rewrite_varlen(gm, captured.sample(7), 7, make_sample=captured.sample)
    assert report.ok, report.format()
    assert [s.params for s in report.sites] == [params] * 2
    prompts = random_prompts((5, 9), seed=3)
    ids = torch.tensor([prompts[0] + prompts[1]])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        (logits,) = gm(ids, positions[None], positions, torch.tensor([0, 5, 14], dtype=torch.int32))
        for rows, prompt in ((slice(0, 5), prompts[0]), (slice(5, 14), prompts[1])):
            torch.testing.assert_close(logits[0, rows], model(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


class _TanhCapped(torch.nn.Module):
    """Two eager causal attention layers whose scores pass ``30 * tanh(scores)`` before the mask: a
    soft-cap in another form than Gemma 2's ``cap * tanh(scores / cap)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB_SIZE, 16), torch.nn.Linear(16, VOCAB_SIZE)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(16, 48) for _ in range(2))

    def forward(self, input_ids, position_ids, use_cache=False):
        x = self.embed(input_ids)
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)
        for qkv in self.qkv:
            q, k, v = qkv(x).view(1, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
            scores = 30.0 * torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.35) + mask
            x = x + torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(1, n, 16)
        return SimpleNamespace(logits=self.head(x))


def test_an_unsupported_soft_capping_form_is_refused_by_name():
    captured = capture(_TanhCapped())
    before = captured.graph_module.code
    result = rewrite(captured)
    report = result.report
    with pytest.raises(UnsupportedModelError, match="soft-capping in a form other than cap \\* tanh"):
        result.raise_if_refused()
    assert "no attention site found" not in report.format()
    assert len(report.refused) == 2 and all("tanh" in s.reason for s in report.refused)
    assert [(u.refused, "soft-capping" in u.reason) for u in report.unmatched_softmaxes] == [(True, True)] * 2
    assert report.stopped_at == "find_attention"
    assert result.graph_module.code == before


class _GateOnly(torch.nn.Module):
    """A softmax over ``linear(x)`` (a router's gate) and no attention at all."""

    def __init__(self):
        super().__init__()
        self.embed, self.gate = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4)

    def forward(self, input_ids, position_ids, use_cache=False):
        return SimpleNamespace(logits=torch.softmax(self.gate(self.embed(input_ids)), -1))


def test_a_graph_without_attention_is_refused_with_its_softmax_explained():
    captured = capture(_GateOnly())
    before = captured.graph_module.code
    result = rewrite(captured)
    report = result.report
    assert not result.ok and report.stopped_at == "find_attention"
    assert "no attention site found" in report.notes
    [softmax] = report.unmatched_softmaxes
    assert softmax.reason.startswith("not attention (its input comes from aten.linear") and not softmax.refused
    assert result.graph_module.code == before


@pytest.fixture(scope="module")
def mixtral():
    config = MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2, bos_token_id=256,
                           eos_token_id=257, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_router_softmax_is_not_attention_and_the_model_is_rewritten(mixtral):
    report = rewrite(capture(mixtral)).report
    assert report.ok, report.format()
    assert report.num_rewritten == mixtral.config.num_hidden_layers
    unmatched = report.unmatched_softmaxes
    assert len(unmatched) == mixtral.config.num_hidden_layers  # one gating softmax per layer
    assert all(u.reason.startswith("not attention") and not u.refused for u in unmatched)
    assert all(u.name in report.format() for u in unmatched)


def test_rewritten_moe_model_matches_the_unmodified_one(mixtral):
    llm = LLM(mixtral, block_size=16, num_blocks=64)
    prompts = random_prompts((23, 5, 40), seed=4)
    requests = [Request(str(i), p, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    logits = run_step(llm, [(r, r.num_tokens) for r in requests])
    torch.testing.assert_close(logits, torch.stack([hf_last_logits(mixtral, p) for p in prompts]), atol=1e-4, rtol=0)
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(mixtral, prompts[0], 8)


def test_dump_graphs_writes_a_pair_per_pass(monkeypatch, tmp_path):
    directory = tmp_path / "dumps"
    monkeypatch.setenv("PAGEDPACK_DUMP_GRAPHS", str(directory))
    assert rewrite(capture(tiny_model("llama"))).ok
    expected = [f"{i:02d}-{p.name}-{when}.txt" for i, p in enumerate(STEP_PIPELINE, 1) for when in ("before", "after")]
    assert sorted(f.name for f in directory.iterdir()) == sorted(expected)
    texts = {name: (directory / name).read_text() for name in expected}
    assert all("def forward(" in text for text in texts.values())
    paged = STEP_PIPELINE.index(next(p for p in STEP_PIPELINE if p.name == "paged_attention")) + 1
    assert "paged_attention" not in texts[f"{paged:02d}-paged_attention-before.txt"]
    assert "torch.ops.pagedpack.paged_attention" in texts[f"{paged:02d}-paged_attention-after.txt"]


@pytest.mark.parametrize("attn, survivor", [("sdpa", "scaled_dot_product_attention"), ("eager", "softmax")])
def test_attention_left_after_the_rewrite_refuses_the_model(monkeypatch, attn, survivor):
    model = tiny_model("llama", attn_implementation=attn)
    captured = capture(model)
    before = captured.graph_module.code
    real, calls = paged_attention.rewrite_site, []

    def skip_first_site(graph, site, **kwargs):
        calls.append(site)
        return real(graph, site, **kwargs) if len(calls) > 1 else None

    monkeypatch.setattr(paged_attention, "rewrite_site", skip_first_site)
    result = rewrite(captured)
    assert len(calls) == 2 and not result.ok
    with pytest.raises(UnsupportedModelError, match=f"{survivor}.* survived the rewrite"):
        result.raise_if_refused()
    assert result.report.stopped_at == "no_attention_left"
    assert result.report.num_rewritten == 0 and result.kv_cache_specs == []
    assert result.graph_module.code == before
    ids = torch.tensor([random_prompts((9,), seed=1)[0]])
    with torch.no_grad():  # the capture still runs, as captured
        (logits,) = result.graph_module(ids, torch.arange(9)[None])
        torch.testing.assert_close(logits, model(ids).logits)


# ---------------------------------------------------------------- declared analyses, uuids, user passes


class SiluAsSigmoid(Pass):
    """A user's pass (docs/design.md's example): ``silu(x)`` as ``x * sigmoid(x)``."""

    name = "silu_as_sigmoid"
    requires = ("kv_cache_specs",)  # runs on the paged step graph

    def __call__(self, ctx):
        nodes = [n for n in ctx.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.silu.default]
        for node in nodes:
            with ctx.graph.inserting_before(node):
                gate = ctx.graph.call_function(torch.ops.aten.sigmoid.default, (node.args[0],))
                product = ctx.graph.call_function(torch.ops.aten.mul.Tensor, (node.args[0], gate))
            node.replace_all_uses_with(product)
            ctx.graph.erase_node(node)
        return PassResult(matched=len(nodes), rewritten=len(nodes))


def test_a_pipeline_with_a_reader_before_its_writer_is_refused_naming_both():
    find, verify = (next(p for p in STEP_PIPELINE if p.name == name) for name in ("find_attention", "verify_attention"))
    with pytest.raises(ValueError, match="'verify_attention' requires 'sites' before any pass provides it "
                                         r"\('find_attention' provides it later\)"):
        PassManager([verify, find])
    with pytest.raises(ValueError, match="'silu_as_sigmoid' requires 'kv_cache_specs' before any pass provides it"):
        PassManager(step_pipeline([SiluAsSigmoid()], after="step_inputs"))
    with pytest.raises(ValueError, match=r"after: expected the name of a pass of the step pipeline"):
        step_pipeline([SiluAsSigmoid()], after="nowhere")
    PassManager(STEP_PIPELINE)  # the shipped pipelines are in order
    PassManager(VARLEN_PIPELINE)


def test_a_user_pass_runs_is_reported_and_changes_the_cache_key():
    model = tiny_model("llama")
    reference = snapshot(model)
    llm = LLM(model, num_blocks=32, extra_passes=[SiluAsSigmoid()])
    row = next(r for r in llm.report.passes if r.name == "silu_as_sigmoid")
    assert row.rewritten == model.config.num_hidden_layers and llm.report.ok  # sequence_independence ran after it
    names = [r.name for r in llm.report.passes]
    assert names.index("merge_linears") < names.index("silu_as_sigmoid") < names.index("sequence_independence")
    prompts = random_prompts((3, 20), seed=1)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 5) for p in prompts]
    stamp = ("/ckpt", (("config.json", 1, 2, 3),))
    assert compile_cache._key(stamp, None, (SiluAsSigmoid(),)) != compile_cache._key(stamp, None)
    assert SiluAsSigmoid().uuid() == SiluAsSigmoid().uuid() and SiluAsSigmoid().uuid().startswith("silu_as_sigmoid:1:")
    with pytest.raises(ValueError, match="extra_passes: expected pagedpack.passes.manager.Pass instances"):
        LLM(model, num_blocks=4, extra_passes=[lambda ctx: None])


class _Broken(torch.nn.Module):
    def forward(self, x):
        return torch.ops.aten.reshape.default(x + 1, [3, 5])  # an aten op, as in captured graphs


class RunsABrokenGraph(Pass):
    """A check whose own run of a graph raises inside the graph's generated code (as the packed
    sample run of ``sequence_independence`` did on hybrid state-space models)."""

    name = "runs_a_broken_graph"
    mutates = False

    def __call__(self, ctx):
        torch.fx.symbolic_trace(_Broken())(torch.zeros(4))
        return PassResult()


def test_a_pass_that_raises_refuses_the_model_naming_the_pass_and_the_node():
    model = tiny_model("llama")
    with pytest.raises(UnsupportedModelError) as refusal:
        LLM(model, num_blocks=8, extra_passes=[RunsABrokenGraph()])
    assert refusal.value.report.stopped_at == "runs_a_broken_graph"
    assert ("runs_a_broken_graph raised RuntimeError: shape '[3, 5]' is invalid for input of size 4 "
            "(at node reshape_default = aten.reshape.default)") in str(refusal.value)
    result = rewrite(capture(model), extra_passes=[RunsABrokenGraph()])  # the graph is put back as captured
    assert not result.ok and not any(n.target == "positions" for n in result.graph_module.graph.nodes)


def test_pagedpack_inspect_runs_and_lists_a_user_pass(capsys):
    code, stdout, stderr = run_cli(capsys, "inspect", "--extra-pass", f"{__name__}:SiluAsSigmoid")
    assert code == 0, stderr
    rows = [line.split()[0] for line in stdout.splitlines() if line.startswith("  ") and " / " in line]
    assert rows.index("merge_linears") + 1 == rows.index("silu_as_sigmoid") < rows.index("sequence_independence")
    code, _, stderr = run_cli(capsys, "inspect", "--extra-pass", "no_such_module:Pass")
    assert code != 0
    assert "--extra-pass: expected MODULE:CLASS of an importable pass, got 'no_such_module:Pass'" in stderr
