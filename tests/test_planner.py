"""The symbolic memory planner: the activation peak read off the graph against the peak
``torch.profiler`` measures, the plan's arithmetic, and ``LLM(memory_budget=...)``."""
import math

import pytest
import sympy
import torch

from pagedpack import LLM
from pagedpack.contract import METADATA_INPUTS
from pagedpack.metadata import example_metadata
from pagedpack.passes.activation_memory import B, T, activation_peak

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


def check_peak_matches_profiler(llm, token_counts=(64, 512, 2048)):
    """The symbolic peak within 25 % of the measured one of the rewritten graph (what it models)
    for T in ``token_counts``, one sequence and eight, and at least the served program's (the CPU
    lowering's row-chunked MLPs hold less); returns the ratios."""
    peak = activation_peak(llm.rewritten.graph_module, llm.rewritten.kv_cache_specs)
    assert peak.expr.free_symbols <= {T, B}
    ratios = []
    for tokens in token_counts:
        for seqs in (1, 8):
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
    with pytest.raises(ValueError, match="memory_budget: .* leave no room for the KV pool"):
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
