"""The ``ascend`` lowering, run on the op emulation (CANN is not on this machine).

Numbers are compared with independent references: the explicit-mask fp32 attention of
``test_ops`` for single steps, the reference target for whole generations.
"""
import importlib
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import tomllib
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pagedpack import LLM, SamplingParams
from pagedpack.cli import main as cli_main
from pagedpack.lowering.ascend.limits import (
    AscendLoweringError,
    AscendUnverifiedWarning,
    AttentionShape,
    StepBounds,
    check_supported,
    violations,
)
from pagedpack.lowering.ascend.lower import AscendUnavailableError, emulated_ops, lower_to_ascend, npu_ops
from pagedpack.lowering.ascend.torchair import ascend_backend, compile_step, torchair_backend
from pagedpack.models.capture import capture
from pagedpack.models.tiny import tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer
from pagedpack.passes.pipeline import METADATA_INPUTS, rewrite
from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.request import Request
from pagedpack.runtime.scheduler import ScheduledRequest

from conftest import assert_greedy_tokens_or_tie, assert_within_own_error, random_prompts, snapshot
from test_ops import make_params, make_step, reference_attention

pagedpack_ops = torch.ops.pagedpack
EMULATED = emulated_ops()
BOUNDS = StepBounds(max_num_tokens=8192, max_num_seqs=64)
BLOCK = 128
# A tiny Llama inside TND's limits: bfloat16, head_dim 128, 4 query heads on 2 KV heads.
TND_MODEL = dict(dtype=torch.bfloat16, head_dim=128)


# ---------------------------------------------------------------- one lowered step graph


def _step(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, slot_mapping):
    pagedpack_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return pagedpack_ops.paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, 128**-0.5)


def _step_inputs(seqs, seed=0, **kw):
    """``make_step`` inputs in ``_step``'s order, plus each sequence's whole K/V."""
    kw = {**dict(num_kv_heads=2, ratio=2, head_dim=128, block_size=BLOCK, dtype=torch.bfloat16), **kw}
    batch, write, full_kv = make_step(seqs, g=torch.Generator().manual_seed(seed), **kw)
    inputs = [batch["query"], write["key"], write["value"], batch["key_cache"], batch["value_cache"],
              batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], write["slot_mapping"]]
    return inputs, full_kv


@pytest.fixture(scope="module")
def lowered():
    """The step graph lowered once; every test below runs its own batch composition through it."""
    example, _ = _step_inputs([(3, 2)])
    gm = make_fx(_step)(*example)
    lower_to_ascend(gm, example, ops=EMULATED, bounds=BOUNDS)
    return gm


def _check_step(gm, seqs, seed=0):
    """Run ``gm`` on the step ``seqs`` = [(num_cached, q_len)]; compare with the fp32 reference."""
    inputs, full_kv = _step_inputs(seqs, seed)
    query, key, value, key_cache, value_cache, _, cu, _, slots = inputs
    out = gm(*inputs)
    cu = cu.tolist()
    exact = torch.cat([reference_attention(query[cu[b]:cu[b + 1]], k, v, 128**-0.5)
                       for b, (k, v) in enumerate(full_kv)])
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    # Inputs are bf16 already, so the lowered op may only differ by rounding its fp32 result to bf16.
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-5)
    flat = slots.tolist()  # this step's K/V went to their slots
    assert torch.equal(key_cache.flatten(0, 1)[flat], key) and torch.equal(value_cache.flatten(0, 1)[flat], value)
    return out, exact


def test_lowered_graph_holds_only_aten_and_ascend_ops(lowered):
    targets = {n.target for n in lowered.graph.nodes if n.op == "call_function"}
    namespaces = {getattr(t, "namespace", None) for t in targets}
    assert namespaces <= {"aten", *EMULATED.namespaces, None}  # None: operator.getitem
    (fia,) = [n for n in lowered.graph.nodes if n.target == EMULATED.fused_infer_attention_score]
    assert (fia.kwargs["input_layout"], fia.kwargs["sparse_mode"], fia.kwargs["block_size"]) == ("TND", 3, BLOCK)
    assert (fia.kwargs["num_heads"], fia.kwargs["num_key_value_heads"]) == (4, 2)
    assert torch.equal(getattr(lowered, fia.kwargs["atten_mask"].target),
                       torch.ones(2048, 2048, dtype=torch.bool).triu(1))


@pytest.mark.parametrize("kv_len", [137, 512, 513, 2047, 2048, 2049, 4095])
def test_kv_lengths_around_512_and_2048(lowered, kv_len):
    """A decode and a 77-token chunk ending at ``kv_len``: rows far past the 2048 compressed mask."""
    _check_step(lowered, [(kv_len - 1, 1), (kv_len - 77, 77)], seed=kv_len)


def test_prefill_longer_than_the_compressed_mask(lowered):
    _check_step(lowered, [(0, 2049)])


def test_second_prefill_chunk_sees_the_cached_prefix(lowered):
    """200 tokens cached (mid-block), then a 56-token chunk: it attends all 256 keys, bottom-right."""
    out, _ = _check_step(lowered, [(200, 56)])
    inputs, full_kv = _step_inputs([(200, 56)])
    own = reference_attention(inputs[0], full_kv[0][0][200:], full_kv[0][1][200:], 128**-0.5)
    assert (out.float() - own).abs().max() > 0.1  # KV lengths read as query lengths would give this


def test_mixed_prefill_decode_and_chunk_in_one_step(lowered):
    """KV lengths per sequence (a cumulative reading would shift every sequence after the first)."""
    _check_step(lowered, [(0, 37), (20, 1), (130, 30), (255, 1), (127, 1)])


# ---------------------------------------------------------------- attention parameters


def _traced_layer(params: dict):
    """One layer's cache write and paged attention with ``params``, traced on a small step:
    ``(graph module, example inputs)``."""
    def step(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, slot_mapping):
        pagedpack_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return pagedpack_ops.paged_attention(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                                             128**-0.5, **params)

    example, _ = _step_inputs([(3, 2)])
    return make_fx(step)(*example), example


WINDOW = 200  # keys; a 200-key window of a row at position 255 starts at 56, mid-block (blocks of 128)


@pytest.fixture(scope="module")
def windowed():
    gm, example = _traced_layer(dict(sliding_window=WINDOW))
    shapes = lower_to_ascend(gm, example, ops=EMULATED, bounds=BOUNDS)
    assert [s.sliding_window for s in shapes] == [WINDOW]
    return gm


def _check_windowed_step(gm, seqs, window, seed=0):
    inputs, full_kv = _step_inputs(seqs, seed)
    query, cu = inputs[0], inputs[6].tolist()
    out = gm(*inputs)
    exact = torch.cat([reference_attention(query[cu[b]:cu[b + 1]], k, v, 128**-0.5, sliding_window=window)
                       for b, (k, v) in enumerate(full_kv)])
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-5)
    full = torch.cat([reference_attention(query[cu[b]:cu[b + 1]], k, v, 128**-0.5) for b, (k, v) in enumerate(full_kv)])
    return (exact - full).abs().max()  # how much the window changed the result


def test_window_is_lowered_to_fia_v2s_band_with_a_dummy_sequence(windowed):
    (fia,) = [n for n in windowed.graph.nodes if n.target == EMULATED.fused_infer_attention_score_v2]
    assert "learnable_sink" not in fia.kwargs and fia.kwargs["softmax_scale"] == 128**-0.5
    assert (fia.kwargs["sparse_mode"], fia.kwargs["pre_tokens"], fia.kwargs["next_tokens"]) == (4, WINDOW - 1, 0)
    assert fia.kwargs["input_layout"] == "TND" and fia.kwargs["block_size"] == BLOCK
    targets = {getattr(n.target, "namespace", None) for n in windowed.graph.nodes if n.op == "call_function"}
    assert targets <= {"aten", *EMULATED.namespaces, None}


@pytest.mark.parametrize("seqs", [
    [(0, 300), (260, 1), (180, 75), (40, 1), (0, 7)],  # prefill past the window, decodes, a chunk resuming mid-block
    [(255, 1), (1000, 1), (3, 1), (199, 1)],  # decodes only: FIA's Q_S == 1 branch would ignore the band
    [(0, 2049)],  # a prefill longer than the compressed mask
], ids=["mixed", "decode-only", "long-prefill"])
def test_windowed_step_matches_the_reference(windowed, seqs):
    assert _check_windowed_step(windowed, seqs, WINDOW) > 0.01  # the window mattered


@pytest.mark.parametrize("window", [1, 130, 255, 256, 1000])
def test_windows_below_at_and_above_the_kv_length(window):
    """kv lengths 256 (chunk of 56 after 200 cached) and 130/129 (decode, fresh prefill): windows
    of one key, starting mid-block, equal to and longer than the sequences."""
    gm, example = _traced_layer(dict(sliding_window=window))
    lower_to_ascend(gm, example, ops=EMULATED, bounds=BOUNDS)
    _check_windowed_step(gm, [(200, 56), (129, 1), (0, 129)], window, seed=window)



@pytest.mark.parametrize("window", [None, WINDOW])
def test_sinks_are_fia_v2s_learnable_sink(window):
    """A site with sinks (and a window, or none) calls FIA v2 with the sinks as its bfloat16
    learnable_sink; the step matches the fp32 reference with the sink in the softmax denominator,
    and the sinks changed the result."""
    params = make_params(4, window=window, sinks=True)
    params["sinks"] = params["sinks"].bfloat16()  # the model's dtype (TND: bfloat16)
    gm, example = _traced_layer(params)
    lower_to_ascend(gm, example, ops=EMULATED, bounds=BOUNDS)
    (fia,) = [n for n in gm.graph.nodes if n.target == EMULATED.fused_infer_attention_score_v2]
    assert fia.kwargs["sparse_mode"] == (3 if window is None else 4) and "learnable_sink" in fia.kwargs
    seqs = [(0, 300), (260, 1), (180, 75), (40, 1)]
    inputs, full_kv = _step_inputs(seqs, seed=5)
    query, cu = inputs[0], inputs[6].tolist()
    out = gm(*inputs)
    exact, plain = (torch.cat([reference_attention(query[cu[b]:cu[b + 1]], k, v, 128**-0.5, sliding_window=window,
                                                   **extra) for b, (k, v) in enumerate(full_kv)])
                    for extra in ({"sinks": params["sinks"]}, {}))
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-5)
    assert (exact - plain).abs().max() > 0.01


REFUSED = {"logits_soft_cap": dict(soft_cap=50.0), "alibi_slopes": dict(alibi=True),
           "attention_chunk_size": dict(chunk=32)}


@pytest.mark.parametrize("param", REFUSED)
def test_soft_cap_alibi_and_chunks_are_refused_naming_the_parameter(param):
    params = make_params(4, window=64, **REFUSED[param])
    gm, example = _traced_layer(params)
    before = gm.code
    with pytest.raises(AscendLoweringError, match=rf"(?s)sparse_mode=4 band.*\n  {param}\b.*_op_plugin_docs.py"):
        lower_to_ascend(gm, example, ops=EMULATED, bounds=BOUNDS)
    assert gm.code == before


# ---------------------------------------------------------------- documented limits


SHAPE = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, value_head_dim=128, dtype=torch.bfloat16,
                       block_size=128)
LIMITS = {
    "float16": (dict(dtype=torch.float16), {}, "TND supports bfloat16 only"),
    "float32": (dict(dtype=torch.float32), {}, "TND supports bfloat16 only"),
    "head_dim 64": (dict(head_dim=64, value_head_dim=64), {}, "TND needs 128"),
    "head_dim 256": (dict(head_dim=256, value_head_dim=256), {}, "TND needs 128"),
    "value head_dim differs": (dict(head_dim=192, value_head_dim=128), {}, "caches must have the same shape"),
    "value head_dim 192 with paging": (dict(head_dim=192, value_head_dim=192), {},
                                       "value head_dim 192: not supported with paging or grouped-query"),
    "head_dim 64 with GQA": (dict(head_dim=64, value_head_dim=64, num_heads=16, num_kv_heads=4), {},
                             "64 without grouped-query heads"),
    "GQA ratio 128": (dict(num_heads=128, num_kv_heads=1), {}, "grouped-query ratio 128 exceeds 64"),
    "heads not divisible": (dict(num_heads=12, num_kv_heads=8), {}, "not divisible by num_key_value_heads=8"),
    "300 heads": (dict(num_heads=300, num_kv_heads=10), {}, "num_heads=300 exceeds 256"),
    "block_size 16": (dict(block_size=16), {}, "block_size=16: paged attention with multi-token queries"),
    "block_size 64": (dict(block_size=64), {}, "multiple of 128"),
    "block_size 192": (dict(block_size=192), {}, "multiple of 128"),
    "block_size 640": (dict(block_size=640), {}, "128..512"),
    "T over 65536": ({}, dict(max_num_tokens=65537), "TND needs T <= 65536"),
    "B over 4096": ({}, dict(max_num_seqs=4097), "at most 4096 sequence lengths"),
    "window: T + dummy over 65536": (dict(sliding_window=512), dict(max_num_tokens=65535), "TND needs T <= 65536"),
    "window: B + dummy over 4096": (dict(sliding_window=512), dict(max_num_seqs=4096), "at most 4096 sequence"),
    "soft cap": (dict(logits_soft_cap=30.0), {}, "logits_soft_cap=30.0: FIA computes softmax"),
    "alibi": (dict(alibi=True), {}, "alibi_slopes: FIA's only score bias is pse_shift"),
    "sinks with value head_dim 192": (dict(sinks=True, head_dim=192, value_head_dim=192), {},
                                      "learnable_sink needs value head_dim <= 128"),
}


@pytest.mark.parametrize("case", LIMITS)
def test_each_documented_limit_refuses_a_violating_configuration(case):
    shape_change, bounds_change, message = LIMITS[case]
    shape = AttentionShape(**{**SHAPE.__dict__, **shape_change})
    bounds = StepBounds(**{**StepBounds(2048, 256).__dict__, **bounds_change})
    found = violations(shape, bounds)
    assert len(found) >= 1 and any(message in v for v in found), found
    assert all("_op_plugin_docs.py" in v for v in found)  # each refusal cites its source


@pytest.mark.parametrize("change", [{}, dict(head_dim=64, value_head_dim=64, num_heads=8, num_kv_heads=8),
                                    dict(block_size=256), dict(block_size=512), dict(num_heads=64, num_kv_heads=1)])
def test_configurations_inside_the_limits_pass(change):
    assert violations(AttentionShape(**{**SHAPE.__dict__, **change}), StepBounds(65536, 4096)) == []
    windowed = AttentionShape(**{**SHAPE.__dict__, **change, "sliding_window": 4096})
    assert violations(windowed, StepBounds(65534, 4095)) == []


def test_block_sizes_production_has_not_run_are_allowed_with_a_warning():
    for block_size in (256, 384, 512):
        with pytest.warns(AscendUnverifiedWarning, match=f"block_size={block_size}: allowed by the docs.*128 only"):
            check_supported(AttentionShape(**{**SHAPE.__dict__, "block_size": block_size}), StepBounds(2048, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_supported(SHAPE, StepBounds(2048, 256))  # 128: no warning


@pytest.mark.parametrize("case", [dict(dtype=torch.float16), dict(head_dim=64), dict(block_size=16)])
def test_refused_graph_is_left_unchanged(case):
    example, _ = _step_inputs([(3, 2)], **case)
    gm = make_fx(_step)(*example)
    before = gm.code
    with pytest.raises(AscendLoweringError, match="_op_plugin_docs.py"):
        lower_to_ascend(gm, example, ops=EMULATED, bounds=BOUNDS)
    assert gm.code == before


# ---------------------------------------------------------------- the LLM on the ascend target


@pytest.fixture(scope="module")
def tnd_model():
    return tiny_model("llama", **TND_MODEL)


def test_mixed_batch_matches_the_reference_target(tnd_model, capture_once, mixed_prompts):
    """The core issue's 12 prompts, block_size 128, at most 200 tokens a step: chunked prefills
    resume mid-block (128 + 72) and steps mix prefill and decode."""
    steps = []
    outputs = {}
    for target in ("reference", "ascend"):
        llm = LLM(tnd_model, target=target, block_size=BLOCK, max_num_batched_tokens=200)
        if target == "ascend":
            runner, execute = llm.llm_engine.runner, llm.llm_engine.runner.execute
            runner.execute = lambda batch, *a, execute=execute, **k: steps.append(batch) or execute(batch, *a, **k)
        results = llm.generate(mixed_prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        outputs[target] = [r.outputs[0].token_ids for r in results]
        if target == "ascend":  # decode steps padded to their bucket's graph, the others in pieces
            graphs = llm.program.graphs
            assert graphs.mode == "full_and_piecewise" and graphs.graph_steps > 0 and graphs.piecewise_steps > 0
            assert any(b not in (len(s.seq_lens) for s in steps) for b in graphs.buckets_compiled), "none padded"
    q_lens = [b.cu_seqlens_q.diff() for b in steps]
    cached = [b.seq_lens - q for b, q in zip(steps, q_lens)]
    assert any((q > 1).any() and (q == 1).any() for q in q_lens), "no step mixed prefill and decode"
    assert any(((q > 1) & (c % BLOCK != 0)).any() for q, c in zip(q_lens, cached)), "no chunk resumed mid-block"
    assert len(outputs["ascend"]) == len(outputs["reference"]) == len(mixed_prompts)
    for prompt, got, expected in zip(mixed_prompts, outputs["ascend"], outputs["reference"]):
        assert_greedy_tokens_or_tie(tnd_model, prompt, got, expected)


def test_mixed_step_logits_match_the_reference_target(tnd_model, capture_once):
    """One step with a fresh prefill, a decode and a chunked prefill resuming mid-block (200)."""
    logits = []
    for model, target in ((tnd_model, "reference"), (tnd_model, "ascend"), (snapshot(tnd_model).float(), "reference")):
        llm = LLM(model, target=target, block_size=BLOCK, num_blocks=16)
        runner, kv = llm.llm_engine.runner, KVCacheManager(16, BLOCK)
        fresh, decoding, chunked = (Request(str(i), p, SamplingParams()) for i, p in
                                    enumerate(random_prompts((37, 150, 260), seed=3)))
        for parts in ([(decoding, 149), (chunked, 200)], [(fresh, 37), (decoding, 1), (chunked, 60)]):
            scheduled = [ScheduledRequest(r, n) for r, n in parts]
            for s in scheduled:
                assert kv.allocate_slots(s.request, s.num_new_tokens)
            out = runner.execute(build_batch(scheduled, block_size=BLOCK, num_blocks=16))
            for s in scheduled:
                s.request.num_computed_tokens += s.num_new_tokens
        logits.append(out.float())
    assert_within_own_error(logits[1], logits[0], logits[2])


def test_ascend_target_defaults_to_block_size_128_and_reports_the_lowering(tnd_model, capture_once):
    llm = LLM(tnd_model, target="ascend", num_blocks=8)
    assert llm.block_size == 128 and LLM(tnd_model, num_blocks=8).block_size == 16
    note = llm.report.notes[-1]
    assert "npu_fused_infer_attention_score" in note and "TND" in note and "emulated on cpu" in note


def test_unknown_target_is_a_value_error(tnd_model):
    with pytest.raises(ValueError, match="target: expected one of \\['ascend', 'onnx', 'reference'\\], got 'cuda'"):
        LLM(tnd_model, target="cuda")


def test_model_outside_the_limits_is_refused_with_the_cited_limit():
    with pytest.raises(AscendLoweringError, match="TND supports bfloat16 only.*npu_fused_infer_attention_score"):
        LLM(tiny_model("llama", dtype=torch.float32, head_dim=128), target="ascend")


def test_cli_generate_on_the_ascend_target(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the summary table on one line per row
    tiny_model("llama", **TND_MODEL).save_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    args = ["generate", "--target", "ascend", "--prompt", "Hi", "--max-tokens", "3"]
    assert cli_main([*args, "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 (0 failed)" in out
    assert re.search(r"full_and_piecewise: 1 graph\(s\) captured \(batch sizes 1\); 2 replays \(length refresh "
                     r"[0-9.]+ ms and replay [0-9.]+ ms per replay\); 3 piece graph\(s\) captured \(token sizes "
                     r"[0-9]+\), 1 steps in pieces, 0 steps eagerly", out), out
    assert cli_main([*args, "--model", str(tmp_path), "--target-option", "graph_mode=decode_buckets"]) == 0
    assert "decode_buckets: 1 graph(s) compiled (batch sizes 1); 2 steps ran in a compiled graph, 1 eagerly" in \
        capsys.readouterr().out  # (graph_mode=dynamic, and every mode's tokens: tests/test_ascend_graphs.py)
    # A float32 model is outside TND's limits: a clear error, no traceback.
    tiny_model("llama", dtype=torch.float32, head_dim=128).save_pretrained(tmp_path / "fp32")
    byte_level_tokenizer().save_pretrained(tmp_path / "fp32")
    assert cli_main([*args, "--model", str(tmp_path / "fp32")]) == 2
    assert "TND supports bfloat16 only" in capsys.readouterr().err


# ---------------------------------------------------------------- torch.compile on Ascend


def test_graph_handed_to_torchair_holds_aten_and_ascend_ops_and_serves_every_composition(tnd_model, capture_once):
    """``compile_step`` + ``ascend_backend`` with a stand-in for TorchAir's backend that records the
    graph (and runs it on the emulation); logits against the reference target's step graph."""
    rewritten = rewrite(capture(tnd_model))
    recorded = []
    backend = ascend_backend(max_num_tokens=512, max_num_seqs=16, ops=EMULATED,
                             npu_backend=lambda gm, inputs: recorded.append(gm) or gm.forward)
    step = compile_step(rewritten.graph_module, backend)
    reference = LLM(tnd_model, num_blocks=16, block_size=BLOCK)
    exact = LLM(snapshot(tnd_model).float(), num_blocks=16, block_size=BLOCK).llm_engine.runner
    caches = [torch.zeros_like(c) for c in reference.llm_engine.runner.kv_caches]
    kv = KVCacheManager(16, BLOCK)
    requests = [Request(str(i), p, SamplingParams()) for i, p in enumerate(random_prompts((150, 300, 13, 30), seed=5))]
    compositions = [[(0, 140), (1, 200)], [(0, 1), (1, 60), (2, 12)], [(0, 1), (1, 1), (2, 1)], [(3, 30), (1, 20)]]
    for parts in compositions:  # the first has B, T and max_blocks_per_seq >= 2 (dynamo specialises 0 and 1)
        scheduled = [ScheduledRequest(requests[i], n) for i, n in parts]
        for s in scheduled:
            assert kv.allocate_slots(s.request, s.num_new_tokens)
        batch = build_batch(scheduled, block_size=BLOCK, num_blocks=16)
        metadata = [batch.as_inputs()[name] for name in METADATA_INPUTS]
        with torch.no_grad():
            got = step(*metadata, *caches)
            expected = reference.llm_engine.runner.program(*metadata, *reference.llm_engine.runner.kv_caches)
            exact_logits = exact.program(*metadata, *exact.kv_caches)
        assert_within_own_error(got, expected, exact_logits)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
    assert len(recorded) == 1, "one graph for every batch composition"
    graph = recorded[0].graph
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    assert {getattr(t, "namespace", None) for t in targets} <= {"aten", *EMULATED.namespaces, None}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sizes = {n.target for n in placeholders if isinstance(n.meta["example_value"], torch.SymInt)}  # T, B, ...
    weights = {n.target for n in placeholders if "_parameters_" in n.target or "_buffers_" in n.target}
    expected = {f"L_{name}_" for name in METADATA_INPUTS} | {f"L_{kind}_cache_{i}_" for i in range(2)
                                                              for kind in ("key", "value")}
    assert sizes and {n.target for n in placeholders} - sizes - weights == expected


# ---------------------------------------------------------------- CANN only where it is used


class _NoAscend:
    """A meta-path finder that makes importing torch_npu/torchair fail, and records the attempt."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch_npu", "torchair"):
            self.attempts.append(name)
            raise ImportError(f"libhccl.so: cannot open shared object file (while importing {name})")
        return None


@pytest.fixture
def no_ascend(monkeypatch):
    finder = _NoAscend()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] in ("torch_npu", "torchair")]:
        monkeypatch.delitem(sys.modules, name)
    return finder


def test_the_emulated_ascend_target_never_imports_torch_npu(no_ascend, tnd_model):
    LLM(tnd_model, target="ascend", num_blocks=4).generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert no_ascend.attempts == []


def test_missing_cann_gives_a_clear_message(no_ascend, tnd_model):
    with pytest.raises(AscendUnavailableError, match="CANN toolkit installed.*pip install -e .\\[ascend\\]"):
        npu_ops()
    with pytest.raises(AscendUnavailableError, match="libhccl.so"):
        LLM(tnd_model, target="ascend", device="npu")
    assert no_ascend.attempts


class StandInConfig:
    """torchair.CompilerConfig's shape: ``mode`` and ``experimental_config`` hold OptionValues."""

    def __init__(self, mode="max-autotune", tiling_schedule_optimize=False):
        self.mode = SimpleNamespace(value=mode)
        self.experimental_config = SimpleNamespace(frozen_parameter=SimpleNamespace(value=False),
                                                   tiling_schedule_optimize=SimpleNamespace(
                                                       value=tiling_schedule_optimize))


def test_torchair_backend_uses_the_production_config(monkeypatch):
    """With stand-ins for torch_npu and torchair: the GE mode (the only one running the air op),
    frozen parameters, operators from installed binaries; tiling sink refused (TND)."""
    built, modes = [], []
    torchair = SimpleNamespace(CompilerConfig=StandInConfig, get_npu_backend=lambda compiler_config: built.append(
        compiler_config) or "torchair backend")
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "torchair", torchair)
    monkeypatch.setattr(torch, "npu", SimpleNamespace(set_compile_mode=lambda **kw: modes.append(kw)), raising=False)
    assert torchair_backend() == "torchair backend" and built[0].mode.value == "max-autotune"
    assert built[0].experimental_config.frozen_parameter is True and modes == [{"jit_compile": False}]
    with pytest.raises(ValueError, match="expected 'max-autotune'.*got 'reduce-overhead'"):
        torchair_backend(StandInConfig("reduce-overhead"))
    with pytest.raises(ValueError, match="tiling_schedule_optimize: tiling sink is not supported with the TND"):
        torchair_backend(StandInConfig(tiling_schedule_optimize=True))


@pytest.mark.parametrize("version, ok", [("8.2.RC1", False), ("8.3.RC1", True), ("8.3.0", True), ("8.5.0", True),
                                         ("9.1.0", True), ("9.0.RC1", True), ("10.0.RC1", "warn"),
                                         ("7.0.0", False), ("8.3.RC1.alpha002", True), (None, False)])
def test_cann_version_is_checked_when_the_npu_ops_are_taken(monkeypatch, version, ok):
    """A stand-in torch_npu reporting ``torch.version.cann``: below 8.3.RC1 npu_ops() refuses
    with the version found and the one needed, before touching TorchAir's op modules; 8.3.RC1 to
    9.x pass quietly; a later major release passes with a warning naming the followed range."""
    imported = []
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "torchair", ModuleType("torchair"))
    monkeypatch.setattr(torch.version, "cann", version, raising=False)
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name))
    if ok:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(AttributeError):  # past the check: the stand-ins define no air / npu ops
                npu_ops()
        newer = [str(w.message) for w in caught if issubclass(w.category, AscendUnverifiedWarning)]
        assert len(newer) == (ok == "warn"), newer
        assert all("newer than the releases this lowering follows (8.3.RC1 - 9.x)" in m for m in newer)
        assert imported == ["torchair.ops._npu_fused_infer_attention_score",
                            "torchair.ops._npu_fused_infer_attention_score_v2"]
    else:
        needed = "is not set" if version is None else f"found CANN {version}"
        with pytest.raises(AscendUnavailableError, match=f"needs CANN >= 8.3.RC1.*{needed}"):
            npu_ops()
        assert imported == []


def test_installing_never_pulls_torch_npu_unless_the_ascend_extra_is_asked_for():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any("npu" in dep for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert [name for name, deps in extras.items() if any("torch-npu" in d for d in deps)] == ["ascend"]
