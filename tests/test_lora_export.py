"""A LoRA-enabled step program as a ``.pt2`` export (and as the compile cache's entry): adapters loaded
when the file is served give each request the greedy tokens of PEFT's merged model; metadata that does
not match the program's LoRA inputs, and the formats that carry none, are refused by name."""
import json
import shutil
import subprocess
import sys

import pytest
from test_lora import V, base_model, merged, save_adapter

from pagedpack import LLM, LoRARequest, SamplingParams
from pagedpack.compiler import compile_cache
from pagedpack.formats.export import META_FILE
from pagedpack.kernels import native

from conftest import hf_greedy, pt2_edited, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
ADAPTERS = ("qv", "all")  # ranks 2 and 8 (the largest: max_lora_rank=8)
SERVE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """``(checkpoint dir, .pt2 path, [(LoRARequest or None, reference model)], prompts)``: a tiny Llama
    saved as a checkpoint, exported with LoRA inputs, and two PEFT adapters of it."""
    folder = tmp_path_factory.mktemp("lora_export")
    model = base_model("llama")
    model.save_pretrained(folder / "checkpoint")
    llm = LLM(model, enable_lora=True, keep_source_model=True, block_size=16, num_blocks=64)
    path = llm.export(folder / "lora.pt2")
    cases = [(None, model)]
    for i, name in enumerate(ADAPTERS):
        adapter = save_adapter(model, name, folder, seed=i + 1)
        cases.append((LoRARequest(name, i + 1, adapter), merged(model, adapter)))
    prompts = random_prompts([7, 19, 4], seed=5, vocab=V)
    return folder / "checkpoint", path, cases, prompts


def assert_serves_adapters(llm, cases, prompts) -> None:
    """Every prompt under the base model and each adapter, in one batch: the reference's tokens."""
    requests = [(prompt, lora, reference) for prompt in prompts for lora, reference in cases]
    outputs = llm.generate([p for p, _, _ in requests], GREEDY, use_tqdm=False,
                           lora_request=[lora for _, lora, _ in requests])
    for (prompt, lora, reference), out in zip(requests, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens), (lora, len(prompt))


def test_a_lora_export_serves_adapters_loaded_at_serve_time(lora_setup):
    _, path, cases, prompts = lora_setup
    llm = LLM(path, **SERVE)
    assert len(llm.program.lora_specs) == 2 * 4  # per layer: QKV, o_proj, gate-up, down_proj
    assert_serves_adapters(llm, cases, prompts)
    # without enable_lora the same file runs the base model (each token's slot -1, one zeroed slot of rank 1)
    base = LLM(path, block_size=16, num_blocks=64)
    outputs = base.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(cases[0][1], p, 5) for p in prompts]


_SERVE_SCRIPT = """
import json, sys
from pagedpack import LLM, LoRARequest, SamplingParams
path, adapter, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(path, enable_lora=True, max_lora_rank=8, num_blocks=32)
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False,
                       lora_request=LoRARequest("all", 1, adapter))
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


def test_a_lora_export_serves_in_a_fresh_process(lora_setup, tmp_path):
    """Only pagedpack imported (no capture, no passes), one slot (max_loras's default)."""
    _, path, cases, prompts = lora_setup
    lora, reference = cases[2]
    command = [sys.executable, "-c", _SERVE_SCRIPT, path, lora.lora_path, json.dumps(prompts)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [hf_greedy(reference, p, 5) for p in prompts]


def _edit_lora_specs(edit):
    def edit_meta(data: bytes) -> bytes:
        meta = json.loads(data)
        edit(meta["lora_specs"])
        return json.dumps(meta).encode()
    return {f"extra/{META_FILE}": edit_meta}


@pytest.mark.parametrize("edit, message", [
    (lambda specs: specs[0].update(in_features=32), r"lora_specs: the metadata says lora_a_0 is torch.float32 "
                                                    r"\[max_loras, S \* max_rank, 32\], its program takes"),
    (lambda specs: specs[0].update(dtype="bfloat16"), "lora_specs: the metadata says lora_a_0 is torch.bfloat16"),
    (lambda specs: specs[0].update(slice_sizes=[32, 32, 64]),
     r"lora_specs: the metadata says lora_b_0 holds slices of \[32, 32, 64\] outputs, its program's lora_expand "
     r"splits it into \[64, 32, 32\]"),
    (lambda specs: specs[1].update(slice_sizes=[64, 0]), "invalid pagedpack metadata: lora_specs: expected"),
    (lambda specs: specs.pop(), "invalid pagedpack metadata: signature: expected"),
], ids=["in_features", "dtype", "slice_sizes", "a slice per module", "one spec fewer"])
def test_metadata_disagreeing_with_the_lora_inputs_is_refused(lora_setup, tmp_path, edit, message):
    path = pt2_edited(lora_setup[1], tmp_path / "edited.pt2", _edit_lora_specs(edit))
    with pytest.raises(ValueError, match=message):
        LLM(path, **SERVE)


def test_onnx_and_tensor_parallel_exports_refuse_lora_and_enable_lora_needs_lora_inputs(lora_setup, tmp_path):
    model = base_model("llama")
    llm = LLM(model, enable_lora=True, keep_source_model=True, block_size=16, num_blocks=16)
    with pytest.raises(ValueError, match="enable_lora: .* the onnx format does not carry"):
        llm.export(tmp_path / "m.onnx", format="onnx")
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters are not sharded over tensor-parallel ranks"):
        llm.export(tmp_path / "m.json", tensor_parallel_size=2)
    plain = LLM(model, keep_source_model=True, block_size=16, num_blocks=16).export(tmp_path / "plain.pt2")
    with pytest.raises(ValueError, match=r"enable_lora: .*plain.pt2' \(format pt2\) takes no LoRA inputs"):
        LLM(plain, **SERVE)


def test_the_compile_cache_serves_enable_lora_from_its_entry(lora_setup, tmp_path, monkeypatch, children):
    """A child exports the LoRA-enabled entry (keyed on enable_lora); a second LLM uses it, no child."""
    checkpoint, _, cases, prompts = lora_setup
    library = native.library_path()  # this process's build, so that the child does not compile it
    if library is not None:
        shutil.copytree(library.parent, tmp_path / "native" / library.parent.name)
    monkeypatch.setenv("PAGEDPACK_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGEDPACK_COMPILE_CACHE", "1")
    started = children
    LLM(str(checkpoint), **SERVE)
    (entry,) = (tmp_path / "compiled").iterdir()
    assert len(started) == 1 and json.loads((entry / "info.json").read_text())["key"]["enable_lora"] is True
    llm = LLM(str(checkpoint), **SERVE)
    assert len(started) == 1 and llm.report.notes[-1].startswith(f"loaded from {entry / 'step.pt2'}; ")
    assert_serves_adapters(llm, cases, prompts)
    stamp = compile_cache.checkpoint_stamp(str(checkpoint))
    assert compile_cache._entry_dir(stamp, None, False) != entry  # the base model's entry is another one


def test_the_cli_exports_a_model_that_serves_adapters(tmp_path, capsys):
    from pagedpack.cli import main

    path = tmp_path / "tiny_lora.pt2"
    assert main(["export", "--enable-lora", "--out", str(path)]) == 0
    assert f"wrote {path} (pt2)" in capsys.readouterr().out
    assert LLM(str(path), enable_lora=True, num_blocks=16).program.lora_specs  # refused were there no LoRA inputs
