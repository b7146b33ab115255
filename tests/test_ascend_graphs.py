"""Graph modes of the ``ascend`` target (``lowering/ascend/graphs.py``), on the op emulation and
the ACL graph stand-in (``kernels/npu_graph_emulation.py``).

Decode steps run a graph per batch-size bucket (an ACL graph replayed, or a static TorchAir
graph), the others eagerly; the padded steps are compared with the reference target (the
project's own ops, unpadded) on the same batches.
"""
import random
from collections import Counter

import pytest
import torch
import transformers
from torch.fx.experimental.proxy_tensor import make_fx

import pagedpack.lowering.ascend.target as ascend_target
from pagedpack import LLM, SamplingParams
from pagedpack.lowering.ascend.graphs import DEFAULT_GRAPH_BATCH_SIZES, pad_decode
from pagedpack.lowering.ascend.lower import emulated_ops, step_example_inputs
from pagedpack.models.tiny import VOCAB_SIZE, tiny_model
from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.request import Request
from pagedpack.runtime.scheduler import ScheduledRequest
from pagedpack.step.metadata import example_metadata

from conftest import assert_greedy_tokens_or_tie, assert_within_own_error, hf_greedy, random_prompts, snapshot

BLOCK = 128
TND_MODEL = dict(dtype=torch.bfloat16, head_dim=128)  # inside TND's limits


@pytest.fixture(scope="module")
def tnd_model():
    return tiny_model("llama", **TND_MODEL)


def test_pad_decode_keeps_t_equal_to_the_last_cumulative_length_and_writes_only_the_padding_block():
    batch = example_metadata([1, 1, 1], [5, 130, 0], block_size=BLOCK, num_blocks=8)
    metadata = list(batch.as_inputs().values())
    input_ids, positions, cu, seq_lens, table, slots, logits_indices = pad_decode(
        metadata, 8, width=4, padding_block=8, block_size=BLOCK)
    assert input_ids.shape[0] == positions.shape[0] == slots.shape[0] == int(cu[-1]) == 8  # vllm-ascend #6076
    assert cu.tolist() == list(range(9)) and cu.dtype == torch.int32
    assert seq_lens.tolist() == [6, 131, 1, 1, 1, 1, 1, 1]
    assert table.shape == (8, 4) and table.dtype == torch.int32
    assert torch.equal(table[:3, :batch.block_table.shape[1]], batch.block_table) and (table[3:] == 8).all()
    assert torch.equal(slots[:3], batch.slot_mapping)
    assert (slots[3:] // BLOCK == 8).all() and len(set(slots[3:].tolist())) == 5  # the padding block, distinct slots
    assert logits_indices.tolist() == list(range(8))
    with pytest.raises(ValueError, match="pad_decode: expected a decode step"):
        pad_decode(list(example_metadata([2, 1], block_size=BLOCK, num_blocks=8).as_inputs().values()), 4,
                   width=4, padding_block=8, block_size=BLOCK)


@pytest.fixture(scope="module")
def references(tnd_model):
    """``references(num_blocks, max_model_len)``: the reference target's runner and an fp32 reference's
    (the exact reference the two bf16 runs are measured against), by name; built once per pool for
    the module, their KV caches zeroed for each test (as a new runner's)."""
    built = {}

    def runners(num_blocks, max_model_len):
        if (num_blocks, max_model_len) not in built:
            llms = {"reference": LLM(tnd_model, target="reference", block_size=BLOCK, num_blocks=num_blocks,
                                     max_model_len=max_model_len),
                    "fp32": LLM(snapshot(tnd_model).float(), block_size=BLOCK, num_blocks=num_blocks,
                                max_model_len=max_model_len)}
            built[num_blocks, max_model_len] = {target: llm.llm_engine.runner for target, llm in llms.items()}
        for runner in built[num_blocks, max_model_len].values():
            for cache in runner.kv_caches:
                cache.zero_()
        return built[num_blocks, max_model_len]
    return runners


def _runners(tnd_model, references, num_blocks, max_model_len, **ascend):
    """The ascend target's program, and its runner, the reference target's and an fp32 reference's, by name."""
    llm = LLM(tnd_model, target="ascend", **ascend, block_size=BLOCK, num_blocks=num_blocks,
              max_model_len=max_model_len)
    return llm.program, {"ascend": llm.llm_engine.runner, **references(num_blocks, max_model_len)}


def _collect_mismatches(mismatches: list):
    """A ``compare`` for :func:`_run_steps` that appends each mismatch to ``mismatches`` instead of raising."""
    def compare(got, expected, exact):
        try:
            assert_within_own_error(got, expected, exact)
        except AssertionError as err:
            mismatches.append(err)
    return compare


def _run_steps(runners, steps, kv, num_blocks, max_model_len, *, compare=assert_within_own_error):
    """Run each step (``(request, new tokens)`` pairs) on every runner and ``compare`` the logits."""
    for parts in steps:
        for r, n in parts:
            if r.num_computed_tokens + n > r.num_tokens:  # a decode: the token sampled last step
                r.append_output(7, max_model_len)
        scheduled = [ScheduledRequest(r, n) for r, n in parts]
        for s in scheduled:
            assert kv.allocate_slots(s.request, s.num_new_tokens)
        batch = build_batch(scheduled, block_size=BLOCK, num_blocks=num_blocks)
        got, expected, exact = (runners[t].execute(batch) for t in ("ascend", "reference", "fp32"))
        assert got.shape == expected.shape
        compare(got, expected, exact)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens


@pytest.mark.parametrize("mode", ["full_decode_only", "decode_buckets"])
def test_decode_steps_of_1_to_37_sequences_run_one_graph_per_bucket(tnd_model, references, capture_once, monkeypatch,
                                                                    mode):
    """40 steps: prefills and a mixed step (eager), then decode batches of every size 1..37 in a
    shuffled order (graphs): one ACL graph captured per bucket used and replayed for every decode
    step, or one TorchAir graph compiled per bucket (a recording backend counts what dynamo
    compiles). Logits match the reference target on every step; blocks no request holds are never
    written."""
    recorded = []
    monkeypatch.setattr(ascend_target, "emulation_backend", lambda gm, inputs: recorded.append(gm) or gm.forward)
    num_blocks, max_model_len = 96, 512
    program, runners = _runners(tnd_model, references, num_blocks, max_model_len, target_options={"graph_mode": mode})
    sentinel = float("nan")
    for cache in runners["ascend"].kv_caches:
        cache.fill_(sentinel)
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    requests = [Request(str(i), p, SamplingParams(max_tokens=64, ignore_eos=True)) for i, p in
                enumerate(random_prompts([random.Random(i).randrange(2, 200) for i in range(37)], seed=7))]
    sizes = list(range(1, 38))
    random.Random(0).shuffle(sizes)
    steps = [[(r, len(r.prompt_token_ids)) for r in requests[:20]],
             [(r, len(r.prompt_token_ids)) for r in requests[20:36]],
             [(requests[0], 1), (requests[36], len(requests[36].prompt_token_ids))]]  # mixed
    steps += [[(r, 1) for r in random.Random(b).sample(requests, b)] for b in sizes]
    assert len(steps) == 40
    _run_steps(runners, steps, kv, num_blocks, max_model_len)
    stats = program.graphs
    used = sorted({next(b for b in DEFAULT_GRAPH_BATCH_SIZES if b >= size) for size in sizes})
    assert sorted(stats.buckets_compiled) == used and stats.graphs_compiled == len(used)
    assert (stats.graph_steps, stats.eager_steps) == (37, 3)
    if mode == "full_decode_only":
        assert not recorded and sorted(program.run.captured) == used
        for captured in program.run.captured.values():  # each layer's FIA recorded as updatable
            assert len(captured.graph.updatable) == 2
        assert f"full_decode_only: {len(used)} graph(s) captured" in stats.describe()
        assert "37 replays" in stats.describe()
    else:
        assert len(recorded) == len(used)
        for gm in recorded:  # static shapes: no symbolic size among the graph's inputs
            assert not any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes
                           if n.op == "placeholder")
    held = {b for r in requests for b in r.block_ids}
    for cache in runners["ascend"].kv_caches:
        untouched = [b for b in range(num_blocks) if b not in held]
        assert cache[untouched].isnan().all(), "a block no request holds was written"
        assert not cache[num_blocks].isnan().all(), "the padding block beyond the pool took the padding writes"


def test_a_replay_needs_this_steps_kv_lengths(tnd_model, references, capture_once, monkeypatch):
    """Decode steps in one bucket with different sequences: each replays the graph the first
    captured. With the length refresh the logits are the reference's; without it FIA reads the
    capture's KV lengths and the logits are wrong, so a missing refresh cannot pass."""
    from pagedpack.lowering.ascend.graphs import ACLGraphBuckets

    num_blocks, max_model_len = 16, 512
    program, runners = _runners(tnd_model, references, num_blocks, max_model_len,
                                target_options={"graph_mode": "aclgraph", "graph_batch_sizes": [2]})  # the alias
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    requests = [Request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True))
                for i, p in enumerate(random_prompts([5, 150, 40, 260], seed=3))]
    prefill = [[(r, len(r.prompt_token_ids)) for r in requests]]
    decodes = [[(r, 1) for r in requests[:2]], [(r, 1) for r in requests[2:]]]
    _run_steps(runners, prefill + decodes, kv, num_blocks, max_model_len)  # refreshed: every step compared
    mismatches = []
    compare = _collect_mismatches(mismatches)

    monkeypatch.setattr(ACLGraphBuckets, "refresh", lambda self, captured, padded: None)
    _run_steps(runners, decodes, kv, num_blocks, max_model_len, compare=compare)  # stale: the last refresh's
    assert (program.graphs.graphs_compiled, program.graphs.graph_steps) == (1, 4)
    assert len(mismatches) == 2, mismatches


def _mixed_steps(requests, sizes, *, seed, max_chunk):
    """One step per entry of ``sizes``: that many requests, each computing a chunk of at most
    ``max_chunk`` of its prompt's remaining tokens (a prefill, or a chunk resuming one) or, once its
    prompt is done, one decode token."""
    rng, left = random.Random(seed), {r.request_id: len(r.prompt_token_ids) for r in requests}
    steps = []
    for size in sizes:
        parts = []
        for r in rng.sample(requests, size):
            n = min(left[r.request_id], rng.randrange(1, max_chunk + 1)) if left[r.request_id] else 1
            left[r.request_id] -= min(n, left[r.request_id])
            parts.append((r, n))
        steps.append(parts)
    return steps


PIECEWISE_TOKEN_SIZES = [16, 64, 128, 256, 512]


def test_prefill_chunked_and_mixed_steps_of_1_to_37_sequences_run_in_pieces(tnd_model, references, capture_once):
    """``full_and_piecewise``: 40 steps of 1..37 sequences (shuffled) mixing prefills, chunks resuming
    a prefill and decodes. Each step that is not a uniform decode runs padded to its token bucket in
    pieces: every piece is captured once per bucket used and replayed on every step of that bucket
    (the first one included, as on an NPU, where a capture computes nothing); uniform decode steps
    replay their full decode graph. Logits match the reference target on every step (the bf16
    rule); blocks no request holds are never written (the padding sequence writes the padding block)."""
    num_blocks, max_model_len = 96, 512
    program, runners = _runners(tnd_model, references, num_blocks, max_model_len,
                                target_options={"graph_token_sizes": PIECEWISE_TOKEN_SIZES})
    for cache in runners["ascend"].kv_caches:
        cache.fill_(float("nan"))
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    requests = [Request(str(i), p, SamplingParams(max_tokens=64, ignore_eos=True)) for i, p in
                enumerate(random_prompts([random.Random(i).randrange(2, 200) for i in range(37)], seed=5))]
    sizes = [37, 30, 20] + list(range(1, 38))
    random.Random(1).shuffle(sizes)
    steps = _mixed_steps(requests, sizes, seed=2, max_chunk=16)
    _run_steps(runners, steps, kv, num_blocks, max_model_len)
    full = [all(n == 1 for _, n in parts) and len(parts) <= max(DEFAULT_GRAPH_BATCH_SIZES) for parts in steps]
    tokens = [sum(n for _, n in parts) for parts in steps]
    buckets = Counter(next(b for b in PIECEWISE_TOKEN_SIZES if b >= t) for t, f in zip(tokens, full) if not f)
    assert any(1 < n < len(r.prompt_token_ids) for parts in steps for r, n in parts), "no chunked prefill"
    assert any({n == 1 for _, n in parts} == {True, False} for parts in steps), "no step mixed prefill and decode"
    stats, pieces = program.graphs, program.run.pieces
    assert len(pieces) == 3 and stats.piecewise_steps == sum(buckets.values()) >= 30 and len(buckets) >= 3
    assert stats.graph_steps == sum(full) and stats.eager_steps == 0
    assert stats.piece_captures == Counter({(p, b): 1 for p in pieces for b in buckets})
    assert stats.piece_replays == Counter({(p, b): n for p in pieces for b, n in buckets.items()})
    assert f"{len(pieces) * len(buckets)} piece graph(s) captured" in stats.describe()
    held = {b for r in requests for b in r.block_ids}
    for cache in runners["ascend"].kv_caches:
        assert cache[[b for b in range(num_blocks) if b not in held]].isnan().all()
        assert not cache[num_blocks].isnan().all(), "the padding block beyond the pool took the padding writes"


def test_a_piece_replay_needs_this_steps_inputs(tnd_model, references, capture_once, monkeypatch):
    """Prefill chunks of different requests in one token bucket: the first step captures each piece,
    the later ones replay it. Without the per-replay update (this step's tensors copied into the
    captured buffers) a replay recomputes the capture's step, and every later step's logits are
    wrong; a replay given another shape or host argument than its capture's is refused."""
    from pagedpack.lowering.ascend.graphs import PiecewiseGraphs

    num_blocks, max_model_len = 16, 512
    program, runners = _runners(tnd_model, references, num_blocks, max_model_len,
                                target_options={"graph_token_sizes": [64]})
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    requests = [Request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True))
                for i, p in enumerate(random_prompts([90, 60, 120, 100], seed=4))]
    mismatches = []
    compare = _collect_mismatches(mismatches)

    _run_steps(runners, [[(requests[0], 50), (requests[1], 10)]], kv, num_blocks, max_model_len)  # captures
    monkeypatch.setattr(PiecewiseGraphs, "load", staticmethod(lambda captured, args: None))
    _run_steps(runners, [[(requests[0], 40), (requests[2], 20)], [(requests[3], 60)], [(requests[1], 30)]], kv,
               num_blocks, max_model_len, compare=compare)
    assert program.graphs.piecewise_steps == 4 and set(program.graphs.piece_captures.values()) == {1}
    assert len(mismatches) == 3, mismatches
    monkeypatch.undo()
    captured = next(iter(program.run.captured_pieces.values()))
    wrong = [a[:-1] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 64 else a for a in captured.args]
    with pytest.raises(RuntimeError, match="piecewise replay: captured shape \\(64"):
        PiecewiseGraphs.load(captured, wrong)
    ints = [i for i, a in enumerate(captured.args) if isinstance(a, int)]
    if ints:
        with pytest.raises(RuntimeError, match="piecewise replay: a host argument was 64 at capture, now 63"):
            PiecewiseGraphs.load(captured, [63 if i in ints else a for i, a in enumerate(captured.args)])


def test_the_capture_reads_no_device_value():
    """A device-to-host read inside a capture fails there (a capturing stream cannot synchronise):
    the stand-in raises, so host lengths read in the captured program would be caught."""
    from pagedpack.kernels.npu_graph_emulation import NPUGraph, graph

    g = NPUGraph()
    x = torch.arange(4)
    with pytest.raises(RuntimeError, match="device-to-host read"):
        with graph(g, auto_dispatch_capture=True):
            (x + 1).sum().item()
    with pytest.raises(RuntimeError, match="not captured with auto_dispatch_capture=True"):
        with graph(g):
            x.add_(1)
        g.update(cpu_update_input=[{}])
    g.replay()  # the recorded in-place add runs again on the captured tensor
    assert x.tolist() == [2, 3, 4, 5]


def test_every_graph_mode_gives_the_reference_tokens(tnd_model, capture_once):
    """The reference target, the default full and piecewise ACL graphs, the full decode graphs alone,
    the padded TorchAir decode graphs, the dynamic graph mode, no graphs and the default with n-gram
    speculation (its verification steps in pieces, FIA's ``actual_seq_qlen`` read off
    ``cu_seqlens_q``) each give the
    unmodified model's greedy tokens, a bf16 tie aside (the targets' attention sums in different
    orders: a 1-ulp bf16 difference picks the other side of a tie)."""
    reference = snapshot(tnd_model)
    prompts = random_prompts((3, 40, 130, 9, 200), seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    tokens = {}
    for name, kwargs in (("reference", {}),
                         ("full_and_piecewise", dict(target="ascend", target_options={"graph_batch_sizes": [4, 8]})),
                         ("full_decode_only", dict(target="ascend", target_options={"graph_mode": "full_decode_only",
                                                                                    "graph_batch_sizes": [4, 8]})),
                         ("decode_buckets", dict(target="ascend", target_options={"graph_mode": "decode_buckets",
                                                                                  "graph_batch_sizes": [4, 8]})),
                         ("dynamic", dict(target="ascend", target_options={"graph_mode": "dynamic"})),
                         ("eager", dict(target="ascend", target_options={"graph_mode": "eager"})),
                         # verification steps (1 + k query tokens a sequence) run in pieces, decode steps replay
                         ("speculative", dict(target="ascend", target_options={"graph_batch_sizes": [4, 8]},
                                              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2}))):
        llm = LLM(tnd_model, block_size=BLOCK, max_num_batched_tokens=256, **kwargs)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      params, use_tqdm=False)]
        if name == "speculative":
            assert llm.get_stats().spec_decode_num_accepted_tokens > 0
        graphs = llm.program.graphs if name != "reference" else None
        if name in ("full_and_piecewise", "full_decode_only", "decode_buckets"):  # 5 decoding sequences padded to 8
            assert graphs.graph_steps > 0 and set(graphs.buckets_compiled) <= {4, 8}
        if name in ("full_and_piecewise", "speculative"):  # every prefill (<= 256 tokens) in pieces
            assert graphs.mode == "full_and_piecewise" and graphs.piecewise_steps > 0 and graphs.eager_steps == 0
        if name == "eager":
            assert graphs.eager_steps > 0 and graphs.graph_steps == graphs.piecewise_steps == 0
        if name == "dynamic":
            assert llm.program.graphs.eager_steps == 0 and llm.program.graphs.graph_steps > 0
    for prompt, *outputs in zip(prompts, *tokens.values()):
        expected = hf_greedy(reference, prompt, 12)
        for got in outputs:
            assert_greedy_tokens_or_tie(reference, prompt, got, expected)


def test_a_model_with_sinks_and_sliding_windows_generates_the_reference_tokens_through_fia_v2():
    """A tiny gpt-oss (attention sinks on every layer, a 24-key window on the first, experts; bf16,
    head_dim 128) on the default full_and_piecewise mode (prefills in pieces): each site is FIA v2
    with the sinks as its learnable_sink (and the band with the dummy sequence on the windowed layer), the replays
    refresh v2's ``actual_seq_kvlen``, and the tokens are the reference target's (the native CPU
    kernels' sinks and windows), a bf16 tie of the fp32 model aside. Not transformers' bf16 tokens:
    its eager attention takes gpt-oss's softmax in bf16, where both targets accumulate in fp32 (the
    fp32 model is token-exact against transformers in the walk). The experts share one set of
    weights: the router's top-2 choice is discontinuous, and a 1-ulp difference between two
    attention kernels' bf16 outputs can flip it where two experts' scores tie, which would make the
    comparison about the router instead of the attention under test."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.5,
        bos_token_id=VOCAB_SIZE - 2, eos_token_id=VOCAB_SIZE - 1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if ".experts." in name:
                weight.copy_(weight[:1].expand_as(weight))
    exact = snapshot(model).float()
    prompts = random_prompts((30, 60, 140), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [o.outputs[0].token_ids for o in LLM(model, block_size=BLOCK, max_num_batched_tokens=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = LLM(model, target="ascend", block_size=BLOCK, max_num_batched_tokens=256)
    assert "2 through npu_fused_infer_attention_score_v2" in llm.report.notes[-1]
    assert llm.program.run.kv_updates == [("actual_seq_kvlen", True), ("actual_seq_kvlen", False)]
    v2 = emulated_ops().fused_infer_attention_score_v2_eager
    fias = [n for n in llm.program.run.eager.graph.nodes if n.target == v2]
    assert [("learnable_sink" in n.kwargs, n.kwargs["sparse_mode"]) for n in fias] == [(True, 4), (True, 3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.program.graphs.graph_steps > 0 and llm.program.graphs.piecewise_steps > 0
    for prompt, output, tokens in zip(prompts, outputs, expected):
        assert_greedy_tokens_or_tie(exact, prompt, output.outputs[0].token_ids, tokens)


def test_functionalised_graph_writes_each_cache_back_once_from_the_scatter(tnd_model, capture_once):
    """TorchAir restores the in-place cache write after functionalisation only when each cache input
    has two users, the view the scatter reads and one ``copy_`` back into it whose source is a view
    of the scatter result (``torchair/patterns/_recover_view_inplace_pattern.py``); otherwise every
    layer copies its whole cache each step."""
    llm = LLM(tnd_model, target="ascend", target_options={"graph_mode": "decode_buckets"}, block_size=BLOCK,
              num_blocks=4)
    gm = llm.rewritten.graph_module  # lowered in place: the graph compiled per bucket
    functional = make_fx(torch.func.functionalize(gm))(*step_example_inputs(llm.rewritten, BLOCK, "cpu"))
    functional.graph.eliminate_dead_code()
    scatter = torch.ops.pagedpack_npu.npu_scatter_nd_update.default
    placeholders = [n for n in functional.graph.nodes if n.op == "placeholder"]
    caches = placeholders[-4:]  # key_cache_0, value_cache_0, key_cache_1, value_cache_1
    assert not any(n.target == emulated_ops().scatter_nd_update_ for n in functional.graph.nodes)
    for cache in caches:
        copies = [u for u in cache.users if u.target == torch.ops.aten.copy_.default]
        assert len(copies) == 1 and copies[0].args[0] is cache, cache.name
        source = copies[0].args[1]
        assert source.target == torch.ops.aten.view.default and source.args[0].target == scatter, source.format_node()
        views = [u for u in cache.users if u is not copies[0]]
        assert len(views) == 1 and list(views[0].users) == [source.args[0]], "the view feeds the scatter alone"


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_options={"graph_mode": "dynamic"}),
     "target_options: the reference target takes no options, got \\['graph_mode'\\]"),
    (dict(target="ascend", target_options={"graph_mode": "static"}),
     "graph_mode: expected one of \\['full_and_piecewise', 'full_decode_only', 'eager', 'decode_buckets', "
     "'dynamic'\\] \\(or \\['aclgraph'\\]\\)"),
    (dict(target="ascend", target_options={"graph_batch_sizes": [0, 4]}),
     "graph_batch_sizes: expected a non-empty list of ints in 1..40"),
    (dict(target="ascend", target_options={"graph_batch_sizes": []}), "graph_batch_sizes: expected a non-empty list"),
    (dict(target="ascend", target_options={"graph_mode": "dynamic", "graph_batch_sizes": [4]}),
     "graph_batch_sizes: only the full_and_piecewise, full_decode_only, decode_buckets graph modes"),
    (dict(target="ascend", target_options={"graph_token_sizes": [0, 16]}),
     "graph_token_sizes: expected a non-empty list of ints in 1..65536"),
    (dict(target="ascend", target_options={"graph_mode": "aclgraph", "graph_token_sizes": [16]}),
     "graph_token_sizes: only the full_and_piecewise graph mode takes them, got graph_mode='full_decode_only'"),
    (dict(target="ascend", target_options={"graph_modes": "dynamic"}),
     "target_options: the ascend target takes \\['graph_mode', 'graph_batch_sizes', 'graph_token_sizes'\\], got "
     "\\['graph_modes'\\]"),
    (dict(target="ascend", target_options=["graph_mode"]), "target_options: the ascend target takes"),
])
def test_graph_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny", **kwargs)


def test_target_options_from_the_command_line():
    """``--target-option KEY=VALUE`` reads each value as its option's type."""
    from pagedpack.cli import build_parser
    from pagedpack.engine_args import EngineArgs
    from pagedpack.lowering.ascend.target import AscendOptions

    parser = build_parser()
    argv = ["generate", "--model", "tiny", "--target", "ascend", "--target-option", "graph_batch_sizes=8,2",
            "--target-option", "graph_mode=decode_buckets"]
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert args.target_options == AscendOptions(graph_mode="decode_buckets", graph_batch_sizes=(2, 8))
    assert AscendOptions(graph_mode="aclgraph") == AscendOptions(graph_mode="full_decode_only")  # the former name
    for bad, message in (("graph_batch_sizes=two", "--target-option: graph_batch_sizes: expected a tuple"),
                         ("graph_mode", "expected KEY=VALUE with KEY one of \\['graph_batch_sizes', 'graph_mode', "
                                        "'graph_token_sizes'\\]"),
                         ("size=3", "the ascend target's options\\), got 'size=3'")):
        with pytest.raises(ValueError, match=message):
            EngineArgs.from_cli_args(parser.parse_args([*argv[:5], "--target-option", bad]))


def test_prefixes_beyond_the_device_pool_come_back_from_the_host_tier(tnd_model, capture_once):
    """The second KV tier on the ascend target (docs/kv-offload.md): three shared prefixes of 3 blocks
    (9 blocks) do not fit the emulated device pool of 8; with a host tier (``kv_offload_size``) a second
    pass takes them from it, with the tokens of caching off (the same engine, each prompt with a
    ``cache_salt`` of its own: nothing cached is shared)."""
    llm = LLM(tnd_model, target="ascend", target_options={"graph_batch_sizes": [2]}, block_size=BLOCK, num_blocks=8,
              max_num_seqs=2, max_num_batched_tokens=512, kv_offload_size=16 << 20)
    try:
        engine, greedy = llm.llm_engine, SamplingParams(max_tokens=4, temperature=0.0)
        rng = random.Random(1)
        prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(3 * BLOCK)] for _ in range(3)]
        prompts = [prefixes[i % 3] + [7, i, 9] for i in range(6)]
        alone = llm.generate([{"prompt_token_ids": p, "cache_salt": f"alone-{i}"} for i, p in enumerate(prompts)],
                             greedy, use_tqdm=False)
        assert engine.scheduler.kv_cache_manager.pool.num_blocks < 9 and engine.reset_prefix_cache()
        tier, stats = engine.scheduler.connector.tier, engine.scheduler.connector_prefix_cache_stats
        shared = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(shared, greedy, use_tqdm=False)
        hits = stats.hits
        second = llm.generate(shared, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second] == \
            [o.outputs[0].token_ids for o in alone]
        assert tier.medium == "CPU" and tier.stats.misses == 0
        assert stats.hits - hits >= 3 * BLOCK  # a whole prefix or more came from the tier
    finally:
        llm.llm_engine.close()
