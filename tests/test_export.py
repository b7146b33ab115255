"""Export (``.pt2`` and ONNX): the saved step program, loaded in a fresh process, serves the
runtime as the un-exported step graph does (tokens on the 12-prompt batch, logits of decode and
chunked-prefill steps, the KV caches it leaves)."""
import json
import subprocess
import sys

import pytest
import torch

from pagedpack import LLM, SamplingParams
from pagedpack.compiler.program import load_exported
from pagedpack.lowering.onnx.export import export_onnx
from pagedpack.lowering.reference.pt2 import export_pt2
from pagedpack.lowering.targets import get_format
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.request import Request

from conftest import random_prompts, run_cli, run_step

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

# Runs in a fresh interpreter: `import pagedpack` alone must make the archive loadable.
_GENERATE_SCRIPT = """
import json, sys
import pagedpack
from pagedpack import LLM, SamplingParams
path, prompts_file = sys.argv[1:]
llm = LLM.from_exported(path, block_size=16, max_num_batched_tokens=256)
prompts = json.load(open(prompts_file))
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
print(json.dumps({"note": llm.program.note, "imported": sorted(m for m in sys.modules if m.startswith("transformers")),
                  "outputs": [[o.error, o.outputs[0].token_ids] for o in outputs]}))
"""


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


EXPORTERS = {"pt2": export_pt2, "onnx": export_onnx}


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=16, max_num_batched_tokens=256, keep_source_model=True)


@pytest.fixture(scope="module", params=sorted(EXPORTERS))
def archive(request, llm, tmp_path_factory):
    """``(llm, path)``: the tiny Llama exported in each format."""
    path = tmp_path_factory.mktemp("export") / f"tiny-llama.{request.param}"
    assert llm.export(path, format=request.param) == str(path)
    return llm, str(path)


def test_fresh_process_generates_the_same_tokens(archive, mixed_prompts, tmp_path):
    llm, path = archive
    expected = [o.outputs[0].token_ids for o in llm.generate(mixed_prompts, GREEDY, use_tqdm=False)]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(mixed_prompts))
    result = subprocess.run([sys.executable, "-c", _GENERATE_SCRIPT, path, str(prompts_file)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served["imported"] == []  # serving a file needs no transformers (nor its memory)
    if path.endswith(".pt2"):  # the archive's program runs with the CPU kernels, as the captured model does
        assert served["note"].startswith(f"loaded from {path}; cpu lowering: "), served["note"]
    got = served["outputs"]
    assert [error for error, _ in got] == [None] * len(mixed_prompts)
    for prompt, want, (_, tokens) in zip(mixed_prompts, expected, got):
        assert tokens == want, f"prompt length {len(prompt)}"


def test_archive_metadata_and_runtime_block_size(archive):
    llm, path = archive
    step = load_exported(path)
    assert step.kv_cache_specs == llm.rewritten.kv_cache_specs
    assert step.description.eos_token_ids == llm.description.eos_token_ids
    assert step.description.max_model_len == llm.max_model_len and step.description.vocab_size == llm.vocab_size
    # The block size is chosen at load time, not baked in at export.
    prompts = random_prompts((5, 40), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    loaded = LLM.from_exported(path, block_size=8, num_blocks=32)
    assert loaded.report is None and loaded.tokenizer is None  # tiny_model instance: no tokenizer
    assert [o.outputs[0].token_ids for o in loaded.generate(prompts, params, use_tqdm=False)] == want


def _decode_and_chunked_steps(llm) -> list[torch.Tensor]:
    """Prefills, then a decode step over sequences of different lengths, then a step with a
    chunked prefill resuming mid-block beside a decode and a fresh prefill."""
    a, b, c, d = (Request(str(i), p, GREEDY) for i, p in enumerate(random_prompts((9, 33, 70, 17), seed=5)))
    out = [run_step(llm, [(a, 9), (b, 33), (c, 21)])]  # c: 21 of 70 cached (mid-block)
    a.append_output(7, 512)
    b.append_output(11, 512)
    out.append(run_step(llm, [(a, 1), (b, 1)]))  # decode, KV lengths 10 and 34
    a.append_output(3, 512)
    out.append(run_step(llm, [(c, 30), (a, 1), (d, 17)]))  # chunked prefill + decode + fresh prefill
    return out


@pytest.fixture(scope="module")
def stepped(model):
    """The un-exported step graph's logits of :func:`_decode_and_chunked_steps` and the KV caches they
    leave: one capture for both formats."""
    reference = LLM(model, block_size=16, num_blocks=64)
    return _decode_and_chunked_steps(reference), reference.llm_engine.runner.kv_caches


def test_decode_and_chunked_prefill_logits_match(archive, stepped):
    _, path = archive
    want, caches = stepped
    loaded = LLM.from_exported(path, block_size=16, num_blocks=64)
    got = _decode_and_chunked_steps(loaded)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    # The loaded program left the runner with the same caches (pt2: written in place; onnx:
    # the returned caches replaced the runner's).
    for w, g in zip(caches, loaded.llm_engine.runner.kv_caches):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_bad_path_and_format(tmp_path, llm, fmt):
    export = EXPORTERS[fmt]
    with pytest.raises(ValueError, match="no such file"):
        LLM.from_exported(tmp_path / f"missing.{fmt}")
    junk = tmp_path / f"junk.{fmt}"
    junk.write_bytes(b"neither a zip archive nor a protobuf")
    with pytest.raises(ValueError, match="is not a file of any registered export format"):
        load_exported(junk)
    with pytest.raises(ValueError, match="no such directory"):
        export(llm.rewritten, tmp_path / "nope" / f"x.{fmt}")
    with pytest.raises(ValueError, match="expected a RewrittenModel"):
        export(torch.nn.Linear(2, 2), tmp_path / f"x.{fmt}")
    assert get_format(fmt)[0].name == fmt
    with pytest.raises(ValueError, match="format: expected one of"):
        get_format("tflite")


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_cli_export(tmp_path, capsys, fmt):
    out = tmp_path / f"m.{fmt}"
    code, stdout, stderr = run_cli(capsys, "export", "--format", fmt, "--out", str(out))
    assert code == 0, stderr
    assert f"run it with LLM('{out}'" in stdout
    step = load_exported(out)
    # the built-in model's byte-level tokenizer
    assert step.description.tokenizer is not None and step.description.eos_token_ids
