"""Files from someone else, and faults: loading never runs a file's code or writes outside its folder,
damaged files are refused naming them, writes are atomic, one LLM serves several threads.

Each test names the case of the trust-and-faults issue it pins (all failed on 7be52bb). Crafted files
are derived in the test from one ``.pt2`` and one ONNX export of the tiny Llama; a payload that ran
would leave a marker file, and no marker may exist afterwards.
"""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import onnx
import pytest
import torch

from pagedpack import LLM, SamplingParams
from pagedpack.compiler.program import load_exported
from pagedpack.formats.checksum import seal_pt2
from pagedpack.formats.export import META_FILE
from pagedpack.formats.files import atomic_write
from pagedpack.formats.pt2_check import UntrustedFileError
from pagedpack.kernels import native
from pagedpack.lowering.onnx.export import export_onnx
from pagedpack.models.tiny import tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import Sampler

from conftest import onnx_sealed, onnx_with_meta, pt2_edited, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_exported):
    """The tiny Llama (byte-level tokenizer, 64 blocks of 16, source kept): conftest's, shared."""
    return tiny_llama_exported[0]


@pytest.fixture(scope="module")
def files(tiny_llama_exported):
    """``{"pt2": path, "onnx": path}``: ``llm`` exported once in each format (conftest's; read-only)."""
    return tiny_llama_exported[1]


class Payload:
    """Pickled, it touches ``marker`` when unpickled: the test of whether a file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def stored_meta(files) -> dict:
    """The pagedpack metadata record of the exports (the same in both formats)."""
    return json.loads({p.key: p.value for p in onnx.load(files["onnx"]).metadata_props}[META_FILE])


def meta_edit(**changes):
    def edit(text):
        return json.dumps({**json.loads(text), **changes})
    return edit


def with_meta(fmt, src, dst, **changes) -> str:
    if fmt == "onnx":
        return onnx_with_meta(src, dst, meta_edit(**changes))
    return pt2_edited(src, dst, {f"extra/{META_FILE}": lambda data: meta_edit(**changes)(data.decode()).encode()})


# ------------------------------------------------------------------ 1. names read from a file's metadata


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_a_tokenizer_file_name_outside_the_folder_is_refused(fmt, files, tmp_path):
    absolute = tmp_path / "absolute-marker"
    relative = "../" * 12 + str(tmp_path / "relative-marker").lstrip("/")
    for name in (str(absolute), relative, "sub/dir", "..", ""):
        tokenizer_files = {**stored_meta(files)["tokenizer_files"], name: "eA=="}
        path = with_meta(fmt, files[fmt], tmp_path / f"evil.{fmt}", tokenizer_files=tokenizer_files)
        with pytest.raises(ValueError, match=r"tokenizer_files: expected plain file names \(no folder, no '..'\)"):
            LLM.from_exported(path, num_blocks=4)
    assert not absolute.exists() and not (tmp_path / "relative-marker").exists()


# ------------------------------------------------------------------ 2. what in a .pt2 would run code


def _pickled_weight(data: bytes) -> bytes:
    """The weights config with its first weight read from the pickled member ``weight_999``."""
    config = json.loads(data)
    fqn = next(iter(config["config"]))
    config["config"][fqn].update(use_pickle=True, path_name="weight_999")
    return json.dumps(config).encode()


def test_a_pickled_weight_is_refused_unless_the_file_is_trusted(files, tmp_path):
    marker = tmp_path / "ran"
    path = pt2_edited(files["pt2"], tmp_path / "evil.pt2", {"data/weights/model_weights_config.json": _pickled_weight,
                                                           "data/weights/weight_999": lambda _: pickled(
                                                               Payload(marker))})
    with pytest.raises(UntrustedFileError, match="a pickled or non-tensor member .*trust_file=True"):
        LLM(path, num_blocks=4)
    assert not marker.exists()
    with pytest.raises(Exception):  # opted in: the payload runs (and is no weight)
        LLM(path, num_blocks=4, trust_file=True)
    assert marker.exists()


def test_pickled_sample_inputs_are_loaded_weights_only(files, tmp_path):
    # torch.export.load falls back to a full unpickle when the sample inputs fail to load weights-only.
    marker = tmp_path / "ran"
    path = pt2_edited(files["pt2"], tmp_path / "evil.pt2",
                      {"data/sample_inputs/model.pt": lambda _: pickled((Payload(marker),))})
    with pytest.raises(ValueError, match="is not a loadable torch.export archive"):
        load_exported(path)
    assert not marker.exists()


@pytest.mark.parametrize("target", ["torch.os.system", "torch.ops.aten.from_file.default", "builtins.exec",
                                    "#extension", "torch.serialization.pickle.loads"])
def test_a_graph_calling_anything_but_an_operator_is_refused(target, files, tmp_path):
    def edit(data):
        return data.replace(b'"torch.ops.aten.neg.default"', json.dumps(target).encode(), 1)

    path = pt2_edited(files["pt2"], tmp_path / "evil.pt2", {"models/model.json": edit})
    with pytest.raises(UntrustedFileError, match="a graph node calling"):
        load_exported(path)


def test_a_graph_nested_too_deeply_is_refused(files, tmp_path):
    # was: RecursionError parsing it
    def edit(data):
        deep = "[" * 10**5 + "]" * 10**5
        return json.dumps(json.loads(data)).replace('"graph_module": {', f'"graph_module": {{"x": {deep}, ', 1).encode()

    path = pt2_edited(files["pt2"], tmp_path / "deep.pt2", {"models/model.json": edit})
    with pytest.raises(ValueError, match=re.escape(f"path: {str(path)!r}: archive member models/model.json is not "
                                                   "JSON (JSON nested too deeply)")):
        load_exported(path)


def test_a_symbolic_expression_that_is_code_is_refused(files, tmp_path):
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path('{marker}').touch()"

    def edit(data):
        program = json.loads(data)
        program["range_constraints"][code] = {"min_val": 1, "max_val": None}
        return json.dumps(program).encode()

    path = pt2_edited(files["pt2"], tmp_path / "evil.pt2", {"models/model.json": edit})
    with pytest.raises(UntrustedFileError, match="a symbolic expression that is not plain arithmetic"):
        load_exported(path)
    assert not marker.exists()


def test_guards_code_is_never_executed(llm, files, tmp_path):
    marker = tmp_path / "ran"

    def edit(data):
        program = json.loads(data)
        program["guards_code"].append(f"__import__('pathlib').Path('{marker}').touch() is None")
        return json.dumps(program).encode()

    path = pt2_edited(files["pt2"], tmp_path / "guarded.pt2", {"models/model.json": edit})
    served = LLM(path, block_size=16, num_blocks=32)
    prompts = random_prompts((3, 17), seed=2)
    assert _tokens(served, prompts) == _tokens(llm, prompts) and not marker.exists()


def test_aoti_members_are_refused(files, tmp_path):
    path = pt2_edited(files["pt2"], tmp_path / "aoti.pt2", {"data/aotinductor/model/model.so": lambda _: b"\x7fELF"})
    with pytest.raises(UntrustedFileError, match="an AOTInductor library"):
        load_exported(path)


# ------------------------------------------------------------------ 5. damaged files


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
@pytest.mark.parametrize("where", [0.3, 0.6, 0.95])
def test_a_flipped_byte_in_an_export_is_refused_naming_the_file(fmt, where, files, tmp_path):
    data = bytearray(Path(files[fmt]).read_bytes())
    data[int(len(data) * where)] ^= 0x04
    path = tmp_path / f"flipped.{fmt}"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"path: {re.escape(repr(str(path)))} (is damaged: its contents have sha256|"
                                         "is not a .pt2 archive|is neither a)"):
        LLM(str(path), num_blocks=4)


# ------------------------------------------------------------------ 6. metadata that disagrees with its program


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 300, "vocab_size: the metadata says 300, its program returns logits of shape"),  # eos ids inside
    ("kv_heads", 3, "kv_cache_specs: the metadata says key_cache_0 is torch.float32 [num_blocks, block_size, 3, 16]"),
    ("head_size", 8, "kv_cache_specs: the metadata says key_cache_0 is torch.float32 [num_blocks, block_size, 2, 8]"),
])
def test_metadata_disagreeing_with_the_program_is_refused_at_load(fmt, field, value, message, files, tmp_path):
    meta = stored_meta(files)
    changes = {"vocab_size": value} if field == "vocab_size" else {"kv_cache_specs": [
        {**spec, **({"num_kv_heads": value} if field == "kv_heads" else {"key_head_size": value})}
        for spec in meta["kv_cache_specs"]]}
    path = with_meta(fmt, files[fmt], tmp_path / f"m.{fmt}", **changes)
    with pytest.raises(ValueError, match=f"path: {re.escape(repr(str(path)))}: " + re.escape(message)):
        LLM(path, num_blocks=4)


# ------------------------------------------------------------------ 4. two threads, one LLM


def _tokens(llm, prompts, params=GREEDY):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_two_threads_on_one_llm_each_get_their_own_complete_completions(llm):
    work = {0: (random_prompts((3, 18, 7, 40), seed=5), SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6)),
            1: (random_prompts((25, 1, 9), seed=6), GREEDY)}
    expected = {k: _tokens(llm, prompts, params) for k, (prompts, params) in work.items()}
    for _ in range(6):
        got, errors = {}, []

        def run(key):
            try:
                got[key] = _tokens(llm, *work[key])
            except Exception as err:  # noqa: BLE001 -- reported below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(k,)) for k in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and got == expected


# ------------------------------------------------------------------ 7. temperatures that overflowed fp32


@pytest.mark.parametrize("temperature", [1e38, 1e39, 1e300, 1.7e308])
def test_a_huge_temperature_with_top_k_1_is_the_argmax(temperature):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 5
    params = SamplingParams(temperature=temperature, top_k=1, seed=1)
    requests = [Request(str(i), [1], params) for i in range(4)]
    assert Sampler()(logits, requests) == logits.argmax(-1).tolist()
    wide = SamplingParams(temperature=temperature, top_k=3, seed=1)
    drawn = Sampler()(logits, [Request(str(i), [1], wide) for i in range(4)])
    top3 = logits.topk(3).indices.tolist()
    assert all(token in row for token, row in zip(drawn, top3, strict=True))


# ------------------------------------------------------------------ 8. atomic exports: SIGKILL, a full disk

_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from pagedpack import LLM
    from pagedpack.models.tiny import tiny_model
    path, full = sys.argv[1:]
    llm = LLM(tiny_model("llama"), num_blocks=8, keep_source_model=True)
    if full:  # first an export to `full` on a full disk, then the loop
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, limits[1]))
        try:
            llm.export(full)
        except OSError as err:
            print("OSError:", err, flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    print("ready", flush=True)
    while True:
        llm.export(path)
""")


def _valid_or_old(path, old: bytes) -> bool:
    data = Path(path).read_bytes()
    if data == old:
        return True
    load_exported(path)  # raises for a partial file
    return True


def test_sigkill_or_a_full_disk_during_exports_leaves_the_old_file_or_a_new_one(files, tmp_path):
    """SIGKILL at two points of an export loop; the first child, before its loop, exports onto a full disk:
    an OSError, and the old file left (one child process for both claims, each was a test's)."""
    # Full disk, before: 'terminate called after throwing an instance of c10::Error' (exit 134) and a partial file.
    full = tmp_path / "full" / "model.pt2"
    full.parent.mkdir()
    full.write_bytes(b"the old file")
    path = tmp_path / "model.pt2"
    old = Path(files["pt2"]).read_bytes()
    path.write_bytes(old)
    for delay, on_full_disk in ((0.7, str(full)), (2.3, "")):  # seconds into the export loop (one export: ~1-3 s)
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), on_full_disk], stdout=subprocess.PIPE,
                                 text=True)
        try:
            if on_full_disk:
                said = child.stdout.readline()
                assert f"OSError: [Errno 27] cannot write {str(full)!r}: File too large" in said, said
            assert child.stdout.readline() == "ready\n"
            time.sleep(delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
        assert _valid_or_old(path, old)
        old = path.read_bytes()
    assert os.listdir(full.parent) == ["model.pt2"] and full.read_bytes() == b"the old file"
    with atomic_write(path) as tmp:  # the next write removes what the killed writers left
        Path(tmp).write_bytes(old)
    assert sorted(os.listdir(tmp_path)) == ["full", "model.pt2"]


# ------------------------------------------------------------------ 9, 11. the native library


@pytest.fixture
def built_library():
    if native.native_ops() is None:
        pytest.skip(f"no native library here: {native.status()}")
    return next(Path(p) for p in native.torch.ops.loaded_libraries if p.endswith("libpagedpack_cpu.so"))


def test_a_truncated_or_garbage_native_library_is_not_valid(built_library, tmp_path):
    # Before: a truncated cached library was mapped and every later run died with 'Bus error'.
    assert native._valid(built_library)
    copy = tmp_path / "libpagedpack_cpu.so"
    record = native._record(built_library).read_text()
    native._record(copy).write_text(record)
    data = built_library.read_bytes()
    for damaged in (data[: len(data) // 2], b"\0" * len(data), data[:-1] + bytes([data[-1] ^ 1])):
        copy.write_bytes(damaged)
        assert not native._valid(copy)
    copy.write_bytes(data)
    assert native._valid(copy)
    native._record(copy).unlink()
    assert not native._valid(copy)  # a library with no record (an older build) is built again


def test_an_invalid_cached_library_is_built_again_before_it_is_loaded(monkeypatch, tmp_path):
    built, loaded = [], []
    monkeypatch.setattr(native, "_valid", lambda library: bool(built))
    monkeypatch.setattr(native, "_build", lambda compiler, flags, library: built.append(library))
    monkeypatch.setattr(native.torch.ops, "load_library", loaded.append)
    monkeypatch.setenv("PAGEDPACK_CACHE", str(tmp_path))
    native._load.cache_clear()
    try:
        assert native._load() is not None and len(built) == 1 and loaded == [str(built[0])]
    finally:
        native._load.cache_clear()


def test_a_failed_build_names_the_compiler_s_errors(tmp_path):
    # Before: a full disk showed only 'collect2: error: ld returned 1 exit status'.
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho '/usr/bin/ld: final link failed: No space left on device' >&2\n"
                    "echo 'collect2: error: ld returned 1 exit status' >&2\nexit 1\n")
    fake.chmod(0o755)
    library = tmp_path / "native" / "libpagedpack_cpu.so"
    with pytest.raises(RuntimeError, match="exited with 1.*final link failed: No space left on device"):
        native._build(str(fake), [], library)
    assert os.listdir(library.parent) == []  # no temporary file left


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children + [d for c in children for d in _descendants(c)]


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _kill_when(parent: subprocess.Popen, ready, timeout: float = 120) -> list[int]:
    """SIGKILL ``parent`` once ``ready(descendants)``; the descendants it had then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _descendants(parent.pid)
        if ready(found):
            parent.kill()
            parent.wait(timeout=30)
            return found
        time.sleep(0.02)
    parent.kill()
    raise AssertionError("the parent never reached the moment to kill it")


def _gone(pids, within: float = 15) -> bool:
    deadline = time.monotonic() + within
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pids)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_killed_native_build_leaves_no_compiler_running(tmp_path):
    script = (f"from pathlib import Path; from pagedpack.kernels import native; "
              f"native._build('c++', native._flags(), Path({str(tmp_path / 'libpagedpack_cpu.so')!r}))")
    parent = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    # killed once the compiler proper runs (the watchdog, the driver and cc1plus)
    pids = _kill_when(parent, lambda found: len(found) >= 3)
    assert _gone(pids), [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in _alive(pids)]


# ------------------------------------------------------------------ 10. the compile child


def test_the_compile_child_dies_with_a_parent_killed_in_its_first_moments(tmp_path):
    checkpoint = tmp_path / "ckpt"
    tiny_model("llama", num_hidden_layers=1).save_pretrained(checkpoint)
    byte_level_tokenizer().save_pretrained(checkpoint)
    env = {**os.environ, "PAGEDPACK_CACHE": str(tmp_path / "cache"), "PAGEDPACK_COMPILE_CACHE": "1"}
    parent = subprocess.Popen([sys.executable, "-c", f"from pagedpack import LLM; LLM({str(checkpoint)!r})"],
                              env=env, stderr=subprocess.DEVNULL)
    pids = _kill_when(parent, bool)  # as soon as the child exists, before it has imported anything
    assert _gone(pids, within=4)  # before, it went on importing and capturing (~10 s) for nobody


# ------------------------------------------------------------------ found by an adversarial trial of the above


def test_a_weight_name_that_is_code_is_refused(files, tmp_path):
    # torch.fx wrote the name into the module's source as getattr(self, "<name>") and exec-ed it on the first step.
    marker = tmp_path / "ran"
    evil = f'w", getattr(__import__("os"), "system")("touch {marker}") or "'

    def rename(data):
        text = data.decode()
        old = json.loads(text)["graph_module"]["signature"]["input_specs"][0]["parameter"]["parameter_name"]
        return text.replace(json.dumps(old), json.dumps(evil)).encode()

    path = pt2_edited(files["pt2"], tmp_path / "evil.pt2", {"models/model.json": rename})
    with pytest.raises(UntrustedFileError, match="a weight or module name that is not dotted letters"):
        LLM(path, num_blocks=4).generate([[1, 2]], GREEDY, use_tqdm=False)
    assert not marker.exists()


@pytest.mark.parametrize("extra, message", [
    ({"evil.py": "import os", "config.json": '{"auto_map": {"AutoConfig": "evil.Cfg"}}'},
     "expected tokenizer files only"),
    ({"tokenizer_config.json": '{"auto_map": {"AutoTokenizer": ["evil.Tok", null]}}'}, "without auto_map"),
    ({"tokenizer_config.json": '{"tokenizer_class": "AutoConfig"}'}, "tokenizer_class: expected a tokenizer class"),
])
def test_tokenizer_files_that_could_import_code_are_refused(extra, message, files, tmp_path):
    # transformers could be led to import a module stored in the file (it asks on a terminal, and waits).
    import base64
    tokenizer_files = {**stored_meta(files)["tokenizer_files"],
                       **{name: base64.b64encode(text.encode()).decode() for name, text in extra.items()}}
    path = with_meta("pt2", files["pt2"], tmp_path / "evil.pt2", tokenizer_files=tokenizer_files)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_exported(path)


def test_a_negative_max_model_len_is_refused_at_load(files, tmp_path):
    # It made the CPU lowering's check loop for ever.
    path = with_meta("pt2", files["pt2"], tmp_path / "m.pt2", max_model_len=-5)
    with pytest.raises(ValueError, match="max_model_len: expected an int >= 1, got -5"):
        LLM(path, num_blocks=4)


def test_onnx_external_data_is_the_file_s_own_and_checksummed(llm, tmp_path, monkeypatch):
    # Above 2 GB the weights go to <file>.data: it was left as '.<tmp>.data' beside every export, outside
    # the checksum, and a crafted model could name any file of its folder.
    from torch.onnx._internal.exporter import _onnx_program

    monkeypatch.setattr(_onnx_program, "_LARGE_MODEL_THRESHOLD", 0)  # the tiny model takes the > 2 GB path
    path = tmp_path / "m.onnx"
    for _ in range(2):
        export_onnx(llm.rewritten, path, llm.description)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    prompts = random_prompts((5, 20), seed=4)
    assert _tokens(LLM(str(path), block_size=16, num_blocks=16), prompts) == _tokens(llm, prompts)
    data = bytearray((tmp_path / "m.onnx.data").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "m.onnx.data").write_bytes(data)
    with pytest.raises(ValueError, match=f"path: {re.escape(repr(str(path) + '.data'))} is damaged"):
        LLM(str(path), num_blocks=4)
    model = onnx.load(path, load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "other.bin"
    (tmp_path / "other.bin").write_bytes(data)
    crafted = onnx_sealed(model, tmp_path / "crafted.onnx")
    with pytest.raises(ValueError, match="keeps tensors in \\['other.bin'\\]; expected only its own data file"):
        load_exported(crafted)


# ------------------------------------------------------------------ found by a second adversarial trial


@pytest.mark.parametrize("member", ["models/evil.json", "models/evil_json", "MODELS/model.json",
                                    "data/constants/opaque_obj_0", "extra/other.json"])
def test_a_member_outside_the_one_program_is_refused(member, files, tmp_path):
    # torch loads every models/* entry as a program with configs of its own (an opaque constant is
    # pickle.loads-ed) and finds names case-insensitively, so MODELS/model.json is what it read.
    path = pt2_edited(files["pt2"], tmp_path / "evil.pt2", {member: lambda _: b"{}"})
    with pytest.raises(ValueError, match=f"a member {re.escape(repr(member))} that is not one of the one program "
                                         "pagedpack exports|two members of one name"):
        load_exported(path)


def test_duplicate_and_compressed_members_are_refused(files, tmp_path):
    with zipfile.ZipFile(files["pt2"]) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    for name, compress in (("duplicate", zipfile.ZIP_STORED), ("compressed", zipfile.ZIP_DEFLATED)):
        path = tmp_path / f"{name}.pt2"
        with zipfile.ZipFile(path, "w") as out:
            for info, data in members:
                if info.filename.endswith("models/model.json"):
                    if name == "duplicate":
                        out.writestr(info, data)
                    info.compress_type = compress
                out.writestr(info, data)
        seal_pt2(str(path))
        with pytest.raises(ValueError, match="two members of one name|a compressed member"):
            load_exported(path)


def test_a_symbolic_power_that_never_finishes_is_refused(files, tmp_path):
    def edit(data):
        return data.replace(b'"expr_str": "', b'"expr_str": "0*3**3**20+', 1)

    path = pt2_edited(files["pt2"], tmp_path / "slow.pt2", {"models/model.json": edit})
    start = time.monotonic()
    with pytest.raises(UntrustedFileError, match="a symbolic expression that is not plain arithmetic"):
        load_exported(path)
    assert time.monotonic() - start < 30


def test_a_sparse_initializer_in_another_file_is_refused(files, tmp_path):
    (tmp_path / "sib.bin").write_bytes(b"\0" * 64)
    model = onnx.load(files["onnx"])
    values = onnx.helper.make_tensor("sparse_values", onnx.TensorProto.FLOAT, [4], [0.0] * 4)
    values.ClearField("float_data")
    values.data_location = onnx.TensorProto.EXTERNAL
    values.external_data.add(key="location", value="sib.bin")
    indices = onnx.helper.make_tensor("sparse_indices", onnx.TensorProto.INT64, [4], [0, 1, 2, 3])
    model.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, [16]))
    path = onnx_sealed(model, tmp_path / "sparse.onnx")
    with pytest.raises(ValueError, match=r"keeps tensors in \['sib.bin'\]; expected only its own data file"):
        load_exported(path)
