"""KV sharing across layers (Gemma-4's and Gemma-3n's ``num_kv_shared_layers``): a layer attending over an
earlier layer's K/V reads that layer's cache (``passes/kv_sharing.py``). Its tokens against the unmodified
model are in ``tests/test_families.py`` (``gemma4_text``, ``gemma3n_text``); here, on Gemma-4's tiny config
(5 layers, the last 3 sharing the caches of layers 0 and 1): one cache pair per owner layer in the graph,
the specs, the pool and the stats; the owners' quantized caches; preemption; the ``.pt2`` file; the ONNX
functional graph; tensor-parallel shards; the Ascend lowering."""
import contextlib
import copy
import json
import zipfile

import pytest
import torch
import transformers as T

import pagedpack.passes.kv_sharing as kv_sharing
from pagedpack import LLM, SamplingParams
from pagedpack.lowering.ascend.limits import StepBounds
from pagedpack.lowering.ascend.lower import emulated_ops, lower_to_ascend
from pagedpack.lowering.onnx.functions import functionalize_caches, unsupported_params
from pagedpack.models.capture import capture
from pagedpack.passes.attention_sites import find_attention_sites
from pagedpack.passes.numerics import float64_copy, float64_inputs
from pagedpack.passes.pipeline import rewrite
from pagedpack.passes.tensor_parallel import check_shards, shard_step_graph
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import example_metadata

from conftest import assert_within_own_error, hf_greedy, random_prompts, snapshot
from test_families import GEMMA4_KV_SHARING, V

ops = torch.ops.pagedpack
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = random_prompts((1, 17, 40, 100, 33), seed=2, vocab=V)
# the tiny config's caches per token: owners 0 (sliding: 2 KV heads x (16 + 16) x fp32) and 1 (full: head 32)
OWNED_BYTES = 2 * (16 + 16) * 4 + 2 * (32 + 32) * 4  # 768
UNSHARED_BYTES = 3 * 2 * (16 + 16) * 4 + 2 * 2 * (32 + 32) * 4  # 1792: each of the 5 layers with its own


def gemma4(dtype=torch.float32, **overrides):
    config = T.Gemma4TextConfig(**{**GEMMA4_KV_SHARING, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()


@contextlib.contextmanager
def every_layer_its_own_cache():
    """The rewrite as before KV sharing: each site owns a cache pair (the pass finds no sharing)."""
    owners = kv_sharing.cache_owners
    kv_sharing.cache_owners = lambda sites: list(range(len(sites)))
    try:
        yield
    finally:
        kv_sharing.cache_owners = owners


@pytest.fixture(scope="module")
def model():
    """The model of ``llm``; other LLMs get models of their own (an LLM merges its model's linears, and the
    tensor-parallel split finds the planned weights of ``llm``'s graph through its model)."""
    return gemma4()


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=16, max_num_batched_tokens=96, keep_source_model=True)


class _ThreeSites(torch.nn.Module):
    def forward(self, q, k, v):
        attend = torch.nn.functional.scaled_dot_product_attention
        owner = attend(q, k, v, is_causal=True)
        same_values = attend(q * 2, k.reshape(k.shape).contiguous(), v.clone(), is_causal=True)
        other_keys = attend(q, k + 1, v, is_causal=True)
        return owner + same_values + other_keys


def test_sharing_is_read_off_the_values_through_same_shape_views_and_copies():
    x = torch.randn(1, 2, 5, 8)
    graph = torch.export.export(_ThreeSites(), (x, x.clone(), x.clone())).module().graph
    sites = find_attention_sites(graph)
    assert sites[1].key_source is not sites[0].key_source  # a reshape of k, and a clone of v
    assert kv_sharing.cache_owners(sites) == [0, 0, 2]


def test_a_sharing_layer_reads_its_owners_cache_and_has_none_of_its_own(model, llm):
    owners = [i for i, mode in enumerate(model.config.kv_sharing_modes) if mode != "reuse"]
    assert owners == [0, 1]
    graph = llm.rewritten.graph_module.graph
    reads = [n for n in graph.nodes if n.target is ops.paged_attention.default]
    writes = [n for n in graph.nodes if n.target is ops.reshape_and_cache.default]
    caches = [n.target for n in graph.nodes if n.op == "placeholder" and "_cache_" in n.target]
    assert caches == ["key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"]
    assert len(writes) == len(owners) and len(reads) == 5
    # layers 2 and 3 (sliding) read layer 0's caches, layer 4 (full) layer 1's: each with its own window
    assert [r.args[1].target for r in reads] == ["key_cache_0", "key_cache_1", "key_cache_0", "key_cache_0",
                                                 "key_cache_1"]
    assert [r.kwargs.get("sliding_window") for r in reads] == [24, None, 24, 24, None]
    assert [s.kv_cache_of for s in llm.report.sites] == [
        None, None, "layer 0 (scaled_dot_product_attention)", "layer 0 (scaled_dot_product_attention)",
        "layer 1 (scaled_dot_product_attention_1)"]
    assert len(llm.program.kv_cache_specs) == len(owners)
    assert llm.bytes_per_token == OWNED_BYTES
    # had each layer kept its own cache, of the spec of the cache it reads: 2.3x the bytes
    spec = dict(zip(caches[::2], llm.program.kv_cache_specs))
    assert sum(spec[r.args[1].target].bytes_per_token for r in reads) == UNSHARED_BYTES
    assert len(llm.llm_engine.runner.kv_caches) == 2 * len(owners)


def test_the_pool_and_the_planner_count_the_owned_caches_only(model, llm):
    """A budget of 12 blocks of the owned caches' bytes gives 12 blocks (5 at 1,792 bytes a token); the
    6-prompt batch preempts in it and each prompt still gets its tokens alone."""
    assert llm.plan_memory("64MiB").kv_bytes_per_token == OWNED_BYTES
    small = LLM(gemma4(), block_size=16, kv_cache_memory=12 * 16 * OWNED_BYTES, max_num_seqs=4,
                max_num_batched_tokens=48)
    stats = small.get_stats()
    assert (stats.kv_blocks_total, stats.kv_cache_bytes_per_block) == (12, 16 * OWNED_BYTES)
    reference = snapshot(model)
    outputs = small.generate(PROMPTS + PROMPTS[3:4], GREEDY, use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    for prompt, out in zip(PROMPTS + PROMPTS[3:4], outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6), f"prompt length {len(prompt)}"


def test_a_prefix_cache_hit_serves_the_sharing_layers_from_the_owners_blocks(model, llm):
    """A prompt sharing 40 tokens (two blocks) with one served before takes them from the prefix cache:
    the sharing layers read the owners' cached blocks, and the tokens are the unmodified model's."""
    llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)
    prompt = PROMPTS[3][:40] + random_prompts((9,), seed=5, vocab=V)[0]
    hits = llm.get_stats().prefix_cache_hits
    [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits - hits == 32
    assert out.outputs[0].token_ids == hf_greedy(snapshot(model), prompt, 6)


def test_a_sharing_layer_reads_its_owners_quantized_cache():
    """The owner writes the K/V a sharing layer would have written (the same values, the same rows'
    scales), so a quantized cache shared gives the tokens of each layer quantizing its own. (fp8 rows
    carry their scale the same way; int8 only, for the suite's time.)"""
    kw = dict(block_size=16, max_num_batched_tokens=96, kv_cache_dtype="int8")
    with every_layer_its_own_cache():
        unshared = LLM(gemma4(), **kw).generate(PROMPTS, GREEDY, use_tqdm=False)
    shared = LLM(gemma4(), **kw)
    assert len(shared.program.kv_cache_specs) == 2
    assert shared.bytes_per_token == 2 * 2 * (16 + 4) + 2 * 2 * (32 + 4)  # one byte a value, a 4-byte scale a row
    got = shared.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in unshared]


def test_the_pt2_file_records_the_owned_caches_and_serves_them(llm, tmp_path):
    """(A fresh process serving a .pt2, no transformers imported: tests/test_families.py.)"""
    path = llm.export(tmp_path / "gemma4.pt2")
    with zipfile.ZipFile(path) as archive:
        meta = json.loads(next(archive.read(n) for n in archive.namelist() if n.endswith("pagedpack.json")))
    assert len(meta["kv_cache_specs"]) == 2
    assert [n for n in meta["signature"] if "_cache_" in n] == ["key_cache_0", "value_cache_0", "key_cache_1",
                                                               "value_cache_1"]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    served = LLM(path, block_size=16, max_num_batched_tokens=96)
    assert len(served.program.kv_cache_specs) == 2
    assert [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def _mixed_step(specs, q_lens=(20, 9), *, block_size=16, num_blocks=8):
    """Fresh prefills of ``q_lens`` tokens (the caches empty), as step inputs: metadata and caches."""
    batch = example_metadata(list(q_lens), block_size=block_size, num_blocks=num_blocks)
    tokens = torch.randint(0, V, (sum(q_lens),), generator=torch.Generator().manual_seed(0))
    step = batch._replace(input_ids=tokens).as_inputs()
    caches = [torch.zeros(shape, dtype=spec.dtype) for spec in specs
              for shape in spec.cache_shapes(num_blocks, block_size)]
    return [step[name] for name in METADATA_INPUTS], caches


def test_onnx_sharing_layers_read_the_updated_caches(llm):
    """The functional graph the ONNX export translates: a sharing layer's read takes its owner's updated
    caches (reading the step's inputs would miss this step's keys), and gives the in-place graph's logits;
    com.microsoft.PagedAttention, which always writes, is refused naming the sharing sites."""
    gm = llm.rewritten.graph_module
    functional = functionalize_caches(gm)
    reads = [n for n in functional.graph.nodes if n.target is ops.paged_attention.default]
    assert len(reads) == 3 and all(r.args[1].op == "call_function" for r in reads)
    metadata, caches = _mixed_step(llm.rewritten.kv_cache_specs)
    with torch.no_grad():
        logits, *updated = functional(*metadata, *caches)
        in_place = gm(*metadata, *caches)
    torch.testing.assert_close(logits, in_place, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(updated, caches))
    refused = unsupported_params(gm, "com.microsoft")
    assert len(refused) == 3 and all("KV sharing" in line for line in refused), refused
    assert [line.split(" (")[0] for line in refused] == [f"attention site {i}" for i in (2, 3, 4)]


def test_tensor_parallel_shards_the_owners_heads_and_each_sharing_layers_queries(model, llm):
    rewritten = llm.rewritten
    check_shards(rewritten.graph_module, rewritten.kv_cache_specs, model, tp_size=2)  # the logits: ValueError
    _, specs = shard_step_graph(rewritten.graph_module, rewritten.kv_cache_specs, model, tp_size=2, rank=1,
                                group_name="check")
    assert [(s.num_kv_heads, s.key_head_size) for s in specs] == [(1, 16), (1, 32)]


def test_the_ascend_lowering_passes_the_owners_cache_to_the_sharing_layers_attention():
    """Emulated FIA (bf16, head_dim 128, block 128): each sharing layer's fused attention reads its owner's
    caches, and a step with a 150-token prefill (past the window and a block) beside a 20-token one gives
    logits within the reference graph's own error against float64."""
    rewritten = rewrite(capture(gemma4(torch.bfloat16, head_dim=128, global_head_dim=128)))
    gm = rewritten.graph_module
    metadata, caches = _mixed_step(rewritten.kv_cache_specs, (150, 20), block_size=128, num_blocks=4)
    lowered = copy.deepcopy(gm)
    lower_to_ascend(lowered, [*metadata, *caches], ops=emulated_ops(), bounds=StepBounds(8192, 64))
    fia_keys = [n.args[1].args[0].target for n in lowered.graph.nodes
                if n.op == "call_function" and "fused_infer_attention_score" in str(n.target)]
    assert fia_keys == ["key_cache_0", "key_cache_1", "key_cache_0", "key_cache_0", "key_cache_1"]
    with torch.no_grad():
        got = lowered(*metadata, *[c.clone() for c in caches])
        own = gm(*metadata, *[c.clone() for c in caches])
        exact = float64_copy(gm)(*float64_inputs(metadata), *[c.double() for c in caches])
    assert_within_own_error(got, own, exact)
