"""PEFT LoRA adapter folders (pagedpack.formats.lora_adapter): adapters PEFT saves load with PEFT's
targets, ranks and scalings (checked against PEFT's merged model), and every crafted or foreign file is
refused with a ``ValueError`` naming the file and the field or tensor.

Adapters are made here with ``peft`` on tiny random Llama, Qwen2 and Gemma3 models
(``init_lora_weights=False``, so that B is not zero); the bad ones are edited copies of one of them.
"""
import copy
import io
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from pagedpack.formats import lora_adapter
from pagedpack.formats.files import sha256_file
from pagedpack.formats.lora_adapter import CONFIG_FILE, WEIGHTS_FILE, load_lora_adapter, lora_module_shapes
from pagedpack.models.tiny import tiny_model

_GEMMA3 = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=512,
               layer_types=["sliding_attention", "full_attention"], initializer_range=0.1)
MAX_RANK = 16


def tiny(family: str) -> torch.nn.Module:
    if family == "gemma3":
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(T.Gemma3TextConfig(**_GEMMA3)).eval()
    return tiny_model(family)


def save_adapter(model, folder, **lora) -> torch.nn.Module:
    """Save a PEFT LoRA adapter of ``model`` (left as it is) made with ``lora`` in ``folder``; the PEFT model."""
    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(folder)
    return peft_model


# family, LoraConfig, the rank LoRAAdapter gives
CASES = {
    "llama-qv": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 4),
    "qwen2-all-linear-exclude": ("qwen2", dict(r=8, lora_alpha=16, target_modules="all-linear",
                                               exclude_modules=["k_proj"]), 8),
    "gemma3-regex-patterns": ("gemma3", dict(r=2, lora_alpha=3, target_modules=r".*\.(q_proj|o_proj|down_proj)",
                                             rank_pattern={"o_proj": 6, "model.layers.1.self_attn.q_proj": 3},
                                             alpha_pattern={"down_proj": 5}), 6),
    "llama-rslora-layers": ("llama", dict(r=16, lora_alpha=4, use_rslora=True, layers_to_transform=[1],
                                          layers_pattern="layers",
                                          target_modules=["gate_proj", "up_proj", "down_proj"]), 16),
}


@pytest.mark.parametrize("case", CASES)
def test_an_adapter_peft_saved_is_peft_merged_delta(case, tmp_path):
    """Each module's ``scaling * B @ A`` is PEFT's merged weight minus the base weight; the modules are
    the ones PEFT wrapped (target_modules, exclude_modules, layers_to_transform as PEFT reads them)."""
    family, lora, rank = CASES[case]
    model = tiny(family)
    peft_model = save_adapter(model, tmp_path, **lora)
    wrapped = {name.removeprefix("base_model.model.") for name, module in peft_model.named_modules()
               if isinstance(module, LoraLayer)}
    merged = peft_model.merge_and_unload()
    adapter = load_lora_adapter(str(tmp_path), lora_module_shapes(model), max_lora_rank=MAX_RANK)
    assert set(adapter.weights) == wrapped and wrapped
    assert adapter.rank == rank and adapter.path == str(tmp_path)
    assert adapter.sha256 == sha256_file(tmp_path / WEIGHTS_FILE)
    for module, (a, b, scaling) in adapter.weights.items():
        assert a.dtype == b.dtype == torch.float32 and a.shape[0] == b.shape[1] <= rank
        delta = merged.get_submodule(module).weight - model.get_submodule(module).weight
        torch.testing.assert_close(scaling * b @ a, delta, rtol=1e-5, atol=1e-6)


def test_the_module_shapes_are_the_decoder_layers_linears():
    model = tiny("llama")
    shapes = lora_module_shapes(model)
    assert len(shapes) == 2 * 7 and "lm_head" not in shapes and not any("embed" in m for m in shapes)
    assert shapes["model.layers.1.self_attn.k_proj"] == (64, 32)  # 2 KV heads of 16
    assert shapes["model.layers.0.mlp.down_proj"] == (128, 64)
    with pytest.raises(ValueError, match="model: Linear names no decoder layer class"):
        lora_module_shapes(torch.nn.Linear(2, 2))


# ---- crafted and foreign folders: copies of one adapter, edited ----

@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture(scope="module")
def shapes(model):
    return lora_module_shapes(model)


@pytest.fixture(scope="module")
def good(model, tmp_path_factory) -> Path:
    """A LoRA adapter on q_proj and v_proj at rank 4 (read-only: tests edit copies)."""
    folder = tmp_path_factory.mktemp("good")
    save_adapter(model, folder, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return folder


@pytest.fixture
def adapter(good, tmp_path) -> Path:
    """A copy of ``good`` to edit."""
    return Path(shutil.copytree(good, tmp_path / "adapter"))


def load(folder, shapes, **kwargs):
    return load_lora_adapter(str(folder), shapes, **{"max_lora_rank": MAX_RANK, **kwargs})


def refused(folder, shapes, *names, **kwargs) -> str:
    """The ``ValueError`` loading ``folder`` gives, which must name each of ``names``."""
    with pytest.raises(ValueError) as info:
        load(folder, shapes, **kwargs)
    message = str(info.value)
    for name in names:
        assert str(name) in message, message
    return message


def edit_config(folder, **changes):
    """Set (``...``: drop) fields of ``folder``'s adapter_config.json."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    for key, value in changes.items():
        config.pop(key) if value is ... else config.__setitem__(key, value)
    (folder / CONFIG_FILE).write_text(json.dumps(config))


def edit_tensors(folder, edit):
    """Rewrite ``folder``'s weights as ``edit(tensors)`` (a dict of name -> tensor, edited in place)."""
    tensors = load_file(folder / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS_FILE)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def test_the_good_copy_loads(adapter, shapes):
    """The baseline of the edits below: the untouched copy loads, with its sha256 given too."""
    loaded = load(adapter, shapes, sha256=sha256_file(adapter / WEIGHTS_FILE).upper())
    assert loaded.rank == 4 and len(loaded.weights) == 4


def test_missing_files_are_named(adapter, shapes, tmp_path):
    refused(tmp_path / "nowhere", shapes, "path:", "not a directory")
    (adapter / WEIGHTS_FILE).unlink()
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "missing")
    (adapter / CONFIG_FILE).unlink()
    refused(adapter, shapes, adapter / CONFIG_FILE, "missing")


class Payload:
    """Pickled, it touches ``marker`` when unpickled: the test of whether a file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


@pytest.mark.parametrize("name", ["adapter_model.bin", "adapter_model.pt"])
def test_a_pickled_adapter_is_never_unpickled(adapter, shapes, tmp_path, name):
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({Q_A: Payload(marker)}, buffer)
    (adapter / name).write_bytes(buffer.getvalue())
    (adapter / WEIGHTS_FILE).unlink()
    refused(adapter, shapes, adapter / WEIGHTS_FILE, name, "pickle", "convert it to safetensors")
    assert not marker.exists()


@pytest.mark.parametrize("text, says", [("{not json", "not valid JSON"),
                                        ('["r", 4]', "expected a JSON object, got list"),
                                        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
                                        (b"\xff\xfe{", "not valid JSON")])
def test_a_config_that_is_no_json_object_is_named(adapter, shapes, text, says):
    (adapter / CONFIG_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(adapter, shapes, adapter / CONFIG_FILE, says)


@pytest.mark.parametrize("changes, names", [
    (dict(peft_type="LOHA"), ["peft_type", "expected 'LORA'", "'LOHA'"]),
    (dict(peft_type=...), ["peft_type", "None"]),
    (dict(r=0), ["r:", "integer >= 1", "got 0"]),
    (dict(r="4"), ["r:", "got '4'"]),
    (dict(r=True), ["r:", "got True"]),
    (dict(r=64), ["r:", "LoRA rank 64 is greater than max_lora_rank 16"]),
    (dict(rank_pattern={"v_proj": 32}), ["rank_pattern['v_proj']", "LoRA rank 32 is greater than max_lora_rank 16"]),
    (dict(rank_pattern=["v_proj"]), ["rank_pattern", "expected an object"]),
    (dict(lora_alpha="8"), ["lora_alpha", "expected a finite number"]),
    (dict(alpha_pattern={"q_proj": float("inf")}), ["alpha_pattern['q_proj']", "finite"]),
    (dict(use_rslora="yes"), ["use_rslora", "true or false"]),
    (dict(modules_to_save=["lm_head"]), ["modules_to_save", "expected it unset", "lm_head"]),
    (dict(bias="lora_only"), ["bias", "expected 'none'", "'lora_only'"]),
    (dict(use_dora=True), ["use_dora", "DoRA"]),
    (dict(fan_in_fan_out=True), ["fan_in_fan_out", "transposed"]),
    (dict(lora_bias=True), ["lora_bias"]),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]), ["target_parameters"]),
    (dict(init_lora_weights="pissa"), ["init_lora_weights", "'pissa'", "path_initial_model_for_weight_conversion"]),
    (dict(target_modules=...), ["target_modules", "got None"]),
    (dict(target_modules=[1]), ["target_modules", "expected a list of module names or a regular expression"]),
    (dict(target_modules="(q_proj"), ["target_modules", "expected a regular expression", "'(q_proj'"]),
    (dict(target_modules=["lm_head"]), ["target_modules", "selects none", "q_proj", "['lm_head']"]),
    (dict(exclude_modules=7), ["exclude_modules", "got 7"]),
    (dict(layers_to_transform=["0"]), ["layers_to_transform", "a layer index or a list"]),
    (dict(target_modules=".*q_proj", layers_to_transform=[0]), ["layers_to_transform", "regular expression"]),
    (dict(layers_to_transform=[0], layers_pattern=3), ["layers_pattern", "got 3"]),
    (dict(rank_pattern={f"p{i}": 4 for i in range(79)}), ["rank_pattern", "expected at most 78 entries", "got 79"]),
    (dict(layers_to_transform=[0], layers_pattern=["h", "(layers"]), ["layers_pattern", "'(layers'"]),
])
def test_a_config_field_pagedpack_does_not_serve_is_named(adapter, shapes, changes, names):
    edit_config(adapter, **changes)
    refused(adapter, shapes, adapter / CONFIG_FILE, *names)


def test_a_config_selecting_modules_without_tensors_is_named(adapter, shapes):
    """A module the config selects needs its pair; one it does not select may have none."""
    edit_config(adapter, target_modules=["q_proj", "v_proj", "o_proj"])
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "model.layers.0.self_attn.o_proj", "no lora_A or lora_B")
    edit_config(adapter, target_modules=["q_proj", "v_proj"], layers_to_transform=1)
    refused(adapter, shapes, adapter / WEIGHTS_FILE, Q_A, "not among the modules", "target_modules selects")


def test_a_regex_that_backtracks_without_end_is_bounded(adapter, shapes, monkeypatch):
    """A pattern on which Python's re never ends (nested repeats) is matched by regex at once; and the
    time budget refuses patterns that run long (forced here with a budget of 0)."""
    edit_config(adapter, target_modules=r"(?:(?:[a-z_.]|[a-z_.0-9])+)+[a-z]0")
    refused(adapter, shapes, adapter / CONFIG_FILE, "target_modules", "selects none")
    edit_config(adapter, target_modules=r".*\.(q_proj|v_proj)")
    assert len(load(adapter, shapes).weights) == 4
    monkeypatch.setattr(lora_adapter, "REGEX_BUDGET_S", 0)
    refused(adapter, shapes, adapter / CONFIG_FILE, "target_modules", "ran past the 0 s")


@pytest.mark.parametrize("pattern, says", [
    ("(?:(?:(?:a{1000}){1000}){1000})", "bounded child process"),  # compiling it filled gigabytes, GIL held
    ("(" * 5000 + ")" * 5000, "characters, expected at most 4096"),
    ("(" * 1000 + ")" * 1000, "RecursionError"),
    ("q" * 900_000, "characters, expected at most 4096"),
])
def test_a_regex_that_compiles_without_end_is_refused_at_once(adapter, shapes, pattern, says):
    # From an adversarial trial: only matching was timed; compiling stalled and swelled a server.
    start = time.monotonic()
    edit_config(adapter, target_modules=r".*\.(q_proj|v_proj)", exclude_modules=pattern)
    message = refused(adapter, shapes, adapter / CONFIG_FILE, "exclude_modules")
    assert says in message and time.monotonic() - start < 10, message


def test_an_alpha_whose_scaling_overflows_is_refused(adapter, shapes):
    edit_config(adapter, lora_alpha=1e300)  # finite, but B * scaling is not: every answer would be NaN
    refused(adapter, shapes, adapter / CONFIG_FILE, "lora_alpha", "overflows float32")


def _add(name, tensor):
    return lambda tensors: tensors.__setitem__(name, tensor)


@pytest.mark.parametrize("edit, names", [
    (_add("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 258)),
     ["lora_embedding_A", "embedding LoRA is not supported", "q_proj, up_proj, v_proj"]),
    (_add("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)),
     ["base_model.model.lm_head.lora_A.weight", "module 'lm_head' is not one LoRA may target", "down_proj"]),
    (_add("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", torch.zeros(4, 64)),
     ["k_proj.lora_A.weight", "'model.layers.0.self_attn.k_proj' is not among the modules", "target_modules"]),
    (_add("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", torch.zeros(64)),
     ["q_proj.lora_B.bias", "unexpected name"]),
    (_add("__metadata_like", torch.zeros(1)), ["'__metadata_like'", "unexpected name"]),
    (lambda t: t.pop(Q_B), [Q_A, "but no lora_B tensor"]),
    (lambda t: t.pop(Q_A), [Q_B, "but no lora_A tensor"]),
    (lambda t: t.__setitem__(Q_A, t[Q_A].T.contiguous()), [Q_A, "expected shape [4, 64]", "got [64, 4]"]),
    (lambda t: t.__setitem__(Q_A, t[Q_A][0]), [Q_A, "expected shape [4, 64]", "got [64]"]),
    (lambda t: t.__setitem__(Q_A, t[Q_A][:3].contiguous()), [Q_B, "rank 4 (its columns)", "rank 3 (its rows)"]),
    (lambda t: t.update({Q_A: t[Q_A][:3].contiguous(), Q_B: t[Q_B][:, :3].contiguous()}),
     [Q_A, "expected shape [4, 64]", "got [3, 64]"]),
    (lambda t: t.__setitem__(Q_A, torch.ones(4, 64, dtype=torch.int32)), [Q_A, "floating dtype", "torch.int32"]),
    (lambda t: t.__setitem__(Q_B, t[Q_B].index_fill(0, torch.tensor([3]), float("nan"))), [Q_B, "non-finite"]),
    (lambda t: t.__setitem__(Q_B, t[Q_B].double().index_fill(1, torch.tensor([0]), 1e300)), [Q_B, "non-finite"]),
])
def test_a_bad_tensor_is_named(adapter, shapes, edit, names):
    edit_tensors(adapter, edit)
    refused(adapter, shapes, adapter / WEIGHTS_FILE, *names)


def test_half_precision_and_an_adapter_name_infix_load(adapter, shapes, good):
    """bf16 tensors come back as float32; keys ``lora_A.<adapter>.weight`` (one adapter) read as the plain ones;
    two adapter names are refused."""
    expected = load(good, shapes).weights
    def infix(tensors):
        for name in list(tensors):
            tensors[name.replace(".weight", ".my_adapter.weight")] = tensors.pop(name).bfloat16()

    edit_tensors(adapter, infix)
    loaded = load(adapter, shapes).weights
    assert loaded.keys() == expected.keys()
    for module, (a, b, scaling) in loaded.items():
        assert a.dtype == torch.float32 and scaling == expected[module][2]
        torch.testing.assert_close(a, expected[module][0].bfloat16().float(), rtol=0, atol=0)
    other = Q_A.replace(".weight", ".my_adapter.weight")
    edit_tensors(adapter, lambda t: t.__setitem__(other.replace("my_adapter", "other"), t.pop(other)))
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "expected the tensors of one adapter", "'my_adapter', 'other'")


def test_a_wrong_sha256_is_named(adapter, shapes):
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "sha256: expected " + "0" * 64, sha256="0" * 64)


def test_a_file_over_its_size_bound_is_refused_unread(adapter, shapes):
    with open(adapter / WEIGHTS_FILE, "ab") as file:
        file.truncate(2 << 20)
    refused(adapter, shapes, adapter / WEIGHTS_FILE, f"{2 << 20} bytes, over the", "8 bytes an element")
    (adapter / CONFIG_FILE).write_text(" " * (1 << 20) + "{}")
    refused(adapter, shapes, adapter / CONFIG_FILE, "bytes, over the")


def _header(data: bytes) -> tuple[int, dict]:
    size = struct.unpack("<Q", data[:8])[0]
    return size, json.loads(data[8:8 + size])


def _with_header(data: bytes, header: dict) -> bytes:
    size, _ = _header(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + size:]


@pytest.mark.parametrize("rewrite", [
    lambda data: struct.pack("<Q", 1 << 40) + data[8:],  # a header longer than the file
    lambda data: data[:8] + b"\xff" * 16 + data[24:],  # a header that is no JSON
    lambda data: _with_header(data, {k: {**v, "data_offsets": [0, 1 << 20]} if isinstance(v, dict) and "dtype" in v
                                         and k == Q_A else v for k, v in _header(data)[1].items()}),  # past the end
    lambda data: _with_header(data, {k: {**v, "dtype": "X9"} if k == Q_B else v
                                     for k, v in _header(data)[1].items()}),  # an unknown dtype
    lambda data: _with_header(data, {k: {**v, "shape": [4, 65]} if k == Q_A else v
                                     for k, v in _header(data)[1].items()}),  # a shape its bytes do not hold
    lambda data: b"",
])
def test_a_rewritten_safetensors_header_is_named(adapter, shapes, rewrite):
    path = adapter / WEIGHTS_FILE
    path.write_bytes(rewrite(path.read_bytes()))
    refused(adapter, shapes, path, "not a readable safetensors file")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1, exclude_max=True))
def test_a_truncated_file_is_named(adapter, shapes, good, cut):
    data = (good / WEIGHTS_FILE).read_bytes()
    (adapter / WEIGHTS_FILE).write_bytes(data[:int(cut * len(data))])
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "not a readable safetensors file")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_header_loads_or_is_named(adapter, shapes, good, data):
    """Any byte of the header changed: the adapter loads (a change JSON ignores) or a ValueError names the file."""
    original = bytearray((good / WEIGHTS_FILE).read_bytes())
    size, _ = _header(bytes(original))
    at = data.draw(st.integers(0, 8 + size - 1))
    original[at] = data.draw(st.integers(0, 255).filter(lambda byte: byte != original[at]))
    (adapter / WEIGHTS_FILE).write_bytes(bytes(original))
    try:
        load(adapter, shapes)
    except ValueError as err:
        assert str(adapter / WEIGHTS_FILE) in str(err)


def test_links_out_of_the_folder_and_special_files_are_refused(adapter, shapes, good, tmp_path):
    """A link inside the folder is read; one resolving outside it, a FIFO (never opened to block) or a
    folder in a file's place is refused naming the file."""
    os.rename(adapter / CONFIG_FILE, adapter / "config.real.json")
    os.symlink("config.real.json", adapter / CONFIG_FILE)
    assert load(adapter, shapes).rank == 4
    os.unlink(adapter / CONFIG_FILE)
    os.symlink(good / CONFIG_FILE, adapter / CONFIG_FILE)
    refused(adapter, shapes, adapter / CONFIG_FILE, "outside the adapter folder", str(good / CONFIG_FILE))
    os.unlink(adapter / CONFIG_FILE)
    os.symlink("../adapter/../adapter/config.real.json", adapter / CONFIG_FILE)
    assert load(adapter, shapes).rank == 4
    (adapter / WEIGHTS_FILE).unlink()
    os.mkfifo(adapter / WEIGHTS_FILE)
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "expected a regular file")
    (adapter / WEIGHTS_FILE).unlink()
    (adapter / WEIGHTS_FILE).mkdir()
    refused(adapter, shapes, adapter / WEIGHTS_FILE, "expected a regular file")


def test_the_folder_as_a_link_is_read(good, shapes, tmp_path):
    """The folder itself may be a link (the path as given): its files resolve inside its target."""
    os.symlink(good, tmp_path / "linked")
    assert load(tmp_path / "linked", shapes).path == str(tmp_path / "linked")


def test_errors_never_show_a_whole_untrusted_value(adapter, shapes):
    edit_config(adapter, peft_type="X" * 10_000)
    assert len(re.findall("X", refused(adapter, shapes, "peft_type"))) <= 120
