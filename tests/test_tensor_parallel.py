"""The tensor-parallel pass (``passes/tensor_parallel.py``): each rank's shard of the step graph.

In this process the ranks' graphs run in lockstep (the all-reduce sums their values) against the
unsharded step graph and a float64 run of it; ``test_ranks_on_gloo`` runs them in real
``torch.distributed`` processes.
"""
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedpack import LLM
from pagedpack.contract import METADATA_INPUTS, bytes_per_token
from pagedpack.metadata import example_metadata
from pagedpack.models.tiny import tiny_model
from pagedpack.passes.tensor_parallel import HeadSplit, check_shards, count_all_reduces, shard_step_graph

from test_families import SERVED, family_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def rewritten(request):
    llm = LLM(tiny_model(request.param), keep_source_model=True)  # 4 heads, 2 KV heads, 2 layers
    return llm.rewritten, llm.model


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_shards_compute_the_unsharded_logits(rewritten, tp_size):
    """tp 4 > 2 KV heads: each KV head is replicated on two ranks."""
    step, model = rewritten
    check_shards(step.graph_module, step.kv_cache_specs, model, tp_size=tp_size)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_holds_its_heads_and_two_all_reduces_per_layer(rewritten, tp_size):
    step, model = rewritten
    full = bytes_per_token(step.kv_cache_specs)
    for rank in range(tp_size):
        gm, specs = shard_step_graph(step.graph_module, step.kv_cache_specs, model, tp_size=tp_size, rank=rank,
                                     group_name="0")
        assert count_all_reduces(gm) == 2 * len(specs)
        assert [s.num_kv_heads for s in specs] == [max(1, 2 // tp_size)] * len(specs)
        assert bytes_per_token(specs) == full * max(1, 2 // tp_size) // 2  # replicated heads counted
        if tp_size == 2:  # every projection's weight halved
            assert linear_weights(gm) * 2 == linear_weights(step.graph_module)


def linear_weights(gm) -> int:
    """Elements of the weights the graph's linears read (each tensor once)."""
    attrs = {n.args[1].target for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default}
    return sum(gm.get_parameter(a).numel() if a in dict(gm.named_parameters()) else gm.get_buffer(a).numel()
               for a in attrs if "layers" in a)


def test_kv_heads_are_the_ones_the_query_heads_read():
    """GQA groups stay whole: query head h reads KV head h // (H / Hkv) on every rank."""
    for h, kv, tp in [(4, 2, 2), (4, 2, 4), (8, 2, 8), (12, 4, 2), (9, 3, 3), (4, 4, 4)]:
        split = HeadSplit(h, kv, tp)
        for rank in range(tp):
            read = {q // (h // kv) for q in split.query_heads(rank)}
            assert read <= set(split.kv_heads(rank)), (h, kv, tp, rank)
            assert len(split.kv_heads(rank)) == split.local_kv_heads


@pytest.mark.parametrize(("heads", "message"), [
    ((9, 3, 2), r"9 query heads \(3 KV heads\) do not split over 2 ranks"),  # SmolLM2-135M
    ((12, 3, 2), r"3 KV heads neither split over 2 ranks nor replicate evenly"),
    ((12, 4, 6), r"4 KV heads neither split over 6 ranks"),
])
def test_heads_that_do_not_split_are_refused_with_the_numbers(heads, message):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size: .*{message}"):
        HeadSplit(*heads)


@pytest.mark.parametrize(("family", "message"), [
    ("mixtral", r"model.layers.0.mlp.experts .* Mixture-of-Experts"),
    ("gpt2", r"GPT2LMHeadModel has no tensor-parallel plan"),
    ("cohere", r"the shards do not run"),  # per-head q/k LayerNorm weights the plan leaves whole
])
def test_models_the_plan_cannot_split_are_refused_by_name(family, message):
    llm = LLM(family_model(SERVED, family, "sdpa"), block_size=16, num_blocks=16, keep_source_model=True)
    step = llm.rewritten
    with pytest.raises(ValueError, match=rf"tensor_parallel_size: .*{message}"):
        check_shards(step.graph_module, step.kv_cache_specs, llm.model, tp_size=2)


# ---------------------------------------------------------------- real processes


def _steps(vocab: int) -> list:
    """A prefill of three sequences (5, 9, 1 tokens), then a step decoding them beside a new one."""
    g = torch.Generator().manual_seed(1)
    steps = [example_metadata([5, 9, 1], block_size=4, num_blocks=16),
             example_metadata([1, 1, 1, 3], [5, 9, 1, 0], block_size=4, num_blocks=16)]
    return [s._replace(input_ids=torch.randint(0, vocab, (s.num_tokens,), generator=g)) for s in steps]


def _rank(rank: int, tp_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp_size)
    try:
        llm = LLM(tiny_model("qwen2"), keep_source_model=True)
        step = llm.rewritten
        gm, specs = shard_step_graph(step.graph_module, step.kv_cache_specs, llm.model, tp_size=tp_size, rank=rank,
                                     group_name=dist.group.WORLD.group_name)
        full, local = ([torch.zeros(shape, dtype=s.dtype) for s in layer_specs for shape in s.cache_shapes(16, 4)]
                       for layer_specs in (step.kv_cache_specs, specs))
        result = []
        with torch.no_grad():
            for batch in _steps(llm.vocab_size):
                inputs = [batch.as_inputs()[name] for name in METADATA_INPUTS]
                want, got = step.graph_module(*inputs, *full), gm(*inputs, *local)
                result.append({"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                               "argmax_equal": torch.equal(got.argmax(-1), want.argmax(-1))})
        with open(f"{out}.{rank}", "w") as file:
            json.dump(result, file)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_on_gloo(tmp_path):
    """Two processes, gloo, the all-reduce in the graph: each step's logits are the unsharded graph's."""
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(2, _free_port(), out), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out}.{rank}") as file:
            steps = json.load(file)
        assert len(steps) == 2
        for step in steps:
            assert step["argmax_equal"] and step["max_diff"] <= 1e-5 * (1 + step["scale"]), step
