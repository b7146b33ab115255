"""Hybrids of attention and layers with a recurrent state (LFM2's short convolutions, Qwen3.5's gated
DeltaNet, Bamba's Mamba2 mixers, MiniMax's lightning attention) and Mamba (no attention) through the
pass and the engine: each causal conv1d, gated delta rule, selective scan and lightning attention
continues from a state slot per sequence, through forks, preemption and chunked prefill; their
``.pt2`` exports, served in a fresh process, and crafted ones whose state metadata is refused.
References: the unmodified model's greedy ``generate`` run one prompt at a time, and for seeded
sampling each seed run alone (tests/test_families.py runs every family's 12-prompt batch with
chunked prefill)."""
import json
import re
import subprocess
import sys
import types
import zipfile

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings

from pagedpack import LLM, SamplingParams
from pagedpack.formats.export import META_FILE, step_from_metadata
from pagedpack.lowering.reference.pt2 import METADATA_CHOICES
from pagedpack.models.capture import capture
from pagedpack.passes.pipeline import rewrite
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.request import Request
from pagedpack.step.contract import StateSpec, step_input_names

from conftest import arrival_schedules, assert_each_as_alone, greedy_alone, pt2_edited, random_prompts

V, MAX_TOKENS = 258, 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPTS = random_prompts((3, 17, 40, 5, 29, 64), seed=5, vocab=V)
LAYERS = ["conv", "full_attention", "conv", "full_attention"]


@pytest.fixture(scope="module")
def model():
    config = T.Lfm2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.1, layer_types=LAYERS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def solo(model):
    return greedy_alone(model, PROMPTS, MAX_TOKENS)


# a small step budget (chunked prefill) and a small pool (preemption) make arrivals interleave
SMALL = dict(num_blocks=12, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)


def _small_llm(model) -> LLM:
    return LLM(model, **SMALL)


@pytest.fixture(scope="module")
def llm(model):
    return _small_llm(model)


@pytest.fixture(scope="module")
def short_conv(llm, solo):
    return llm, solo


def _built(config) -> tuple[LLM, list[list[int]]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config).eval()
    return _small_llm(model), greedy_alone(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def deltanet():
    """``(llm, solo)`` of a Qwen3.5 text model: gated DeltaNet layers (2 key heads, 4 value heads) and attention."""
    return _built(T.Qwen3_5TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.1,
        layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16))


@pytest.fixture(scope="module")
def ssd():
    """``(llm, solo)`` of a Bamba model: Mamba2 mixers (8 heads in 2 groups, SSD chunks of 16) and attention."""
    return _built(T.BambaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16))


@pytest.fixture(scope="module")
def mamba():
    """``(llm, solo)`` of a Mamba model: no attention layers (no KV caches), a conv and a selective scan per mixer."""
    return _built(T.MambaConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, initializer_range=0.1,
                                state_size=8, expand=2, conv_kernel=4))


@pytest.fixture(scope="module")
def lightning():
    """``(llm, solo)`` of a MiniMax model: lightning attention (blocks of 8: the prompts span up to 8),
    attention, experts."""
    return _built(T.MiniMaxConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.1, layer_types=["linear_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2, block_size=8))


def test_the_report_and_the_plan_name_the_state_and_prefix_caching_is_off(llm):
    notes = [n for n in llm.report.notes if n.startswith("recurrent_state:")]
    assert notes and "model.layers.0.conv, model.layers.2.conv" in notes[0] and "1,024 bytes a sequence" in notes[0]
    assert [spec.shape for spec in llm.program.state_specs] == [(64, 2), (64, 2)]
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert not kv.enable_prefix_caching and kv.num_state_slots == 4
    stats = llm.get_stats()
    assert not stats.prefix_caching and (stats.state_slots_total, stats.state_slots_used) == (4, 0)
    assert dict(llm.plan_memory("64MiB").rows())["recurrent state"].startswith(
        "1024 bytes per sequence, a slot for each of max_num_seqs = 4")


def test_metrics_show_the_state_slots_requests_hold(llm):
    """``/metrics``' gauges of the recurrent-state slots: the slots the running requests hold, of 4."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedpack.serve.metrics import ServerMetrics

    metrics = ServerMetrics(llm._loop, model_name="hybrid")

    def slots():
        samples = {s.name: s.value for family in text_string_to_metric_families(metrics.exposition().decode())
                   for s in family.samples}
        return samples["pagedpack:recurrent_state_slots_used"], samples["pagedpack:recurrent_state_usage_perc"]

    engine = llm.llm_engine
    assert slots() == (0, 0)
    for i in range(2):
        engine.add_request(f"slots-{i}", PROMPTS[i], SamplingParams(max_tokens=16))
    engine.step()
    held = sum(r.state_slot >= 0 for r in engine.scheduler.running)  # the ground truth: 2, or 1 (in CI once)
    assert held >= 1 and slots() == (held, held / 4)
    for i in range(2):
        engine.abort_request(f"slots-{i}")
    assert slots() == (0, 0)


@pytest.mark.parametrize("hybrid", ["short_conv", "deltanet", "ssd", "mamba", "lightning"])
def test_forks_preemption_and_chunks_give_each_prompt_its_own_tokens(hybrid, request):
    """``n=2`` forks copy their parent's state; the 12-block pool preempts (the state starts over)."""
    llm, solo = request.getfixturevalue(hybrid)
    before = llm.get_stats().num_preemptions
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, n=2,
                        max_tokens=MAX_TOKENS), use_tqdm=False)
    for out, expected in zip(outs, solo, strict=True):
        assert [c.token_ids for c in out.outputs] == [expected, expected]
    assert llm.get_stats().num_preemptions > before


@pytest.mark.parametrize("hybrid", ["short_conv", "deltanet", "ssd", "mamba", "lightning"])
def test_seeded_samples_of_prompts_sharing_a_prefix_equal_each_seed_run_alone(hybrid, request):
    """``n=2`` seeded sampling of three prompts sharing a 40-token prefix (prefix caching asked for, the
    default; the engine keeps it off for these models), batched and preempted: completion ``i`` equals the prompt
    run alone with seed ``seed + i``."""
    llm, _ = request.getfixturevalue(hybrid)
    shared = PROMPTS[5][:40]
    prompts = [shared + tail for tail in random_prompts((3, 9, 1), seed=6, vocab=V)]
    params = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        alone = [llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=7 + i,
                              max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids for i in range(2)]
        assert [c.token_ids for c in out.outputs] == alone
    assert llm.get_stats().prefix_cache_hits == 0


def test_an_int8_kv_cache_quantizes_the_attention_layers_and_leaves_the_state_in_the_model_dtype(model, capture_once,
                                                                                                 caplog):
    """``kv_cache_dtype="int8"`` applies to the attention layers' caches; the conv states stay fp32. Batched
    with forks and preemption, each prompt gets the tokens it gets alone on the same engine. Prefix caching,
    asked for by default, is off with a warning."""
    llm = LLM(model, num_blocks=12, block_size=8, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_dtype="int8")
    assert any(r.levelname == "WARNING" and r.getMessage().startswith("prefix caching is off for this model")
               for r in caplog.records)
    assert {spec.dtype for spec in llm.program.kv_cache_specs} == {torch.int8}
    assert {spec.dtype for spec in llm.program.state_specs} == {torch.float32}
    params = SamplingParams(temperature=0.0, n=2, max_tokens=MAX_TOKENS)
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [[c.token_ids for c in out.outputs] for out in outs] == [[a, a] for a in alone]
    assert llm.get_stats().num_preemptions > 0


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**arrival_schedules(len(PROMPTS)))
def test_requests_arriving_and_aborted_while_others_run(llm, solo, arrival, aborted):
    assert_each_as_alone(llm, PROMPTS, arrival, aborted, lambda i: GREEDY, solo)


@pytest.mark.parametrize("how, message", [
    ("onnx-export", "rewritten: the model's recurrent layers \\(model.layers.0.conv, model.layers.2.conv\\) keep a "
                    "state the onnx format does not carry yet; export it as pt2"),
    ("onnx", "the onnx target does not run these recurrent layers .*\n  model.layers.0.conv: causal_conv1d_varlen: "
             "the onnx target does not run it yet\n  model.layers.2.conv: causal_conv1d_varlen"),
    ("tp", "tensor_parallel_size: the model's recurrent layers .* are not split over ranks yet"),
    ("tp-export", "tensor_parallel_size: the model's recurrent layers .* are not split over ranks yet"),
])
def test_paths_without_recurrent_state_refuse_it_by_name(model, capture_once, llm, how, message, tmp_path):
    run = {"onnx-export": lambda: llm.export(tmp_path / "m.onnx", format="onnx"),
           "onnx": lambda: LLM(model, target="onnx"), "tp": lambda: LLM(model, tensor_parallel_size=2),
           "tp-export": lambda: llm.export(tmp_path / "m.json", tensor_parallel_size=2)}
    with pytest.raises(ValueError, match=message):
        run[how]()
    assert not list(tmp_path.iterdir())


class ShortConv(torch.nn.Module):
    """A short conv whose conv1d is padded on both sides: each token sees the next one."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(16, 16, 3, groups=16, padding=1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class GatedDeltaNet(torch.nn.Module):
    """A causal conv, then a recurrence in plain ops (a cumulative sum), not through transformers' seam."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(16, 16, 3, groups=16, padding=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[:, :, :x.shape[1]].transpose(1, 2).cumsum(1)


class _Hybrid(torch.nn.Module):
    def __init__(self, mix: torch.nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.head = torch.nn.Embedding(32, 16), mix, torch.nn.Linear(16, 32)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, input_ids, position_ids, use_cache=False):
        hidden = self.mix(self.embed(input_ids))
        q, k, v = self.qkv(hidden).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        hidden = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return types.SimpleNamespace(logits=self.head(hidden.transpose(1, 2).reshape(1, -1, 16)))


@pytest.mark.parametrize("mix, message", [
    (ShortConv, "recurrent_state: mix: conv1d = conv1d: padding [1] is not width - 1 = 2 (not causal)"),
    (GatedDeltaNet, "recurrent_state: mix (GatedDeltaNet): no chunk_gated_delta_rule in the captured graph"),
])
def test_a_recurrent_layer_of_another_form_is_refused_naming_its_node_or_layer(mix, message):
    result = rewrite(capture(_Hybrid(mix())))
    assert not result.ok and result.report.stopped_at == "recurrent_state"
    assert any(message in n for n in result.report.notes), result.report.notes


def _request(name: str, tokens: int = 5) -> Request:
    return Request(name, list(range(tokens)), GREEDY)


def test_the_kv_manager_hands_out_state_slots_and_copies_them_to_forks():
    with pytest.raises(ValueError, match="enable_prefix_caching: expected False for a model with recurrent state"):
        KVCacheManager(8, 4, num_state_slots=2)
    kv = KVCacheManager(8, 4, num_state_slots=2, enable_prefix_caching=False)
    a, b, c = _request("a"), _request("b"), _request("c")
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    assert (a.state_slot, b.state_slot, kv.num_free_state_slots) == (0, 1, 0)
    assert not kv.can_allocate(c, 1) and not kv.allocate_slots(c, 1)  # blocks free, no slot
    a.num_computed_tokens = 5
    assert not kv.fork_blocks(a, c)
    kv.free(b)
    assert b.state_slot == -1 and kv.fork_blocks(a, c) and c.state_slot == 1
    assert kv.take_state_copies() == [(0, 1)] and kv.take_state_copies() == []
    kv.take_block_copies()
    kv.end_step()  # the step made the copies: their sources are let go
    for request in (a, c):
        kv.free(request)
    assert kv.num_free_state_slots == 2 and kv.num_free_blocks == 8


def test_the_torch_compile_backend_runs_a_hybrid_as_captured_and_says_why(model):
    """Dynamo captures outside pagedpack's kernel seams: the backend pages no state, runs the graph as
    captured (the unmodified model's logits) and its report names the layer."""
    from pagedpack.compiler import backend

    torch._dynamo.reset()
    backend.LAST_REPORTS.clear()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        logits = torch.compile(model, backend="pagedpack", dynamic=True)(input_ids=ids).logits
    torch.testing.assert_close(logits, expected)
    assert any("model.layers.0.conv: Lfm2ShortConv) keeps a state: the torch.compile "
               "backend does not page it" in note for report in backend.LAST_REPORTS for note in report.notes), \
        [report.notes for report in backend.LAST_REPORTS]


# Runs in a fresh interpreter: `import pagedpack` alone registers the recurrent ops the archives call.
_SERVE_SCRIPT = """
import json, sys
import pagedpack
from pagedpack import LLM, SamplingParams
engine, prompts, max_tokens = json.loads(sys.argv[1])
served = []
for path in sys.argv[2:]:
    llm = LLM.from_exported(path, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, n=2, max_tokens=max_tokens), use_tqdm=False)
    served.append({"note": llm.program.note, "preemptions": llm.get_stats().num_preemptions,
                   "imported": sorted(m for m in sys.modules if m.startswith("transformers")),
                   "state_specs": [[s.kind, list(s.shape), str(s.dtype), s.layer] for s in llm.program.state_specs],
                   "tokens": [[c.token_ids for c in o.outputs] for o in outs]})
print(json.dumps(served))
"""


@pytest.fixture(scope="module")
def exported(short_conv, mamba, tmp_path_factory):
    """``{model: (llm, solo, path)}``: the LFM2 hybrid and the Mamba model, each exported once as ``.pt2``:
    the two state kinds (a conv state beside KV caches; a conv and an SSM state with none). The other ops
    are registered with these by ``import pagedpack`` and exported the same way (checked by hand: Qwen3.5,
    Qwen3-Next, Kimi-Linear, MiniMax, Bamba, Mamba2, Zamba2, Jamba)."""
    folder = tmp_path_factory.mktemp("exports")
    models = {"short_conv": short_conv, "mamba": mamba}
    return {name: (llm, solo, llm.export(folder / f"{name}.pt2")) for name, (llm, solo) in models.items()}


def test_pt2_exports_served_in_a_fresh_process_give_each_prompt_its_own_tokens(exported, tmp_path):
    """The archives keep the recurrent ops and their state inputs (Mamba's beside no KV cache): loaded in
    a fresh process (lowered for the CPU, its check run with the states), with chunked prefill, four
    sequences at once, ``n=2`` forks and preemption, each prompt's tokens are the unmodified model's alone."""
    result = subprocess.run([sys.executable, "-c", _SERVE_SCRIPT, json.dumps([SMALL, PROMPTS, MAX_TOKENS]),
                             *(path for _, _, path in exported.values())], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    served_files = json.loads(result.stdout.strip().splitlines()[-1])
    for (name, (llm, solo, path)), served in zip(exported.items(), served_files, strict=True):
        assert served["imported"] == [], served["imported"]  # serving a file needs no transformers
        assert served["state_specs"] == [[s.kind, list(s.shape), str(s.dtype), s.layer]
                                         for s in llm.program.state_specs]
        assert served["note"].startswith(f"loaded from {path}; cpu lowering: ") and "kept the graph" not in \
            served["note"], served["note"]
        assert served["tokens"] == [[expected, expected] for expected in solo]
        assert served["preemptions"] > 0


_CONV = {"kind": "conv_state", "shape": [64, 2], "dtype": "float32", "layer": "model.layers.0.conv"}
_CONV2 = {**_CONV, "layer": "model.layers.2.conv"}
_INVALID = " has invalid pagedpack metadata: state_specs: expected {'kind', 'shape', 'dtype', 'layer'}: "
_SCAN = StateSpec("ssm_state", (4, 16, 16), torch.float32)


# edit of the LFM2 archive's metadata -> the start of the error
MALFORMED_STATE_METADATA = {
    "state_specs an object": (dict(state_specs={"conv_state_0": _CONV}),
                              " has invalid pagedpack metadata: state_specs: expected list or null"),
    "an unknown kind": (dict(state_specs=[{**_CONV, "kind": "lstm_state"}, _CONV2]), _INVALID),
    "a list as kind": (dict(state_specs=[{**_CONV, "kind": ["conv_state"]}, _CONV2]), _INVALID),
    "a shape of another rank": (dict(state_specs=[{**_CONV, "shape": [64, 2, 1]}, _CONV2]), _INVALID),
    "a zero size": (dict(state_specs=[{**_CONV, "shape": [64, 0]}, _CONV2]), _INVALID),
    "a bool size": (dict(state_specs=[{**_CONV, "shape": [64, True]}, _CONV2]), _INVALID),
    "a float64 state": (dict(state_specs=[{**_CONV, "dtype": "float64"}, _CONV2]), _INVALID),
    "code as the layer": (dict(state_specs=[{**_CONV, "layer": "__import__('os').system('x')"}, _CONV2]), _INVALID),
    "a field more": (dict(state_specs=[{**_CONV, "init": "zeros"}, _CONV2]), _INVALID),
    "no state_specs": (dict(state_specs=...), " has invalid pagedpack metadata: signature: expected"),
    "one state short": (dict(state_specs=[_CONV]), " has invalid pagedpack metadata: signature: expected"),
    "one rank's shard": (dict(tensor_parallel={"rank": 0, "size": 2, "export_id": "e"}),
                         " has invalid pagedpack metadata: tensor_parallel: expected null with state_specs"),
    "neither caches nor states": (dict(kv_cache_specs=[], state_specs=[], signature=step_input_names(0)),
                                  " has invalid pagedpack metadata: signature: expected"),
}
# valid metadata describing another program than the archive's
NOT_ITS_PROGRAMS = {
    "a wider conv": (dict(state_specs=[{**_CONV, "shape": [64, 3]}, _CONV2]),
                     ": state_specs: the metadata says conv_state_0 is torch.float32 [num_slots, 64, 3], its "
                     "program takes torch.float32 [None, 64, 2]"),
    "a bfloat16 state": (dict(state_specs=[_CONV, {**_CONV2, "dtype": "bfloat16"}]),
                         ": state_specs: the metadata says conv_state_1 is torch.bfloat16 [num_slots, 64, 2], its "
                         "program takes torch.float32 [None, 64, 2]"),
    "scans, not convs": (dict(state_specs=[{**_CONV, "kind": "ssm_state", "shape": [4, 16, 16]}] * 2,
                              signature=step_input_names(2, [_SCAN, _SCAN])),
                         ": its metadata describes the inputs"),
    "no state at all": (dict(state_specs=[], signature=step_input_names(2)), ": its metadata describes the inputs"),
}
# the cases loaded as files (each loads the archive's program); the other malformed ones are read as metadata only
AS_FILES = {**NOT_ITS_PROGRAMS, **{case: MALFORMED_STATE_METADATA[case]
                                   for case in ("state_specs an object", "code as the layer", "one state short")}}


def _edited(changes: dict):
    """The archive's metadata text with ``changes`` (a value of ``...`` drops the field)."""
    def edit(data: bytes) -> bytes:
        meta = {**json.loads(data), **changes}
        return json.dumps({key: value for key, value in meta.items() if value is not ...}).encode()
    return edit


@pytest.mark.parametrize("case", sorted(AS_FILES))
def test_a_pt2_whose_state_metadata_is_malformed_or_not_its_programs_is_refused(exported, case, tmp_path):
    changes, message = AS_FILES[case]
    path = pt2_edited(exported["short_conv"][2], tmp_path / "m.pt2", {f"extra/{META_FILE}": _edited(changes)})
    with pytest.raises(ValueError, match=re.escape(f"path: {path!r}{message}")):
        LLM.from_exported(path)


def test_malformed_state_metadata_is_refused_naming_the_field(exported):
    with zipfile.ZipFile(exported["short_conv"][2]) as archive:
        text = next(archive.read(n) for n in archive.namelist() if n.endswith(f"/extra/{META_FILE}"))
    loaded = step_from_metadata(None, text.decode(), "m.pt2", METADATA_CHOICES)
    assert loaded.state_specs == exported["short_conv"][0].program.state_specs
    for case, (changes, message) in MALFORMED_STATE_METADATA.items():
        with pytest.raises(ValueError) as refused:
            step_from_metadata(None, _edited(changes)(text).decode(), "m.pt2", METADATA_CHOICES)
        assert str(refused.value).startswith(f"path: 'm.pt2'{message}"), (case, str(refused.value))
