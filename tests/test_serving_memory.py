"""What an ``LLM`` holds while it serves: a program of the target's own keeps its weights once;
the ``transformers`` model and the rewritten graph are let go (and loaded / captured again on
use) unless ``keep_source_model=True``; a checkpoint ``transformers`` memory-mapped is unmapped."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.fx

from pagedpack import LLM, SamplingParams
from pagedpack.compiler.planner import resident_weight_bytes
from pagedpack.models.tiny import tiny_model
from pagedpack.passes.graph_attrs import drop_unused_attrs, own_attrs

from conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5]]


def mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(folder)  # model.safetensors
    return folder


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the CPU lowering packs with oneDNN")
def test_serving_from_a_checkpoint_unmaps_it_and_holds_each_weight_once(checkpoint, tmp_path, monkeypatch):
    # The full collection that lets the checkpoint's mapping go runs after building a model of
    # SMALL_MODEL_BYTES or more (runtime/memory.py); this tiny checkpoint stands in for one.
    monkeypatch.setattr("pagedpack.runtime.memory.SMALL_MODEL_BYTES", 0)
    kept = LLM(str(checkpoint), num_blocks=32, keep_source_model=True)
    assert str(checkpoint / "model.safetensors") in mapped_files()  # what transformers does
    expected = [o.outputs[0].token_ids for o in kept.generate(PROMPTS, GREEDY, use_tqdm=False)]
    report = kept.report.format().splitlines()[0]
    exported = kept.export(tmp_path / "step.pt2")
    del kept

    llm = LLM(str(checkpoint), num_blocks=32)
    assert str(checkpoint / "model.safetensors") not in mapped_files()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert llm.report.format().splitlines()[0] == report
    # each weight once: the linears as their (merged) prepacked copies, the others as copies of their own
    model = llm.model  # loaded again: the checkpoint is mapped again
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())  # rotary inv_freq, if kept
    assert params <= resident_weight_bytes(llm.program.run) <= params + buffers
    assert llm.plan_memory("64MiB").weight_bytes == resident_weight_bytes(llm.program.run)
    # its .pt2 served: the same lowering, the loaded program's plain linear weights let go
    served = LLM.from_exported(exported, num_blocks=32)
    assert served.program.note == f"loaded from {exported}; {llm.report.notes[-1]}"  # "cpu lowering: ..."
    assert params <= resident_weight_bytes(served.program.run) <= params + buffers
    assert [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_a_callers_module_stays_theirs_and_later_edits_of_it_are_not_served():
    module = tiny_model("llama", num_hidden_layers=2)
    llm = LLM(module, num_blocks=32)
    assert llm.model is module
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with torch.no_grad():  # from an adversarial trial: the embedding was shared, the linears not
        for param in module.parameters():
            param.mul_(1.5)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_loading_again_refuses_a_changed_or_missing_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_model("llama", num_hidden_layers=2).save_pretrained(tmp_path / "ck")
    llm = LLM("ck", num_blocks=32)  # a relative path, then another working directory
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    (tmp_path / "elsewhere" / "ck").mkdir(parents=True)
    tiny_model("llama", num_hidden_layers=2, seed=1).save_pretrained(tmp_path / "elsewhere" / "ck")
    monkeypatch.chdir(tmp_path / "elsewhere")
    served = LLM.from_exported(llm.export(tmp_path / "x.pt2"), num_blocks=32)
    assert [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    tiny_model("llama", num_hidden_layers=2, seed=1).save_pretrained(tmp_path / "ck")  # overwritten
    message = "let its source model go once lowered and cannot load 'ck' again .* keep_source_model=True"
    with pytest.raises(ValueError, match=message):
        llm.export(tmp_path / "y.pt2")
    shutil.rmtree(tmp_path / "ck")
    with pytest.raises(ValueError, match=message):
        llm.model
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


@pytest.fixture(scope="module")
def kept():
    """``LLM("tiny")`` with its source kept, for the tests that read it (its model, rewritten graph, export)."""
    return LLM("tiny", num_blocks=32, keep_source_model=True)


def test_a_served_file_is_still_served_once_deleted(kept, tmp_path):
    expected = [hf_greedy(kept.model, p, GREEDY.max_tokens) for p in PROMPTS]
    path = kept.export(tmp_path / "x.pt2")
    served = LLM.from_exported(path, num_blocks=32)
    os.remove(path)
    assert served.model is None and served.rewritten is None and served.report is None
    with pytest.raises(ValueError, match="served from an exported file"):
        served.export(tmp_path / "y.pt2")
    with pytest.raises(ValueError, match="served from an exported file"):
        served.plan_memory("64MiB")
    assert [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_the_plan_counts_the_weights_serving_holds(kept, tmp_path):
    budget = "64MiB"  # the activation peak derived before lowering (llm below) or from the kept graph: no capture again
    rewritten = resident_weight_bytes(kept.rewritten.graph_module)
    held = resident_weight_bytes(kept.program.run, kept.rewritten.graph_module, kept.model)
    assert kept.plan_memory(budget).weight_bytes == held > resident_weight_bytes(kept.program.run)
    # what `pagedpack plan` shows (it keeps them, to plan without capturing again): serving as `generate` does
    assert kept.plan_memory(budget, keep_source_model=False).weight_bytes == resident_weight_bytes(kept.program.run)
    with pytest.raises(ValueError, match="keep_source_model: expected a bool or None, got 'no'"):
        kept.plan_memory(budget, keep_source_model="no")
    llm = LLM("tiny", memory_budget=budget)
    assert llm.plan_memory(budget).weight_bytes == resident_weight_bytes(llm.program.run)
    assert llm.plan_memory(budget, keep_source_model=True).weight_bytes == held
    llm.export(tmp_path / "x.pt2")  # captures again without keeping what it captures
    assert llm._builder.rewritten_step is None and llm._builder.source_model is None
    # the rewritten model is captured again on use, then kept (was a test of its own, with an LLM of its own)
    again = llm.rewritten
    assert again is llm.rewritten and again.graph_module is not llm.program.run
    assert again.report.format().splitlines()[0] == llm.report.format().splitlines()[0]
    onnx = LLM("tiny", memory_budget=budget, target="onnx")  # onnxruntime's session: the rewritten graph's copy
    assert onnx.plan_memory(budget).weight_bytes == rewritten > 0


def test_memory_budget_on_a_target_that_lowers_in_place():
    """From an adversarial trial: the plan's shape propagation ran on the ascend-lowered graph and failed."""
    llm = LLM("tiny", target="ascend", memory_budget="64MiB")
    assert llm.num_blocks == llm.plan_memory("64MiB").num_blocks > 0


def test_keep_source_model_keeps_them(kept):
    assert kept.rewritten is kept.rewritten and kept.model is kept.model
    with pytest.raises(ValueError, match="keep_source_model: expected a bool, got 'yes'"):
        LLM("tiny", keep_source_model="yes")


def _module_with_attrs() -> torch.fx.GraphModule:
    root = torch.nn.Module()
    root.register_parameter("w", torch.nn.Parameter(torch.arange(6.0).reshape(2, 3), requires_grad=False))
    root.register_buffer("b", torch.ones(3))
    root.register_buffer("unused", torch.zeros(4))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w, b = graph.get_attr("w"), graph.get_attr("b")
    graph.output(graph.call_function(torch.add, (graph.call_function(torch.matmul, (x, w)), b)))
    gm = torch.fx.GraphModule(root, graph)
    gm.register_buffer("unused", root.unused)  # GraphModule copies only what get_attr reads
    gm.w_again = gm.w  # the same tensor under a second name (tied weights)
    return gm


def test_drop_unused_attrs_keeps_what_called_modules_own():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    assert drop_unused_attrs(gm) == 0 and gm(torch.ones(1, 3)).shape == (1, 2)


def test_drop_unused_attrs_deletes_what_no_node_reads():
    gm = _module_with_attrs()
    gm.graph.get_attr("w_again")  # read by a get_attr node: stays, even with no users
    assert drop_unused_attrs(gm) == 1
    assert not hasattr(gm, "unused") and hasattr(gm, "w") and hasattr(gm, "b")


def test_own_attrs_copies_each_tensor_once_keeping_its_kind():
    gm = _module_with_attrs()
    gm.graph.get_attr("w_again")
    before = {name: getattr(gm, name) for name in ("w", "w_again", "b")}
    own_attrs(gm)
    assert isinstance(gm.w, torch.nn.Parameter) and "b" in dict(gm.named_buffers())
    assert gm.w is gm.w_again  # one copy for the tied pair
    for name, old in before.items():
        new = getattr(gm, name)
        assert torch.equal(new, old) and new.data_ptr() != old.data_ptr()
    x = torch.randn(2, 2)
    assert torch.equal(gm(x), x @ before["w"] + before["b"])


@pytest.mark.parametrize("preset", [None, "1024"])
def test_onednn_primitive_caches_are_capped_unless_the_environment_says(preset):
    """oneDNN keeps a primitive per step size in two process-wide caches (1024 each by default): a
    server whose steps come in many sizes grew without bound until pagedpack capped them."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if preset:
        env["LRU_CACHE_CAPACITY"] = preset
    code = ("import os, pagedpack, pagedpack.lowering.reference.cpu_linear as c; e = os.environ;"
            "print(e['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], e['LRU_CACHE_CAPACITY'], c.ONEDNN_CACHE_CAPACITY)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    out = done.stdout.split()
    assert out == ["64", preset or "64", "64"]


def test_the_runner_trims_the_heap_after_long_steps_only(monkeypatch):
    """The heap pages long steps' activations freed go back to the OS before decode steps scatter
    small allocations over them (``ModelRunner``): once, before the first short step after them;
    long steps in a row reuse each other's pages, and decode steps after it do not pay for a trim."""
    from pagedpack.runtime import model_runner

    llm = LLM("tiny", num_blocks=64, max_num_batched_tokens=model_runner.TRIM_AFTER_TOKENS)
    trims, steps = [], []
    monkeypatch.setattr(model_runner, "trim_heap", lambda: trims.append(len(steps)))
    run = llm.llm_engine.runner.execute
    monkeypatch.setattr(llm.llm_engine.runner, "execute",
                        lambda batch, *a, **k: steps.append(batch.num_tokens) or run(batch, *a, **k))
    long_prompt = [7] * (2 * model_runner.TRIM_AFTER_TOKENS)
    llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # 2 + 3 steps
    assert steps == [model_runner.TRIM_AFTER_TOKENS] * 2 + [1] * 3
    assert trims == [3]  # while the first decode step starts
    llm.generate([[7] * 10], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(trims) == 1


def test_a_server_commits_its_kv_pool_at_start():
    """``pagedpack serve`` makes the pool resident before the first request (RSS no longer grows as
    blocks are first written; a pool the machine cannot hold fails at start): after
    ``commit_kv_memory`` every cache's pages count in the resident size of the mapping holding it."""
    llm = LLM("tiny", kv_cache_memory="64MiB")
    runner = llm.llm_engine.runner
    runner.commit_kv_memory()
    for cache in runner.kv_caches:
        size = cache.numel() * cache.element_size()
        assert _resident_bytes(cache.data_ptr(), size) >= 0.9 * size
    assert all(not cache.any() for cache in runner.kv_caches)


def _resident_bytes(address: int, size: int) -> int:
    """``Rss`` summed over the ``/proc/self/smaps`` mappings that overlap ``[address, address + size)``
    (numpy's huge-page advice splits one allocation into several)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start < address + size and address < end
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total
