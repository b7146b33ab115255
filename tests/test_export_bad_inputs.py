"""Export and load paths under bad or unusual inputs: each mistake gets a clear ``ValueError``
(or ``TypeError``) naming the argument, or a per-request ``error``; unusual but valid inputs give
the tokens of the un-exported ``LLM`` on the same model.

One ONNX and one ``.pt2`` export of the tiny Llama serve the whole module; the other files
(corrupted, foreign, renamed, other format version, com.microsoft) are derived from them.
"""
import base64
import json
import os
import re
import shutil
import zipfile
from types import SimpleNamespace

import onnx
import pytest
import torch
import torch.nn.functional as F

from pagedpack import LLM, SamplingParams
from pagedpack.cli import main
from pagedpack.compiler.program import load_exported
from pagedpack.formats.checksum import seal_pt2
from pagedpack.formats.export import META_FILE
from pagedpack.lowering.onnx.export import export_onnx, load_onnx
from pagedpack.lowering.reference.pt2 import export_pt2, load_pt2
from pagedpack.models.capture import capture
from pagedpack.models.tiny import VOCAB_SIZE, tiny_model
from pagedpack.passes.pipeline import UnsupportedModelError, rewrite
from pagedpack.step.contract import ModelDescription, StateSpec, step_input_names

from conftest import onnx_sealed, onnx_with_meta, pt2_edited, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
EXPORTERS = {"pt2": export_pt2, "onnx": export_onnx}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(tiny_llama_exported):
    """The un-exported reference (a tiny Llama of its own), with a pool large enough never to preempt:
    conftest's, shared with test_trust_and_faults.py."""
    return tiny_llama_exported[0]


@pytest.fixture(scope="module")
def files(tiny_llama_exported):
    """``{"onnx": path, "pt2": path}``: the tiny Llama exported once in each format (conftest's; read-only)."""
    return tiny_llama_exported[1]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def reference(llm, prompts, params=GREEDY) -> list[list[int]]:
    return tokens(llm.generate(prompts, params, use_tqdm=False))


def pt2_with_meta(src: str, dst, edit) -> str:
    """A copy of the ``.pt2`` archive ``src`` whose pagedpack metadata is ``edit(text)`` (checksum valid)."""
    return pt2_edited(src, dst, {f"extra/{META_FILE}": lambda data: edit(data.decode()).encode()})


def json_edit(**changes):
    """An ``edit`` for the helpers above: set (or, with ``...``, drop) metadata fields."""
    def edit(text: str) -> str:
        meta = json.loads(text)
        for key, value in changes.items():
            if value is ...:
                meta.pop(key)
            else:
                meta[key] = value
        return json.dumps(meta)
    return edit


# ---------------------------------------------------------------- export: source, path, attention


class _Bidirectional(torch.nn.Module):
    """One SDPA site with no mask and is_causal=False: encoder-style, refused by the pass."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, input_ids, position_ids, use_cache=False):
        x = F.one_hot(input_ids, 16).float()
        q, k, v = self.proj(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return SimpleNamespace(logits=F.scaled_dot_product_attention(q, k, v).sum(1))


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
@pytest.mark.parametrize("source, name", [("./my-hf-dir", "str"), (None, "NoneType"),
                                          (torch.nn.Linear(2, 2), "Linear")])
def test_export_refuses_a_source_that_is_not_a_rewritten_model(fmt, source, name, tmp_path):
    with pytest.raises(ValueError, match=f"rewritten: expected a RewrittenModel .*, got {name}"):
        EXPORTERS[fmt](source, tmp_path / f"x.{fmt}")
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_export_refuses_an_llm_an_unmodified_causal_lm_and_a_loaded_export(fmt, llm, model, files, tmp_path):
    for source, name in ((model, "LlamaForCausalLM"), (load_exported(files["pt2"]), "ExportedStep"),
                         (llm, "LLM")):
        with pytest.raises(ValueError, match=f"rewritten: expected a RewrittenModel .*, got {name}"):
            EXPORTERS[fmt](source, tmp_path / f"x.{fmt}")
    for loaded in files.values():  # regression: an OnnxSessionStep had no .parameters()
        with pytest.raises(ValueError, match=r"source: an LLM served from an exported file \(LLM.from_exported\) "
                                             "cannot be exported again"):
            LLM.from_exported(loaded, num_blocks=4).export(tmp_path / f"x.{fmt}", format=fmt)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_export_of_a_bare_rewritten_model(fmt, llm, tmp_path):
    # Regression: reading the vocabulary size off the graph's single output raised TypeError.
    path = EXPORTERS[fmt](llm.rewritten, tmp_path / f"x.{fmt}", ModelDescription(max_model_len=64))
    description = load_exported(path).description
    assert description.vocab_size == VOCAB_SIZE and description.max_model_len == 64 and description.tokenizer is None


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_export_of_a_refused_model_raises_the_pass_report_and_writes_nothing(fmt, tmp_path):
    refused = rewrite(capture(_Bidirectional()))
    assert not refused.ok
    with pytest.raises(UnsupportedModelError, match="cannot rewrite this model(.|\n)*bidirectional"):
        EXPORTERS[fmt](refused, tmp_path / f"x.{fmt}")
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_export_into_a_missing_directory_or_under_a_file(fmt, llm, files, tmp_path):
    for path in (tmp_path / "missing" / f"x.{fmt}", os.path.join(files["onnx"], f"x.{fmt}")):
        with pytest.raises(ValueError, match=r"path: expected a file in an existing directory.*no such directory"):
            EXPORTERS[fmt](llm.rewritten, path)
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_export_to_a_directory_an_empty_or_a_non_path(fmt, llm, tmp_path):
    # Regression: these failed deep inside torch/onnx, after the whole export.
    with pytest.raises(ValueError, match=r"path: expected a file name, got .* \(a directory\)"):
        EXPORTERS[fmt](llm.rewritten, tmp_path)
    for bad in ("", None, 3, b"x.onnx"):
        with pytest.raises(TypeError, match="path: expected a non-empty str or os.PathLike"):
            EXPORTERS[fmt](llm.rewritten, bad)
    assert not os.listdir(tmp_path)


def test_llm_export_writes_the_format_its_file_name_says(llm, tmp_path):
    # Regression: LLM.export("x.onnx") wrote a .pt2 archive under that name.
    onnx.checker.check_model(llm.export(tmp_path / "x.onnx"))
    assert zipfile.is_zipfile(llm.export(tmp_path / "x.pt2"))
    with pytest.raises(ValueError, match=r"format: .*y\.onnx' ends with the onnx suffix, got format='pt2'"):
        llm.export(tmp_path / "y.onnx", format="pt2")
    assert not (tmp_path / "y.onnx").exists()


def test_write_errors_name_the_path_and_leave_the_old_file(llm, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    (tmp_path / "x.pt2").write_bytes(b"the old file")
    monkeypatch.setattr(torch.export, "save", fail)
    with pytest.raises(OSError, match=r"cannot write .*x.pt2': No space left on device"):
        export_pt2(llm.rewritten, tmp_path / "x.pt2")
    assert os.listdir(tmp_path) == ["x.pt2"] and (tmp_path / "x.pt2").read_bytes() == b"the old file"


@pytest.mark.parametrize("attention", [None, "", "Pagedpack", "PAGEDPACK", "com.Microsoft", "microsoft", 1])
def test_export_onnx_attention_of_wrong_value_case_or_type(llm, attention, tmp_path):
    with pytest.raises(ValueError, match=r"attention: expected one of \['pagedpack', 'com.microsoft'\], got "
                                         + re.escape(repr(attention)) + "$"):
        export_onnx(llm.rewritten, tmp_path / "x.onnx", attention=attention)
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- load: files that are not exports


@pytest.mark.parametrize("load", [load_exported, LLM.from_exported])
def test_load_a_directory_or_a_missing_file(load, tmp_path):
    for path in (tmp_path, tmp_path / "missing.onnx", tmp_path / "missing.pt2"):
        with pytest.raises(ValueError, match="path: expected a .pt2 archive or .onnx model") as err:
            load(path)
        assert repr(str(path)) in str(err.value)


@pytest.mark.parametrize("name", ["empty.onnx", "empty.pt2", "empty"])
def test_load_an_empty_file(name, tmp_path):
    path = tmp_path / name
    path.write_bytes(b"")
    for load in (load_exported, LLM.from_exported):
        with pytest.raises(ValueError, match="path: ") as err:
            load(path)
        assert repr(str(path)) in str(err.value)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_load_a_truncated_export(fmt, keep, files, tmp_path):
    data = open(files[fmt], "rb").read()
    path = tmp_path / f"truncated.{fmt}"
    path.write_bytes(data[:int(len(data) * keep)])
    # A zip cut short has lost its central directory (no longer recognisable as a .pt2 archive) or its checksum.
    with pytest.raises(ValueError, match=f"path: '{path}' (carries no pagedpack checksum .*cut short|is neither a "
                                         rf"\.pt2 archive \(a zip file\) nor a loadable ONNX model)"):
        LLM.from_exported(path)


def test_load_a_valid_onnx_model_that_is_not_a_pagedpack_one(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    foreign = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])],
                                                            "g", [x], [y]))
    onnx.save(foreign, tmp_path / "foreign.onnx")
    with pytest.raises(ValueError, match="is not a pagedpack ONNX model"):
        LLM.from_exported(tmp_path / "foreign.onnx")


def test_load_a_foreign_graph_carrying_pagedpack_metadata(files, tmp_path):
    # Right metadata, wrong graph: refused by the input names before any step runs.
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    foreign = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])],
                                                            "g", [x], [y]))
    for prop in onnx.load(files["onnx"]).metadata_props:
        foreign.metadata_props.add(key=prop.key, value=prop.value)
    onnx_sealed(foreign, tmp_path / "foreign.onnx")
    with pytest.raises(ValueError, match=r"its metadata describes the inputs \['input_ids', .*its program has \['x'\]"):
        LLM.from_exported(tmp_path / "foreign.onnx")


def test_load_a_torch_export_archive_that_is_not_a_pagedpack_one(tmp_path):
    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    path = tmp_path / "foreign.pt2"
    torch.export.save(torch.export.export(AddOne(), (torch.ones(2),)), path)
    with pytest.raises(ValueError, match="carries no pagedpack checksum"):
        LLM.from_exported(path)
    seal_pt2(str(path))
    with pytest.raises(ValueError, match="is a torch.export archive but not a pagedpack one"):
        LLM.from_exported(path)
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("a.txt", "hello")
    seal_pt2(str(other_zip))
    with pytest.raises(ValueError, match="is not a torch.export .pt2 archive"):
        load_exported(other_zip)


def test_each_format_through_the_other_loader(files):
    with pytest.raises(ValueError, match="nor a loadable ONNX model"):
        load_onnx(files["pt2"])
    with pytest.raises(ValueError, match="carries no pagedpack checksum"):
        load_pt2(files["onnx"])


def test_pt2_archive_renamed_to_onnx_is_served_by_its_content(llm, files, tmp_path):
    renamed = shutil.copy(files["pt2"], tmp_path / "archive.onnx")
    prompts = random_prompts((3, 20), seed=11)
    served = LLM.from_exported(renamed, block_size=16, num_blocks=16)
    assert reference(served, prompts) == reference(llm, prompts)


def test_onnx_model_renamed_to_pt2_is_served_by_its_content(llm, files, tmp_path):
    # Regression: the loader chose by the name first and refused this file.
    renamed = shutil.copy(files["onnx"], tmp_path / "model.pt2")
    served = LLM.from_exported(renamed, block_size=16, num_blocks=16)
    prompts = random_prompts((3, 20), seed=11)
    assert reference(served, prompts) == reference(llm, prompts)


# ---------------------------------------------------------------- load: pagedpack files with odd metadata


@pytest.mark.parametrize("fmt, version", [("onnx", 0), ("onnx", 2), ("onnx", "1"), ("onnx", None), ("onnx", 1.0),
                                          ("pt2", 2), ("pt2", None), ("pt2", True)])  # was: 1.0 and true taken
def test_load_another_format_version(fmt, version, files, tmp_path):
    edit = json_edit(format_version=version) if version is not None else json_edit(format_version=...)
    with_meta = onnx_with_meta if fmt == "onnx" else pt2_with_meta
    path = with_meta(files[fmt], tmp_path / f"v.{fmt}", edit)
    with pytest.raises(ValueError, match=rf"has pagedpack format_version {version!r}, this pagedpack reads 1"):
        LLM.from_exported(path)


# The metadata record as pagedpack wrote it (format_version 1) before the formats moved into their targets'
# packages (pagedpack.lowering.reference.pt2, .tp, pagedpack.lowering.onnx.export): its fields in the order
# written. The move left it as it was, so files written before load (checked by hand too: a .pt2 and an
# .onnx written by the code before the move serve the same greedy tokens). Since .pt2 exports carry recurrent
# layers, every file also has state_specs (after kv_cache_specs; [] without such layers), and since they carry
# LoRA inputs lora_specs (after state_specs; [] without enable_lora), which the old layout lacks: it still loads.
OLD_LAYOUT = {"pt2": ("format_version", "signature", "kv_cache_specs", "eos_token_ids", "max_model_len",
                      "vocab_size", "model_name", "tokenizer_files", "tensor_parallel", "cache_mutation"),
              "onnx": ("format_version", "signature", "kv_cache_specs", "eos_token_ids", "max_model_len",
                       "vocab_size", "model_name", "tokenizer_files", "attention", "cache_mutation")}


@pytest.mark.parametrize("fmt", sorted(OLD_LAYOUT))
def test_a_file_in_the_layout_written_before_the_formats_moved_loads(fmt, files, llm, tmp_path):
    def old_layout(text: str) -> str:
        meta = json.loads(text)
        assert meta.pop("state_specs") == meta.pop("lora_specs") == []
        assert tuple(meta) == OLD_LAYOUT[fmt]  # what this pagedpack writes is still that layout, but the specs
        return json.dumps({"format_version": 1, **{key: meta[key] for key in OLD_LAYOUT[fmt][1:]}})

    with_meta = onnx_with_meta if fmt == "onnx" else pt2_with_meta
    served = LLM.from_exported(with_meta(files[fmt], tmp_path / f"old.{fmt}", old_layout), num_blocks=64)
    prompts = random_prompts((3, 20), seed=12)
    assert reference(served, prompts) == reference(llm, prompts)


_SPEC = {"num_kv_heads": 2, "key_head_size": 16, "value_head_size": 16, "dtype": "float32"}
CORRUPT_METADATA = {  # edit -> the field the error names
    "not JSON": (lambda text: text[:-1], "pagedpack.json: expected JSON"),
    "a list": (lambda text: "[1, 2]", "pagedpack.json: expected a JSON object"),
    "no kv_cache_specs": (json_edit(kv_cache_specs=...), "kv_cache_specs: expected list"),
    "no signature": (json_edit(signature=...), "signature: expected list"),
    "no eos ids": (json_edit(eos_token_ids=...), "eos_token_ids: expected list"),
    "no tokenizer_files": (json_edit(tokenizer_files=...), None),  # optional: None is fine
    "unknown dtype": (json_edit(kv_cache_specs=[{**_SPEC, "dtype": "float99"}] * 2), "kv_cache_specs: expected"),
    "module as dtype": (json_edit(kv_cache_specs=[{**_SPEC, "dtype": "nn"}] * 2), "kv_cache_specs: expected"),
    "one layer short": (json_edit(kv_cache_specs=[_SPEC]), "signature: expected"),
    "max_model_len a string": (json_edit(max_model_len="512"), "max_model_len: expected int or null"),
    "vocab_size null": (json_edit(vocab_size=None), "vocab_size: expected int"),
    "eos ids strings": (json_edit(eos_token_ids=["2"]),
                        f"eos_token_ids: expected token ids in [0, vocab_size={VOCAB_SIZE}), got ['2']"),
    "tokenizer garbage": (json_edit(tokenizer_files={"tokenizer.json": "Z2FyYmFnZQ=="}),
                          "tokenizer_files: expected a saved tokenizer"),
    # was: taken (a wrong cache_mutation made a program whose caches are returned look in place, or the reverse)
    "no cache_mutation": (json_edit(cache_mutation=...), "cache_mutation: expected one of"),
    "cache_mutation unknown": (json_edit(cache_mutation="sideways"), "cache_mutation: expected one of"),
    "cache_mutation of the other format": (
        lambda text: json_edit(cache_mutation="in_place" if '"returned"' in text else "returned")(text),
        "cache_mutation: expected one of"),
    "attention unknown": (json_edit(attention="flash"), {"onnx": "attention: expected one of ['pagedpack', "
                                                                 "'com.microsoft'], got 'flash'",
                                                         "pt2": "pagedpack.json: expected the fields"}),
    "an unknown field": (json_edit(cache_salt="x"), "pagedpack.json: expected the fields"),
    "kv spec with an unknown key": (json_edit(kv_cache_specs=[{**_SPEC, "window": 4}] * 2), "kv_cache_specs: expected"),
    "eos outside the vocabulary": (json_edit(eos_token_ids=[2, VOCAB_SIZE]),
                                   f"eos_token_ids: expected token ids in [0, vocab_size={VOCAB_SIZE}), "
                                   f"got [{VOCAB_SIZE}]"),
    # was: RecursionError
    "nested too deeply": (lambda text: text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                          "pagedpack.json: expected JSON"),
    # was: loaded, and every answer naming the model (a 400 about stop strings) failed to encode: a 500
    "model name with a lone surrogate": (lambda text: json_edit(model_name="x")(text).replace('"x"', '"\\ud800"'),
                                         "pagedpack.json: expected JSON"),
    "tokenizer config nested too deeply": (
        json_edit(tokenizer_files={"tokenizer_config.json": base64.b64encode(b"[" * 10**5 + b"]" * 10**5).decode()}),
        "tokenizer_files: tokenizer_config.json: expected base64 JSON"),
}


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
@pytest.mark.parametrize("case", sorted(CORRUPT_METADATA))
def test_load_corrupt_metadata(fmt, case, files, tmp_path):
    # Regression: these raised KeyError/AttributeError/JSONDecodeError, or loaded and failed in generate.
    edit, message = CORRUPT_METADATA[case]
    message = message[fmt] if isinstance(message, dict) else message
    with_meta = onnx_with_meta if fmt == "onnx" else pt2_with_meta
    path = with_meta(files[fmt], tmp_path / f"m.{fmt}", edit)
    if message is None:
        assert LLM.from_exported(path, num_blocks=4).tokenizer is None
        return
    with pytest.raises(ValueError, match=re.escape(f"path: {str(path)!r} has invalid pagedpack metadata: {message}")):
        LLM.from_exported(path)


def test_load_metadata_disagreeing_with_the_graph(files, tmp_path):
    # Regression: a head count the graph does not have loaded, then failed inside onnxruntime.
    spec = {**_SPEC, "num_kv_heads": 3}
    path = onnx_with_meta(files["onnx"], tmp_path / "m.onnx", json_edit(kv_cache_specs=[spec, spec]))
    with pytest.raises(ValueError, match=r"kv_cache_specs: the metadata says key_cache_0 is torch.float32 "
                                         r"\[num_blocks, block_size, 3, 16\], its program takes torch.float32 "
                                         r"\[None, None, 2, 16\]"):
        LLM.from_exported(path)


def test_load_an_onnx_model_describing_recurrent_state(files, tmp_path):
    # metadata and signature consistent, as a file written by another exporter could be: the format carries no state
    state = StateSpec("conv_state", (64, 2), torch.float32, "model.layers.0.conv")
    edit = json_edit(state_specs=[{"kind": "conv_state", "shape": [64, 2], "dtype": "float32", "layer": state.layer}],
                     signature=step_input_names(2, [state]))
    path = onnx_with_meta(files["onnx"], tmp_path / "m.onnx", edit)
    with pytest.raises(ValueError, match=re.escape(f"path: {path!r}: state_specs: expected none (the onnx format "
                                                   "carries no recurrent state), got 1 of model.layers.0.conv")):
        LLM.from_exported(path)


def test_load_bfloat16_onnx_caches(files, tmp_path):
    spec = {**_SPEC, "dtype": "bfloat16"}
    path = onnx_with_meta(files["onnx"], tmp_path / "m.onnx", json_edit(kv_cache_specs=[spec, spec]))
    with pytest.raises(ValueError, match=r"kv_cache_specs: expected float32 or float16 caches .*bfloat16"):
        LLM.from_exported(path)


def test_load_a_com_microsoft_export(files, tmp_path):
    # The metadata check comes before the session: a real com.microsoft export (test_export_onnx)
    # and this relabelled one are refused alike.
    path = onnx_with_meta(files["onnx"], tmp_path / "ms.onnx", json_edit(attention="com.microsoft"))
    for load in (load_exported, LLM.from_exported):
        with pytest.raises(ValueError, match="com.microsoft.PagedAttention, which onnxruntime runs on its CUDA "
                                             "provider only; export with attention='pagedpack'"):
            load(path)


def test_export_without_max_model_len_needs_it_at_load(llm, files, tmp_path):
    path = onnx_with_meta(files["onnx"], tmp_path / "nolen.onnx", json_edit(max_model_len=None))
    with pytest.raises(ValueError, match="max_model_len: the model records no limit; pass max_model_len"):
        LLM.from_exported(path)
    served = LLM.from_exported(path, max_model_len=40, num_blocks=16)
    prompts = random_prompts((3, 41, 20), seed=12)
    outputs = served.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.error is None for o in outputs] == [True, False, True]
    assert "41 tokens, more than max_model_len=40" in outputs[1].error
    assert tokens(outputs)[0::2] == reference(llm, prompts[0::2])


# ---------------------------------------------------------------- from_exported: pool and limits


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size: expected an int >= 1, got 0"),
    (dict(block_size=-16), "block_size: expected an int >= 1, got -16"),
    (dict(block_size=16.0), "block_size: expected an int >= 1, got 16.0"),
    (dict(block_size="16"), "block_size: expected an int >= 1, got '16'"),
    (dict(block_size=True), "block_size: expected an int >= 1, got True"),
    (dict(num_blocks=0), "num_blocks: expected an int >= 1, got 0"),
    (dict(num_blocks=2.5), "num_blocks: expected an int >= 1, got 2.5"),
    (dict(num_blocks="8"), "num_blocks: expected an int >= 1, got '8'"),
    (dict(num_blocks=False), "num_blocks: expected an int >= 1, got False"),
    (dict(max_model_len=0), "max_model_len: expected an int >= 1, got 0"),
    (dict(max_model_len=1.5), "max_model_len: expected an int >= 1, got 1.5"),
    (dict(max_model_len="100"), "max_model_len: expected an int >= 1, got '100'"),
    (dict(max_model_len=513), r"max_model_len: expected 1 .. 512 \(the model's limit\), got 513"),
    (dict(kv_cache_memory=8191), r"kv_cache_memory: expected at least one block \(8192 bytes\), got 8191"),
    (dict(num_blocks=8, kv_cache_memory=1 << 20), "num_blocks, kv_cache_memory, memory_budget: expected at most one"),
    (dict(memory_budget="1GiB"), "memory_budget: an LLM served from an exported file has no step graph"),
    (dict(max_num_seqs=0), "max_num_seqs: expected an int >= 1, got 0"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens: expected an int >= 1, got -1"),
])
def test_from_exported_bad_pool_and_limits(files, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM.from_exported(files["onnx"], **kwargs)


@pytest.mark.parametrize("value", ["1 lot", "", True, float("nan"), float("inf"), 0, -5])
def test_from_exported_bad_kv_cache_memory(files, value):
    # Regression: non-finite numbers failed in arithmetic; True counted as 1 byte.
    with pytest.raises(ValueError, match=re.escape(f"kv_cache_memory: expected a positive number of bytes such as "
                                                   f"4294967296, '4GiB' or '512MB', got {value!r}")):
        LLM.from_exported(files["onnx"], kv_cache_memory=value)


def test_from_exported_bad_tokenizer_and_path_types(files):
    with pytest.raises(ValueError, match="tokenizer: expected a transformers tokenizer .*got int"):
        LLM.from_exported(files["onnx"], tokenizer=3)
    with pytest.raises(ValueError, match="tokenizer: cannot load '/no/such/tokenizer' as a transformers tokenizer"):
        LLM.from_exported(files["onnx"], tokenizer="/no/such/tokenizer")
    for bad in (None, 3, b"model.onnx"):
        with pytest.raises(TypeError, match="path: expected a non-empty str or os.PathLike"):
            LLM.from_exported(bad)


def test_a_failing_tokenizer_queues_nothing(files, llm):
    # Regression: requests before the failing prompt stayed queued and the next generate hit KeyError.
    class Failing:
        def __call__(self, text):
            raise RuntimeError("tokenizer down")

        def decode(self, ids, **kwargs):
            return ""

    served = LLM.from_exported(files["onnx"], tokenizer=Failing(), num_blocks=16)
    with pytest.raises(RuntimeError, match="tokenizer down"):
        served.generate([[1, 2, 3], "hi"], GREEDY, use_tqdm=False)
    assert not served.llm_engine.has_unfinished()
    assert reference(served, [[4, 5]]) == reference(llm, [[4, 5]])


def test_from_exported_pool_sizes(files, llm):
    # 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes = 512 bytes per token
    assert LLM.from_exported(files["onnx"], kv_cache_memory=1 << 20).num_blocks == (1 << 20) // (512 * 16)
    assert LLM.from_exported(files["onnx"], kv_cache_memory=1.5e5).num_blocks == int(1.5e5 // (512 * 16))
    assert LLM.from_exported(files["onnx"], block_size=8, kv_cache_memory=8192).num_blocks == 2
    assert LLM.from_exported(files["onnx"], kv_cache_memory="1MiB").num_blocks == (1 << 20) // (512 * 16)
    default = LLM.from_exported(files["onnx"], max_num_seqs=2)
    assert default.num_blocks == 2 * 512 // 16 and default.max_model_len == llm.max_model_len == 512


@pytest.mark.parametrize("block_size, num_blocks", [(1, 200), (7, 30), (5, 40)])
def test_odd_block_sizes_chosen_at_load_give_the_same_tokens(files, llm, block_size, num_blocks):
    prompts = random_prompts((1, 6, 7, 15, 33), seed=13)
    served = LLM.from_exported(files["onnx"], block_size=block_size, num_blocks=num_blocks)
    assert reference(served, prompts) == reference(llm, prompts)


# ---------------------------------------------------------------- generation through a loaded export


@pytest.fixture(scope="module")
def served(files):
    """The ONNX export behind onnxruntime, with the reference's pool."""
    return LLM.from_exported(files["onnx"], block_size=16, num_blocks=64)


def _assert_still_serves(served, llm):
    assert not served.llm_engine.has_unfinished()
    assert reference(served, [[3, 4, 5]]) == reference(llm, [[3, 4, 5]])


@pytest.mark.parametrize("bad", [-1, VOCAB_SIZE, 10**9])
def test_out_of_vocabulary_ids_are_refused_per_request(served, llm, bad):
    prompts = [[5, 6], [1, bad, 3], [7, 8, 9]]
    outputs = served.generate(prompts, GREEDY, use_tqdm=False)
    assert outputs[1].error and outputs[1].outputs[0].finish_reason == "error"
    assert f"expected token ids in [0, vocab_size={VOCAB_SIZE}), got {bad} at position 1" in outputs[1].error
    assert [o.error for o in outputs[0::2]] == [None, None]
    assert tokens(outputs)[0::2] == reference(llm, prompts[0::2])
    _assert_still_serves(served, llm)


def test_prompt_longer_than_max_model_len_is_refused_per_request(served, llm):
    prompts = [[5, 6], [1] * 513, [2] * 512, [7, 8, 9]]
    outputs = served.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert "prompt has 513 tokens, more than max_model_len=512" in outputs[1].error
    assert outputs[2].error is None  # exactly max_model_len: prefill fits, then stops at the limit
    assert [o.error for o in outputs[0::3]] == [None, None]
    assert tokens(outputs)[0::3] == reference(llm, prompts[0::3], SamplingParams(temperature=0.0, max_tokens=2))
    _assert_still_serves(served, llm)


def test_request_larger_than_the_whole_pool_is_refused_per_request(files, llm):
    small = LLM.from_exported(files["onnx"], block_size=16, num_blocks=2)
    prompts = [[1] * 40, [2, 3]]
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert "need 3 KV blocks of block_size=16, more than the whole pool of num_blocks=2" in outputs[0].error
    assert outputs[1].error is None and tokens(outputs)[1] == reference(llm, prompts[1:])[0]


@pytest.fixture(scope="module")
def crowd():
    """Twelve prompts, about twice what a 6-block pool holds at once."""
    return random_prompts((3, 17, 30, 9, 40, 25, 12, 33, 5, 20, 16, 31), seed=7)


PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.mark.parametrize("fmt, num_prompts, num_blocks", [("onnx", 12, 4), ("pt2", 4, 3)])  # .pt2: slower steps
def test_preemption_in_a_small_pool_gives_the_reference_tokens(files, llm, crowd, fmt, num_prompts, num_blocks):
    prompts = crowd[:num_prompts]
    small = LLM.from_exported(files[fmt], block_size=16, num_blocks=num_blocks)
    got = small.generate(prompts, PARAMS, use_tqdm=False)
    assert small.llm_engine.stats.num_preemptions > 0
    assert [o.error for o in got] == [None] * len(prompts)
    assert tokens(got) == reference(llm, prompts, PARAMS)
    assert small.llm_engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_chunked_prefill_with_a_tiny_token_budget_gives_the_reference_tokens(files, llm, crowd):
    narrow = LLM.from_exported(files["onnx"], block_size=16, num_blocks=16, max_num_batched_tokens=7,
                               max_num_seqs=2)
    assert reference(narrow, crowd[:5], PARAMS) == reference(llm, crowd[:5], PARAMS)


def test_seeded_sampling_gives_the_pytorch_tokens(files, llm, crowd):
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=s, max_tokens=10) for s in (1, 2, 1, 3)]
    want = reference(llm, crowd[:4], params)
    assert want[0] != want[2]  # same seed, different prompts
    for num_blocks in (64, 4):  # with and without preemption
        served = LLM.from_exported(files["onnx"], block_size=16, num_blocks=num_blocks)
        assert reference(served, crowd[:4], params) == want
        assert reference(served, crowd[:4], params) == want  # and again on the same LLM


def test_string_prompts_use_the_stored_tokenizer(served, llm):
    prompts = ["Hello", "The capital of France is"]
    got, want = served.generate(prompts, GREEDY, use_tqdm=False), llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [(o.prompt_token_ids, o.outputs[0].text) for o in got] == [(o.prompt_token_ids, o.outputs[0].text)
                                                                     for o in want]
    outputs = served.generate(["", "Hello"], GREEDY, use_tqdm=False)
    assert "the prompt is empty" in outputs[0].error and outputs[1].error is None


# ---------------------------------------------------------------- CLI: pagedpack export


def test_cli_export_without_out(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--format", "onnx"])
    assert exit_.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--format", "bogus"), ("--format", "ONNX"),
                                           ("--attention", "Pagedpack"), ("--attention", "flash")])
def test_cli_export_bad_choice(option, value, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--format", "onnx", option, value, "--out", str(tmp_path / "x.onnx")])
    assert exit_.value.code == 2
    assert f"argument {option}: invalid choice: '{value}'" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_cli_export_attention_with_pt2(capsys, tmp_path):
    assert main(["export", "--format", "pt2", "--attention", "com.microsoft", "--out", str(tmp_path / "x.pt2")]) == 2
    err = capsys.readouterr().err
    assert "pagedpack: error: attention: only with format 'onnx', got attention='com.microsoft' with 'pt2'" in err
    assert "Traceback" not in err and not os.listdir(tmp_path)


def test_cli_export_into_a_missing_directory(capsys, tmp_path):
    out = tmp_path / "missing" / "x.onnx"
    assert main(["export", "--format", "onnx", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"pagedpack: error: --out: expected a file in an existing directory, got '{out}'" in err
    assert not (tmp_path / "missing").exists()
