"""The tensor-parallel pass (``passes/tensor_parallel.py``): each rank's shard of the step graph.

In this process the ranks' graphs run in lockstep (the all-reduce sums their values) against the
unsharded step graph and a float64 run of it; ``LLM(..., tensor_parallel_size=2)`` runs them in
real ``torch.distributed`` processes (gloo) against one rank's tokens.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from pagedpack import LLM, AsyncLLM, EngineArgs, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.passes.tensor_parallel import (
    HeadSplit,
    check_shards,
    count_all_gathers,
    count_all_reduces,
    shard_step_graph,
)
from pagedpack.runtime import rank_channel, tensor_parallel
from pagedpack.runtime.engine_loop import EngineDeadError
from pagedpack.step.contract import bytes_per_token

from conftest import random_prompts
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
    """And the vocabulary-parallel embedding's all-reduce and LM head's all-gather, each rank holding
    its rows of both (the plan's embedding_rowwise / colwise_gather_output)."""
    step, model = rewritten
    full = bytes_per_token(step.kv_cache_specs)
    vocab_rows = {n.target: -(-model.config.vocab_size // tp_size) for n in step.graph_module.graph.nodes
                  if n.op == "get_attr" and ("embed_tokens" in n.target or "lm_head" in n.target)}
    assert len(vocab_rows) == 2  # untied: the embedding's and the LM head's
    for rank in range(tp_size):
        gm, specs = shard_step_graph(step.graph_module, step.kv_cache_specs, model, tp_size=tp_size, rank=rank,
                                     group_name="0")
        assert count_all_reduces(gm) == 2 * len(specs) + 1 and count_all_gathers(gm) == 1
        assert {name: _tensor(gm, name).shape[0] for name in vocab_rows} == vocab_rows
        assert [s.num_kv_heads for s in specs] == [max(1, 2 // tp_size)] * len(specs)
        assert bytes_per_token(specs) == full * max(1, 2 // tp_size) // 2  # replicated heads counted
        if tp_size == 2:  # every projection's weight halved
            assert linear_weights(gm) * 2 == linear_weights(step.graph_module)


def test_a_tied_embedding_and_lm_head_share_one_padded_slice_per_rank():
    """258 rows over 4 ranks: 65 each, the last 3 zero rows past the vocabulary, cut off the logits."""
    llm = LLM(tiny_model("llama", tie_word_embeddings=True), keep_source_model=True)
    step = llm.rewritten
    check_shards(step.graph_module, step.kv_cache_specs, llm.model, tp_size=4)
    gm, _ = shard_step_graph(step.graph_module, step.kv_cache_specs, llm.model, tp_size=4, rank=3, group_name="0")
    vocab = {name: tuple(t.shape) for name, t in [*gm.named_parameters(), *gm.named_buffers()]
             if "embed" in name or "lm_head" in name}
    assert vocab == {"model.lm_head.weight": (65, 64)}  # the one tensor both read
    assert not _tensor(gm, "model.lm_head.weight")[258 - 3 * 65:].any()


def _tensor(gm, name: str) -> torch.Tensor:
    return gm.get_parameter(name) if name in dict(gm.named_parameters()) else gm.get_buffer(name)


def linear_weights(gm) -> int:
    """Elements of the weights the graph's linears read (each tensor once)."""
    attrs = {n.args[1].target for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default}
    return sum(_tensor(gm, a).numel() for a in attrs if "layers" in a)


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


# ---------------------------------------------------------------- LLM(..., tensor_parallel_size=2)

SERVING = dict(block_size=16, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=8)  # chunked, preempting
SHARED = [7] * 40  # a prefix some prompts share: prefix-cache hits


def _requests():
    prompts = [SHARED + p for p in random_prompts((1, 9, 30), seed=2)] + random_prompts((5, 17, 100), seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    return prompts, [greedy] * 5 + [SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=16)]


def test_four_ranks_replicate_the_two_kv_heads():
    """tp 4 > 2 KV heads: each rank holds the KV head its query head reads (KV bytes per rank: half of one
    rank's). Before ``tp2`` starts: one tensor-parallel LLM per process at a time."""
    prompts = random_prompts((3, 20, 40), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    one = LLM(tiny_model("llama"), block_size=16)
    llm = LLM(tiny_model("llama"), block_size=16, tensor_parallel_size=4)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
            o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        assert llm.bytes_per_token * 2 == one.bytes_per_token
    finally:
        llm.ranks.workers.close()


def test_an_idle_engine_outlives_the_collective_timeout_and_reports_a_dead_worker(monkeypatch):
    """Workers wait for rank 0's next command without a deadline (only collectives time out, here
    after 10 s: a loaded 2-core machine has run a collective past 5 s); a worker that dies while the engine
    is idle fails its health check."""
    monkeypatch.setattr(tensor_parallel, "TIMEOUT_S", 10.0)  # the group's join still waits JOIN_TIMEOUT_S
    llm = LLM(tiny_model("qwen2"), block_size=16, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        time.sleep(11)
        assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids == first
        llm.ranks.workers.ranks[0].process.kill()
        llm.ranks.workers.ranks[0].process.wait(5)
        with pytest.raises(EngineDeadError, match=r"pagedpack-tp-rank1 \(pid \d+\) exited with code -9"):
            llm.llm_engine.check_health()
    finally:
        llm.ranks.workers.close()


@pytest.fixture(scope="module")
def one_rank():
    """qwen2 on one rank (its source kept, to export) and its tokens for ``_requests()``: the tensor-parallel
    runs' reference, built and run once for the module."""
    one = LLM(tiny_model("qwen2"), keep_source_model=True, **SERVING)
    prompts, params = _requests()
    return one, [[c.token_ids for c in o.outputs] for o in one.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tp2():
    llm = LLM(tiny_model("qwen2"), tensor_parallel_size=2, **SERVING)
    yield llm
    llm.ranks.workers.close()


def test_two_ranks_generate_the_tokens_of_one(tp2, one_rank):
    """Prefix caching, chunked prefill, preemption and a parallel-sampling fork (copy-on-write) on."""
    prompts, params = _requests()
    one, want = one_rank
    got = [[c.token_ids for c in o.outputs] for o in tp2.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tp2.plan_memory("64MiB").kv_bytes_per_token * 2 == one.plan_memory("64MiB").kv_bytes_per_token
    stats = tp2.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert tp2.program.kv_cache_specs[0].num_kv_heads == 1  # of 2: this rank's half
    assert any("tensor_parallel: rank 0 of 2" in note for note in tp2.report.notes)


def test_a_killed_worker_ends_the_engine_with_an_error(tp2):
    """Runs last in this module: it ends ``tp2``'s engine."""
    tp2.ranks.workers.ranks[0].process.kill()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size: a worker rank stopped answering "
                                           r"\(pagedpack-tp-rank1 \(pid \d+\) exited with code -9\)"):
        tp2.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(EngineDeadError):
        tp2.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not _worker_processes()  # the other workers stopped, the group left: another LLM may start one


def test_what_tensor_parallel_cannot_serve_is_refused_before_starting_processes(tmp_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 ranks run a captured model or a tensor-parallel "
                                         r"export's manifest on the CPU with the reference target \(gloo\), got "
                                         r"target 'onnx'"):
        LLM(tiny_model("llama"), target="onnx", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: expected an int >= 1, got 0"):
        LLM(tiny_model("llama"), tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: .*4 KV heads neither split over 3 ranks"):
        LLM(tiny_model("llama", hidden_size=96, num_attention_heads=12, num_key_value_heads=4), tensor_parallel_size=3)
    assert not _worker_processes()


def test_rank_zero_leaves_the_thread_count_to_num_threads():
    """Fixing rank 0's step threads to CPUs / N set this process's torch count for every later LLM in it."""
    assert EngineArgs(model=tiny_model("llama"), tensor_parallel_size=2).num_threads is None


# ---------------------------------------------------------------- tensor-parallel export


@pytest.fixture(scope="module")
def exported(one_rank, tmp_path_factory):
    """qwen2 exported for 2 ranks, and one rank's tokens to compare with."""
    one, want = one_rank
    path = one.export(tmp_path_factory.mktemp("tp") / "qwen2-tp2.json", tensor_parallel_size=2)
    return path, *_requests(), want


def test_an_export_for_two_ranks_is_served_by_two_processes(exported):
    path, prompts, params, want = exported
    with open(path) as file:
        manifest = json.load(file)
    assert manifest["tensor_parallel_size"] == 2 and [r["file"] for r in manifest["ranks"]] == [
        "qwen2-tp2.rank0.pt2", "qwen2-tp2.rank1.pt2"]
    llm = LLM.from_exported(path, **SERVING)
    try:
        assert llm.engine_args.tensor_parallel_size == 2 and llm.program.kv_cache_specs[0].num_kv_heads == 1
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.ranks.workers.close()


def _edited(path, tmp_path, edit) -> str:
    """A copy of the export's folder whose manifest ``edit`` changed."""
    folder = tmp_path / "copy"
    shutil.copytree(os.path.dirname(path), folder)
    with open(path) as file:
        manifest = json.load(file)
    edit(manifest)
    (folder / os.path.basename(path)).write_text(json.dumps(manifest))
    return str(folder / os.path.basename(path))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["ranks"][1].update(file="../qwen2-tp2.rank1.pt2"), r"ranks\[1\].file: expected a plain file name"),
    (lambda m: m["ranks"][0].update(file=m["ranks"][1]["file"]),
     r"ranks\[0\].file: 'qwen2-tp2.rank1.pt2' is not the file the manifest records"),
    (lambda m: m.update(tensor_parallel_size=3), r"tensor_parallel_size: expected an int in \[2, 64\] and as many"),
    (lambda m: m.update(format="other"), r"expected format 'pagedpack-tensor-parallel', version 1 and an export_id"),
    (lambda m: m.update(version=True), r"expected format 'pagedpack-tensor-parallel', version 1"),
    (lambda m: m["ranks"][1].update(m["ranks"][0]), r"ranks\[1\].file: its metadata says \{'rank': 0, .* expected "
                                                     r"\{'rank': 1"),  # one file twice, its own sha256
])
def test_a_manifest_that_does_not_hold_is_refused_by_field(exported, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        LLM.from_exported(_edited(exported[0], tmp_path, edit))
    assert not _worker_processes()


def test_deeply_nested_json_and_symbolic_links_are_refused(exported, tmp_path):
    path = _edited(exported[0], tmp_path, lambda m: None)
    folder = os.path.dirname(path)
    with open(path, "w") as file:
        file.write('{"format": ' + "[" * 20000 + "]" * 20000 + "}")  # the JSON parser's recursion limit
    with pytest.raises(ValueError, match="is not a JSON tensor-parallel manifest"):
        LLM.from_exported(path)
    shutil.copy(exported[0], path)
    rank0 = os.path.join(folder, "qwen2-tp2.rank0.pt2")
    os.replace(rank0, rank0 + ".elsewhere")
    os.symlink(rank0 + ".elsewhere", rank0)  # the same bytes, so only the link itself is refused
    with pytest.raises(ValueError, match=r"ranks\[0\].file: 'qwen2-tp2.rank0.pt2' is a symbolic link"):
        LLM.from_exported(path)


def test_one_rank_of_an_export_is_not_served_alone(exported):
    with pytest.raises(ValueError, match=r"is one rank of a tensor-parallel export; serve its manifest"):
        LLM.from_exported(exported[0].replace(".json", ".rank1.pt2"))


# ---------------------------------------------------------------- ranks a launcher started

_LAUNCHED = """
import json, sys
import torch.distributed as dist
from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model

folder = sys.argv[1]
with open(f"{folder}/requests.json") as file:
    job = json.load(file)
params, outputs = [SamplingParams(**p) for p in job["params"]], {}
for name, model in (("captured", tiny_model("qwen2")), ("exported", job["manifest"])):
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="external_launcher", **job["serving"])
    outputs[name] = [[c.token_ids for c in o.outputs] for o in llm.generate(job["prompts"], params, use_tqdm=False)]
    outputs[name + " kv heads"] = llm.program.kv_cache_specs[0].num_kv_heads
with open(f"{folder}/rank{dist.get_rank()}.json", "w") as file:
    json.dump(outputs, file)
"""


def test_ranks_torchrun_started_each_return_the_tokens_of_one_rank(exported, tmp_path):
    """``distributed_executor_backend="external_launcher"``: torchrun starts both ranks, each running
    the same script on the same requests (a captured model, then the export's manifest, in one
    process group); each rank's engine returns one rank's tokens (chunked, preempting, a fork)."""
    path, prompts, params, want = exported
    job = {"manifest": path, "prompts": prompts, "serving": SERVING,
           "params": _params(params)}
    (tmp_path / "requests.json").write_text(json.dumps(job))
    (tmp_path / "run.py").write_text(_LAUNCHED)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "run.py"), str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "captured": want, "exported": want, "captured kv heads": 1, "exported kv heads": 1}  # of 2


def test_a_launcher_backend_without_a_launcher_is_refused_by_name(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"distributed_executor_backend: expected one of "
                                         r"\('mp', 'ray', 'external_launcher'\), got 'dask'"):
        EngineArgs(model=tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="dask")
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "ray", None)  # as if not installed
        with pytest.raises(ValueError, match=r"distributed_executor_backend: 'ray' needs Ray \(pip install "
                                             r"'pagedpack\[ray\]'\)"):
            EngineArgs(model=tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"distributed_executor_backend: 'external_launcher' runs ranks a launcher "
                                         r"started \(torchrun\), expected RANK, .* got no RANK, WORLD_SIZE"):
        LLM(tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match=r"distributed_executor_backend: 'external_launcher' ranks each run the same "
                                         r"offline requests"):  # before any rank is built
        AsyncLLM(tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: each process would spawn its own ranks
    with pytest.raises(ValueError, match=r"distributed_executor_backend: this process is one of WORLD_SIZE=2 a "
                                         r"launcher \(torchrun\) started, .* expected 'external_launcher'"):
        EngineArgs(model=tiny_model("llama"), tensor_parallel_size=2)
    monkeypatch.delenv("WORLD_SIZE")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the script's own group
    try:
        with pytest.raises(ValueError, match=r"tensor_parallel_size: the launcher started 1 ranks, got "
                                             r"tensor_parallel_size=2"):
            LLM(tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    finally:
        dist.destroy_process_group()


_NO_GUARD = """
import json, sys
from pagedpack import LLM, SamplingParams

with open(sys.argv[1]) as file:
    job = json.load(file)
llm = LLM(job["model"], tensor_parallel_size=2, **job["serving"])
outputs = llm.generate(job["prompts"], [SamplingParams(**p) for p in job["params"]], use_tqdm=False)
print(json.dumps([[c.token_ids for c in o.outputs] for o in outputs]))
"""


def test_a_script_without_a_main_guard_runs_two_ranks(one_rank, tmp_path):
    """The worker rank starts as ``python -m pagedpack.runtime.tp_worker`` and never imports the
    script, which builds its LLM at module level (from a checkpoint folder of the tiny qwen2) and
    gets one rank's tokens."""
    tiny_model("qwen2").save_pretrained(tmp_path / "qwen2")
    prompts, params = random_prompts((5, 17), seed=5), [SamplingParams(temperature=0.0, max_tokens=4)] * 2
    (tmp_path / "job.json").write_text(json.dumps({"model": str(tmp_path / "qwen2"), "prompts": prompts,
                                                   "serving": SERVING, "params": _params(params)}))
    (tmp_path / "script.py").write_text(_NO_GUARD)
    done = subprocess.run([sys.executable, "script.py", "job.json"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    want = [[c.token_ids for c in o.outputs] for o in one_rank[0].generate(prompts, params, use_tqdm=False)]
    assert json.loads(done.stdout.splitlines()[-1]) == want


def _params(params: list[SamplingParams]) -> list[dict]:
    return [dict(temperature=p.temperature, max_tokens=p.max_tokens, n=p.n, seed=p.seed) for p in params]


def _worker_processes() -> list[str]:
    """The pids of this process's children running a worker rank (read off /proc; an exited,
    unreaped one has no command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                parent, command = int(stat.read().rsplit(")", 1)[1].split()[1]), cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"pagedpack.runtime.tp_worker" in command:
            found.append(pid)
    return found


def test_the_command_channel_keeps_only_the_engines_token_and_bounds_frames():
    """A connection with another token, or naming a rank out of range, is closed unread."""
    listener = rank_channel.RankListener("127.0.0.1", 2)
    stranger = rank_channel.connect("127.0.0.1", listener.port, bytes(32), 1, timeout_s=5)
    out_of_range = rank_channel.connect("127.0.0.1", listener.port, listener.token, 2, timeout_s=5)
    rank1 = rank_channel.connect("127.0.0.1", listener.port, listener.token, 1, timeout_s=5)
    conns = listener.accept_all(30, lambda: None)
    try:
        assert list(conns) == [1] and stranger.recv(1) == b"" and out_of_range.recv(1) == b""
        rank_channel.send_frame(conns[1], b"12345678")
        assert rank_channel.recv_frame(rank1, 8) == b"12345678"
        rank_channel.send_frame(conns[1], b"123456789")
        with pytest.raises(ConnectionError, match="a frame of 9 bytes, expected at most 8"):
            rank_channel.recv_frame(rank1, 8)
    finally:
        for sock in (stranger, out_of_range, rank1, *conns.values()):
            sock.close()


def test_the_command_channel_reads_hellos_side_by_side(monkeypatch):
    """Connections that send nothing or part of a token (slowloris), more than ``MAX_PENDING`` of
    them, delay no worker's hello; each is closed by the time the workers are in."""
    monkeypatch.setattr(rank_channel, "HELLO_TIMEOUT_S", 1.0)
    listener = rank_channel.RankListener("127.0.0.1", 2)
    monkeypatch.setattr(rank_channel, "MAX_PENDING", 3)
    strangers = [socket.create_connection(("127.0.0.1", listener.port), timeout=5) for _ in range(4)]
    strangers[3].sendall(listener.token[:5])
    time.sleep(0.1)  # the strangers are first in the queue
    rank1 = rank_channel.connect("127.0.0.1", listener.port, listener.token, 1, timeout_s=5)
    started = time.monotonic()
    conns = listener.accept_all(5, lambda: None)
    try:
        assert list(conns) == [1] and time.monotonic() - started < 0.9
        assert all(stranger.recv(1) == b"" for stranger in strangers)
    finally:
        for sock in (rank1, *strangers, *conns.values()):
            sock.close()


def test_engine_args_reach_a_worker_as_json_validated_again():
    args = EngineArgs(model="tiny", dtype="bfloat16", kv_cache_memory="64MiB", block_size=16, tensor_parallel_size=2)
    assert EngineArgs.from_json(args.to_json()).as_kwargs() == args.as_kwargs()
    with pytest.raises(ValueError, match=r"model: expected a value another process can rebuild .* LlamaForCausalLM"):
        EngineArgs(model=tiny_model("llama")).to_json()
    with pytest.raises(ValueError, match=r"engine arguments: expected a JSON object of \[.*\], got \['model', 'x'\]"):
        EngineArgs.from_json('{"model": "tiny", "x": 1}')
    with pytest.raises(ValueError, match=r"block_size: expected an int >= 1, got -1"):
        EngineArgs.from_json('{"model": "tiny", "block_size": -1}')


@pytest.mark.parametrize("spec", ["os:abort", "builtins:input", "os:getpid", "pagedpack.passes.manager:PassManager"])
def test_extra_passes_from_json_calls_nothing_but_a_pass_class(spec):
    """A worker makes ``extra_passes`` again from their names: a name of another callable is refused
    before it is called (``os:abort`` would end the process, ``builtins:input`` wait on stdin)."""
    with pytest.raises(ValueError, match=rf"expected MODULE:CLASS of a pagedpack.passes.manager.Pass subclass, "
                                         rf"got '{spec}'"):
        EngineArgs.from_json(json.dumps({"model": "tiny", "extra_passes": [spec]}))


# ---------------------------------------------------------------- ranks as Ray actors


@pytest.fixture(scope="module")
def tp2_ray(ray_cluster):
    llm = LLM(tiny_model("qwen2"), tensor_parallel_size=2, distributed_executor_backend="ray", **SERVING)
    yield llm
    llm.ranks.workers.close()


def test_two_ranks_on_ray_generate_the_tokens_of_one(tp2_ray, one_rank):
    """Rank 1 a Ray actor in a placement group (the session's local cluster), gloo between them."""
    prompts, params = _requests()
    assert [[c.token_ids for c in o.outputs] for o in tp2_ray.generate(prompts, params, use_tqdm=False)] == one_rank[1]


def test_a_killed_ray_actor_ends_the_engine_with_an_error_naming_its_rank(tp2_ray):
    """Runs after the tokens' test: it ends ``tp2_ray``'s engine, and the placement group goes with it."""
    import ray

    workers = tp2_ray.ranks.workers
    group = workers._held.launcher.group
    ray.kill(workers.ranks[0].actor)
    with pytest.raises(EngineDeadError, match=r"tensor_parallel_size: a worker rank stopped answering "
                                              r"\(pagedpack-tp-rank1 \(Ray actor [0-9a-f]+\) died"):
        tp2_ray.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
