"""``LLM(path)`` on the CPU with the compile cache on: captured in a child process, served from the
``.pt2`` the cache keeps (:mod:`pagedpack.compiler.compile_cache`); same tokens as the unmodified model."""
import base64
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from pagedpack import LLM, SamplingParams
from pagedpack.compiler import compile_cache, program
from pagedpack.kernels import native
from pagedpack.models.tiny import tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer
from pagedpack.step.contract import UnsupportedModelError

from conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def unmodified(checkpoint):
    """The unmodified model's greedy tokens of each of PROMPTS, run alone."""
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return [hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.fixture(scope="module")
def cold(checkpoint, tmp_path_factory):
    """The module's one cold start: ``LLM(checkpoint)`` in a ``$PAGEDPACK_CACHE`` folder whose
    ``compiled/`` was empty and whose ``native/`` holds the native CPU kernels (this process's build);
    ``(folder, llm, the child processes started)``. The folder then holds ``checkpoint``'s entry."""
    folder = tmp_path_factory.mktemp("built")
    library = native.library_path()  # this process's build, so that the child does not compile it (~60 s)
    if library is not None:
        shutil.copytree(library.parent, folder / "native" / library.parent.name)
    started, run = [], subprocess.run

    def counted(cmd, *args, **kwargs):
        if cmd[1:3] == ["-c", compile_cache._CHILD]:
            started.append(cmd)
        return run(cmd, *args, **kwargs)

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDPACK_CACHE", str(folder))
        env.setenv("PAGEDPACK_COMPILE_CACHE", "1")
        env.setattr(subprocess, "run", counted)
        llm = LLM(str(checkpoint), num_blocks=32)
    return folder, llm, started


@pytest.fixture(scope="module")
def built(cold):
    """The ``$PAGEDPACK_CACHE`` folder of the cold start: ``compiled/`` holds ``checkpoint``'s entry,
    ``native/`` the native CPU kernels (this process's build)."""
    return cold[0]


@pytest.fixture
def cache(tmp_path, monkeypatch, built):
    """An empty compile cache (its path), in a ``$PAGEDPACK_CACHE`` that has the module's native
    kernels: each process a test starts loads them, where it would compile them (about 30 s)."""
    monkeypatch.setenv("PAGEDPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDPACK_COMPILE_CACHE", "1")
    if (built / "native").is_dir():  # none where they are not built (no compiler, PAGEDPACK_NATIVE=0)
        shutil.copytree(built / "native", tmp_path / "cache" / "native")
    return tmp_path / "cache" / "compiled"


@pytest.fixture
def warm(cache, built):
    """``cache`` holding a copy of the module's entry."""
    shutil.copytree(built / "compiled", cache)
    return cache


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_served_from_the_child_s_export_with_the_unmodified_model_s_tokens(checkpoint, cold, children,
                                                                            unmodified, tmp_path, monkeypatch, capfd):
    """Served from the child's entry (the module's cold start, whose entry the other tests copy);
    then the same LLM captured in this process, where the cache cannot be written (one in-process
    capture for that claim and for the comparison)."""
    folder, llm, started = cold
    (entry,) = (folder / "compiled").iterdir()
    assert len(started) == 1 and {p.name for p in entry.iterdir()} == {"step.pt2", "info.json"}
    assert llm.report.notes[-1].startswith(f"loaded from {entry / 'step.pt2'}; cpu lowering: ")
    assert tokens(llm) == unmodified

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PAGEDPACK_CACHE", str(tmp_path / "a-file"))
    monkeypatch.setenv("PAGEDPACK_COMPILE_CACHE", "1")
    capfd.readouterr()
    in_process = LLM(str(checkpoint), num_blocks=32)
    assert "cannot write the compile cache" in capfd.readouterr().err and not children
    assert tokens(in_process) == unmodified
    assert llm.report.format().splitlines()[0] == in_process.report.format().splitlines()[0]
    assert llm.description.eos_token_ids == in_process.description.eos_token_ids
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text == \
        in_process.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text
    for keep in (False, True):  # plan_memory's weights, as if captured here
        assert llm._builder.weight_bytes(keep) == in_process._builder.weight_bytes(keep)
    assert llm.model is not None and llm.rewritten.ok  # loaded and captured again on use, as in process


def test_a_later_llm_starts_from_the_entry_until_the_checkpoint_changes(checkpoint, warm, children, tmp_path):
    expected = tokens(LLM(str(checkpoint), num_blocks=32))
    assert not children
    changed = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, changed)
    LLM(str(changed), num_blocks=32)  # another folder: an entry of its own
    config, before = changed / "config.json", (changed / "config.json").stat()
    text = config.read_text()
    config.write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 5e-01'))
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same modification time
    assert config.stat().st_size == before.st_size and config.read_text() != text
    llm = LLM(str(changed), num_blocks=32)
    assert len(children) == 2 and len(list(warm.iterdir())) == 2  # built again in its place
    reference = AutoModelForCausalLM.from_pretrained(changed).eval()
    assert tokens(llm) == [hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS] != expected


def test_a_refused_checkpoint_raises_as_in_process_and_is_remembered(cache, children, tmp_path):
    tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}).save_pretrained(tmp_path / "ntk")
    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match="rope_type='dynamic': dynamic-NTK RoPE"):
            LLM(str(tmp_path / "ntk"), num_blocks=8)
    assert len(children) == 1  # the second LLM knew
    (entry,) = cache.iterdir()
    assert "UnsupportedModelError" in json.loads((entry / "info.json").read_text())["error"]


def test_a_flipped_byte_in_an_entry_is_refused_and_the_entry_built_again(checkpoint, warm, children, capfd,
                                                                         unmodified):
    # Regression (trust and faults, 5): a flipped byte in step.pt2 was served as garbage text.
    (entry,) = warm.iterdir()
    step = entry / "step.pt2"
    data = bytearray(step.read_bytes())
    data[len(data) // 3] ^= 0x10
    step.write_bytes(data)
    llm = LLM(str(checkpoint), num_blocks=32)
    err = capfd.readouterr().err
    assert f"path: {str(step)!r} is damaged" in err and "building it again" in err and len(children) == 1
    assert tokens(llm) == unmodified
    assert llm._builder.source_model is None and step.read_bytes() != data  # let go after lowering; the entry is new


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def test_a_damaged_or_pickled_record_is_built_again_and_leftovers_are_removed(checkpoint, warm, children, tmp_path):
    """One rebuild for three claims (each was a test that rebuilt the entry): a record whose report is a
    pickle is built again and never unpickled; a damaged record (the report not base64, ...) is refused as
    well; building an entry removes what killed builds and gone checkpoints left, keeping a build under way."""
    # Regression (trust and faults, 3): the report was stored as a pickle and unpickled on every load,
    # so whoever could write the cache ran code in every user's process.
    (entry,) = warm.iterdir()
    marker = tmp_path / "ran"
    info = json.loads((entry / "info.json").read_text())
    planted = base64.b64encode(pickle.dumps(_Payload(marker))).decode("ascii")
    (entry / "info.json").write_text(json.dumps({**info, "report": planted}))
    gone = warm / "0123456789abcdef"  # the entry of a checkpoint deleted since
    shutil.copytree(entry, gone)
    gone_key = {**info["key"], "checkpoint": [str(tmp_path / "gone")]}
    (gone / "info.json").write_text(json.dumps({**info, "key": gone_key}))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (warm / f".partial-{dead.stdout.strip()}-x").mkdir()
    (warm / f".partial-{os.getpid()}-y").mkdir()  # a build under way: kept
    assert tokens(LLM(str(checkpoint), num_blocks=32)) and len(children) == 1  # built again
    assert not marker.exists()
    rebuilt = json.loads((entry / "info.json").read_text())
    assert isinstance(rebuilt["report"], dict) and rebuilt["source_weight_bytes"] == info["source_weight_bytes"]
    assert sorted(p.name for p in warm.iterdir()) == sorted([entry.name, f".partial-{os.getpid()}-y"])
    stamp = tuple(info["key"]["checkpoint"])
    assert compile_cache._parse(info, entry, stamp) is not None
    for damage in ({"report": "not base64"}, {"report": planted}, {"report": None}, {"report": "bm90IGEgcGlja2xl"},
                   {"source_weight_bytes": "x"}, {"error": "x"}):
        assert compile_cache._parse({**info, **damage}, entry, stamp) is None, damage
    assert not marker.exists()


def test_a_child_that_cannot_run_is_reported_and_tried_again_next_time(checkpoint, cache, children, monkeypatch,
                                                                      capfd):
    monkeypatch.setattr(compile_cache, "_CHILD", "import sys; sys.exit(1)")  # e.g. killed, or out of memory
    for n in (1, 2):
        llm = LLM(str(checkpoint), num_blocks=32)
        assert "the child process failed (exit status 1); capturing in this process" in capfd.readouterr().err
        assert len(children) == n and llm.report.ok


def test_the_child_imports_what_the_parent_imports_not_the_working_directory_s(checkpoint, cache, tmp_path):
    """From an adversarial trial: ``python -m`` put the working directory first on the child's path,
    so a project's own ``transformers.py`` failed the child, and the failure was recorded for good.
    The serving process, which had the child build the entry, imports neither modeling code nor the
    passes (one fresh process for both claims)."""
    shadow = tmp_path / "project"
    shadow.mkdir()
    (shadow / "transformers.py").write_text("raise ImportError('a project module named transformers')\n")
    capture_side = ("transformers.models.llama", "transformers.modeling_utils", "pagedpack.models.capture",
                    "pagedpack.passes.pipeline")
    (tmp_path / "serve.py").write_text("import sys; from pagedpack import LLM; LLM(sys.argv[1], num_blocks=8); "
                                       f"print([m for m in sys.modules if m.startswith({capture_side})])\n")
    done = subprocess.run([sys.executable, str(tmp_path / "serve.py"), str(checkpoint)], cwd=shadow,
                          capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]" and "in a child process" in done.stderr
    (entry,) = cache.iterdir()
    assert json.loads((entry / "info.json").read_text())["error"] is None


@pytest.mark.parametrize("kwargs", [dict(keep_source_model=True, num_blocks=32), dict(memory_budget="64MiB"),
                                    dict(target="onnx", num_blocks=32)])
def test_what_needs_the_source_model_or_another_target_captures_in_process(checkpoint, cache, children, kwargs,
                                                                          monkeypatch):
    """Captured and rewritten in this process: it reaches the lowering (stopped there: the targets' own
    tests lower; the ONNX export alone took most of this test) with no child started and no cache written."""
    class Lowering(Exception):
        pass

    def stop(source, model, rewritten, **_):
        assert rewritten.step.report.ok
        raise Lowering

    monkeypatch.setattr(program, "lower", stop)
    with pytest.raises(Lowering):
        LLM(str(checkpoint), **kwargs)
    assert not children and not cache.exists()
