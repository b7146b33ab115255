"""Family configs read the way transformers reads them, and what a model directory may lack."""

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig, GPT2Config, LlamaConfig, MptConfig, Phi3Config
from transformers.models.bloom import BloomForCausalLM

from pagedpack import LLM, SamplingParams
from pagedpack.models import capture as capture_module
from pagedpack.models.loading import eos_token_ids, max_model_len
from pagedpack.models.tiny import VOCAB_SIZE, tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer
from pagedpack.step.contract import UnsupportedModelError

from conftest import hf_greedy, run_cli

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


@pytest.mark.parametrize("config, limit", [
    (LlamaConfig(max_position_embeddings=777), 777),
    (GPT2Config(n_positions=333), 333),            # GPT-2's own field
    (MptConfig(max_seq_len=555), 555),             # MPT's own field
    (FalconConfig(max_position_embeddings=444), 444),
])
def test_max_model_len_is_the_familys_own_field(config, limit):
    assert max_model_len(config) == (limit, None)


def test_alibi_models_without_a_position_limit_get_the_default_with_a_note():
    limit, note = max_model_len(BloomConfig())
    assert limit == 2048 and "no position limit" in note


def test_bloom_loads_with_and_without_max_model_len(capture_once):
    # Regression: AttributeError 'max_position_embeddings' from llm.py before the pass ran.
    model = BloomForCausalLM(BloomConfig(vocab_size=VOCAB_SIZE, hidden_size=64, n_layer=2, n_head=4)).eval()
    assert LLM(model, max_model_len=256, num_blocks=8).max_model_len == 256
    llm = LLM(model, num_blocks=8)
    assert llm.max_model_len == 2048 and any("no position limit" in n for n in llm.report.notes)


def test_eos_id_0_in_the_generation_config_wins_over_the_config():
    model = tiny_model("llama")
    model.config.eos_token_id, model.generation_config.eos_token_id = 2, 0
    assert eos_token_ids(model) == [0]
    prompt = [5, 6, 7]
    first = hf_greedy(model, prompt, 1)[0]
    with torch.no_grad():  # swap the LM-head rows of tokens 0 and `first`: 0 becomes the greedy choice
        model.lm_head.weight[[0, first]] = model.lm_head.weight[[first, 0]]
    (out,) = LLM(model, num_blocks=8).generate([prompt], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 5) == [0]
    assert out.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def weights_only_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights-only")
    tiny_model("qwen2").save_pretrained(path)  # config + weights, no tokenizer files
    return str(path)


def test_a_directory_without_tokenizer_files_loads_and_takes_token_ids(weights_only_dir):
    llm = LLM(weights_only_dir, num_blocks=16)
    assert llm.tokenizer is None
    (out,) = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(weights_only_dir).eval()
    assert out.outputs[0].token_ids == hf_greedy(reference, [1, 2, 3], 5)
    with pytest.raises(ValueError, match=r"prompts: got a string but the model \(.*weights-only.*\) has no tokenizer"
                                         r".*tokenizer=.*--tokenizer"):
        llm.generate(["Hello"], GREEDY)
    tokenizer = byte_level_tokenizer()
    with_tokenizer = LLM(weights_only_dir, num_blocks=16, tokenizer=tokenizer)
    (out,) = with_tokenizer.generate(["Hello"], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == tokenizer("Hello").input_ids
    expected = hf_greedy(reference, out.prompt_token_ids, 5)
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_cli_export_and_tokenizer_flag_on_a_directory_without_tokenizer_files(weights_only_dir, tmp_path, capsys):
    tokenizer_dir = tmp_path / "tok"
    byte_level_tokenizer().save_pretrained(tokenizer_dir)
    code, _, stderr = run_cli(capsys, "export", "--model", weights_only_dir, "--out", str(tmp_path / "m.pt2"))
    assert code == 0, stderr
    code, stdout, stderr = run_cli(capsys, "generate", "--model", weights_only_dir, "--tokenizer", str(tokenizer_dir),
                                   "--prompt", "Hi", "--max-tokens", "3")
    assert code == 0 and "1 (0 failed)" in stdout, stderr


def test_dynamic_ntk_rope_is_refused_naming_the_rope_type():
    model = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="rope_type='dynamic': dynamic-NTK RoPE"):
        LLM(model, num_blocks=8)


def test_longrope_is_refused_naming_the_rope_type():
    """From an adversarial trial: Phi-3's LongRoPE picks its factors from the longest position of the
    call, so a 2-token prompt's tokens changed with the 600-token prompt beside it in a step."""
    config = Phi3Config(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=2048, pad_token_id=0,
                          original_max_position_embeddings=512,
                          rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="rope_type='longrope': LongRoPE"):
        LLM(model, num_blocks=8)


def test_a_data_dependent_capture_failure_is_an_unsupported_model_error_with_the_cause(monkeypatch):
    monkeypatch.setattr(capture_module, "_CALL_DEPENDENT_ROPE", {})  # let export meet the guard itself
    model = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="data-dependent choice") as err:
        capture_module.capture(model)
    assert type(err.value.__cause__).__name__ == "GuardOnDataDependentSymNode"


def test_a_bfloat16_model_is_refused_by_the_onnx_functions_up_front(tmp_path):
    llm = LLM(tiny_model("llama", dtype=torch.bfloat16), num_blocks=4)
    with pytest.raises(ValueError, match="attention: 'pagedpack' functions take float32 or float16.*bfloat16"):
        llm.export(tmp_path / "m.onnx", format="onnx")
    assert not list(tmp_path.iterdir())
