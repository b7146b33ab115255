"""The symbolic memory planner: the activation peak read off the graph against the peak
``torch.profiler`` measures, the plan's arithmetic, and ``LLM(memory_budget=...)``."""
import math
from types import SimpleNamespace

import pytest
import sympy
import torch

from pagedpack import LLM, SamplingParams
from pagedpack.compiler.planner import (
    DEFAULT_KV_CACHE_LIMIT,
    DEFAULT_KV_CACHE_MEMORY,
    plan_memory,
    pool_notice,
    pool_num_blocks,
)
from pagedpack.models.tiny import tiny_model
from pagedpack.passes.activation_memory import ActivationPeak, B, T, activation_peak
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import example_metadata

from conftest import profiled_peak_bytes


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_blocks=64)


def measured_step_peak(llm, q_lens, program=None) -> int:
    """Peak bytes of one step of ``q_lens`` through ``program`` with the runner's caches (default:
    the program the runner serves)."""
    runner = llm.llm_engine.runner
    batch = example_metadata(q_lens, block_size=runner.block_size, num_blocks=runner.num_blocks)
    inputs = batch.as_inputs()

    def step():
        if program is None:
            return runner.execute(batch)
        with torch.inference_mode():
            return program(*(inputs[name] for name in METADATA_INPUTS), *runner.kv_caches)

    step()  # warm up: first-call allocations are not the step's
    return profiled_peak_bytes(step)


def check_peak_matches_profiler(llm, token_counts=(64, 512, 2048), seq_counts=(1, 8)):
    """The symbolic peak within 25 % of the measured one of the rewritten graph (what it models)
    for T in ``token_counts`` and B in ``seq_counts``, and at least the served program's (the CPU
    lowering's row-chunked MLPs hold less); returns the ratios."""
    peak = activation_peak(llm.rewritten.graph_module, llm.rewritten.kv_cache_specs)
    assert peak.expr.free_symbols <= {T, B}
    ratios = []
    for tokens in token_counts:
        for seqs in seq_counts:
            measured = measured_step_peak(llm, [tokens // seqs] * seqs, llm.rewritten.graph_module)
            served = measured_step_peak(llm, [tokens // seqs] * seqs)
            assert served <= 1.25 * peak.bytes(tokens, seqs), (tokens, seqs, peak.bytes(tokens, seqs), served)
            ratio = peak.bytes(tokens, seqs) / measured
            assert 0.75 <= ratio <= 1.25, (tokens, seqs, peak.bytes(tokens, seqs), measured)
            ratios.append(ratio)
    return ratios


def test_symbolic_activation_peak_matches_the_profiler(llm):
    check_peak_matches_profiler(llm)


def test_the_peak_leaves_the_graph_as_it_was(llm):
    """From an adversarial trial: the propagation's example values (block size 16) stayed in
    node.meta["val"], where the ascend lowering read them."""
    graph = llm.rewritten.graph_module.graph
    before = {node: node.meta.get("val") for node in graph.nodes}
    activation_peak(llm.rewritten.graph_module, llm.rewritten.kv_cache_specs)
    assert all(node.meta.get("val") is value for node, value in before.items())


def test_the_plan_adds_up(llm):
    plan = llm.plan_memory("64MiB")
    per_block = llm.bytes_per_token * llm.block_size
    assert plan.memory == 64 * 2**20 and plan.kv_bytes_per_token == llm.bytes_per_token
    assert plan.activation_bytes == plan.peak.bytes(2048, 256)
    assert plan.num_blocks == (plan.memory - plan.weight_bytes - plan.activation_bytes) // per_block
    assert plan.concurrent_seqs == plan.num_blocks // math.ceil(llm.max_model_len / llm.block_size)
    one_sequence = math.ceil(llm.max_model_len / llm.block_size) * per_block

    def fits(tokens):
        return plan.weight_bytes + plan.peak.bytes(tokens, min(tokens, 256)) + one_sequence <= plan.memory

    assert fits(plan.largest_batched_tokens) and not fits(plan.largest_batched_tokens + 1)
    # weights as serving holds them: the CPU lowering's program alone, every parameter once (the
    # linears as their merged, prepacked oneDNN copies), and the buffers (rotary inv_freq)
    params = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in llm.model.buffers())
    assert params <= plan.weight_bytes <= params + buffers
    rows = dict(plan.rows())
    assert rows["activation peak(T, B)"] == str(plan.peak.expr) and "blocks" in rows["KV pool"]
    assert isinstance(plan.peak.expr, (sympy.Max, sympy.Expr))


def test_memory_budget_sizes_the_pool(llm):
    sized = LLM("tiny", memory_budget="64MiB")
    assert sized.num_blocks == llm.plan_memory("64MiB").num_blocks > 0
    with pytest.raises(ValueError, match="memory_budget: .* leave no room for a block of the KV pool"):
        LLM("tiny", memory_budget="3MiB")
    with pytest.raises(ValueError, match="expected at most one of them, got num_blocks, memory_budget"):
        LLM("tiny", num_blocks=8, memory_budget="1GiB")
    with pytest.raises(ValueError, match="memory_budget: expected a positive number of bytes"):
        LLM("tiny", memory_budget="lots")


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory_budget=10**400), "memory_budget: a KV pool of .* is more than this machine's memory"),
    (dict(memory_budget="1e300"), "memory_budget: a KV pool of .* is more than this machine's memory"),
    (dict(kv_cache_memory=2**70), "kv_cache_memory: a KV pool of .* is more than this machine's memory"),
    (dict(num_blocks=2**40), "num_blocks: a KV pool of .* is more than this machine's memory"),
    (dict(memory_budget="nan"), "memory_budget: expected a positive number of bytes"),
    (dict(memory_budget="-1GiB"), "memory_budget: expected a positive number of bytes"),
])
def test_pools_beyond_the_machine_are_refused_naming_the_argument(kwargs, message):
    """From an adversarial trial: these failed inside numpy (dimension / MemoryError) or math."""
    with pytest.raises(ValueError, match=message):
        LLM("tiny", **kwargs)


def test_the_planner_says_when_its_search_stopped(llm):
    plan = llm.plan_memory("1e300")
    assert plan.largest_batched_tokens == 2**24 and dict(plan.rows())["largest max_num_batched_tokens"].startswith(
        "at least 16777216")


# ---------------------------------------------------------------- the default KV pool


def pool_args(**kw):
    """What ``pool_num_blocks`` reads of an ``EngineArgs``."""
    given = dict(block_size=16, num_blocks=None, kv_cache_memory=None, memory_budget=None, max_num_seqs=256,
                 device="cpu")
    return SimpleNamespace(**{**given, **kw})


def default_blocks(bytes_per_token, max_model_len, **kw):
    return pool_num_blocks(pool_args(**kw), bytes_per_token=bytes_per_token, max_model_len=max_model_len, plan=None)


def test_the_default_pool_holds_one_full_context_request():
    """Issue 53: the 256 MiB default held 5,824 of SmolLM2-135M's 8,192 tokens (fp32 KV: 30 layers x
    3 KV heads x 64 x 2 x 4 bytes = 46,080 bytes a token); it now holds the whole context, in whole
    blocks, and stays 256 MiB where that is more."""
    assert DEFAULT_KV_CACHE_MEMORY // (46080 * 16) * 16 == 5824  # before
    assert default_blocks(46080, 8192) * 16 == 8192
    assert default_blocks(46080, 8190) == 512  # rounded up to whole blocks
    assert default_blocks(46080 // 2, 8192) == DEFAULT_KV_CACHE_MEMORY // (23040 * 16)  # bf16: 256 MiB hold more
    assert default_blocks(46080, 8192, block_size=64) * 64 == 8192
    assert default_blocks(46080, 8192, max_num_seqs=1) == 512  # never more than max_num_seqs full requests
    assert default_blocks(512, 512, max_num_seqs=2) == 64


def test_the_default_pool_stops_at_its_limit_and_says_what_the_context_needs(monkeypatch):
    """A 128k context (Llama-3.2-1B's shape in fp32: 16 x 8 x 64 x 2 x 4 = 65,536 bytes a token, 8 GiB
    for one request) gets the 4 GiB limit, on a small machine half its memory, not many GiB unasked;
    the notice names the limit and the size the whole context needs."""
    from pagedpack.runtime import memory

    monkeypatch.setattr(memory, "physical_memory", lambda: 64 << 30)
    blocks = default_blocks(65536, 131072)
    assert blocks * 16 * 65536 == DEFAULT_KV_CACHE_LIMIT
    notice = pool_notice(pool_args(), num_blocks=blocks, bytes_per_token=65536, max_model_len=131072)
    assert notice.startswith("the KV pool holds 65536 tokens (the default pool: 4096 blocks of 16 tokens, "
                             "4,096.0 MiB, its limit (at most 4,096.0 MiB")
    assert "(131072 tokens need 8192 blocks, 8,192.0 MiB)" in notice and "--kv-cache-memory 8192MiB" in notice
    assert "--num-blocks 8192" in notice and "--max-model-len 65536" in notice
    monkeypatch.setattr(memory, "physical_memory", lambda: 2 << 30)
    assert default_blocks(65536, 131072) * 16 * 65536 == 1 << 30
    monkeypatch.setattr(memory, "physical_memory", lambda: 256 << 20)
    assert default_blocks(65536, 131072) * 16 * 65536 == DEFAULT_KV_CACHE_MEMORY  # as before on any machine


def test_a_model_s_default_pool_holds_its_context_and_an_explicit_pool_is_kept():
    """A tiny Llama whose 131,072-token context takes 512 MiB of KV (4,096 bytes a token): the default
    pool holds one request of it (allocated, not resident: nothing is written); an explicit
    ``kv_cache_memory`` below that is kept as given, a request beyond it refused as before, and the
    server's notice names the option and the numbers."""
    model = tiny_model("llama", head_dim=128, max_position_embeddings=1 << 17)
    llm = LLM(model)
    assert llm.bytes_per_token == 4096 and llm.max_model_len == 1 << 17
    assert llm.num_blocks * llm.block_size == llm.max_model_len and llm.num_blocks * llm.block_size * 4096 > (
        DEFAULT_KV_CACHE_MEMORY)
    assert pool_notice(llm.engine_args, num_blocks=llm.num_blocks, bytes_per_token=4096,
                       max_model_len=llm.max_model_len) is None

    small = LLM(model, kv_cache_memory="64MiB")
    assert small.num_blocks == (64 << 20) // (4096 * small.block_size) and small.max_model_len == 1 << 17
    (out,) = small.generate([[1, 2, 3]], SamplingParams(max_tokens=20000), use_tqdm=False)
    assert f"more than the whole pool of num_blocks={small.num_blocks}" in out.error
    notice = pool_notice(small.engine_args, num_blocks=small.num_blocks, bytes_per_token=4096,
                         max_model_len=small.max_model_len)
    assert notice == ("the KV pool holds 16384 tokens (--kv-cache-memory 67108864 bytes: 1024 blocks of 16 tokens, "
                      "64.0 MiB), fewer than one request of the model's context (131072 tokens need 8192 blocks, "
                      "512.0 MiB): requests get up to 16384 tokens. For the whole context: --kv-cache-memory 512MiB "
                      "(or --num-blocks 8192); or --max-model-len 16384 to ask for no more")


def test_a_model_with_recurrent_state_is_planned_with_a_slot_per_sequence_and_no_kv_is_not_divided_by():
    """A state-space model has no KV (0 bytes a token: the default pool divided by it) and holds a state
    slot for each of ``max_num_seqs``: the plan charges those slots, and its blocks are bookkeeping."""
    peak = ActivationPeak(1000 * T + 10 * B, [])
    sizes = dict(memory=1 << 20, block_size=16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=100,
                 weight_bytes=200_000)
    stateless = plan_memory(peak, bytes_per_token=64, **sizes)
    hybrid = plan_memory(peak, bytes_per_token=64, state_bytes_per_seq=4096, **sizes)
    assert stateless.num_blocks - hybrid.num_blocks == 4 * 4096 // (64 * 16)
    assert stateless.concurrent_seqs > 4 and hybrid.concurrent_seqs == 4  # a state slot each
    assert dict(hybrid.rows())["recurrent state"].startswith("4096 bytes per sequence, a slot for each of "
                                                             "max_num_seqs = 4")
    ssm = plan_memory(peak, bytes_per_token=0, state_bytes_per_seq=4096, **sizes)
    assert ssm.num_blocks == 4 * 7  # 4 requests of 100 tokens in blocks of 16
    assert plan_memory(peak, bytes_per_token=0, state_bytes_per_seq=1 << 20, **sizes).num_blocks == 0  # no room
    assert default_blocks(0, 100, max_num_seqs=4) == default_blocks(0, 100, max_num_seqs=4, kv_cache_memory=1) == 28
