"""Multi-LoRA serving against PEFT's merged models: each request's greedy tokens are those of the
model PEFT merges with its adapter (``merge_and_unload``), run alone with ``transformers``."""
import copy

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model

from pagedpack import LLM, LoRARequest, SamplingParams
from pagedpack.models.capture import capture
from pagedpack.passes.lora import add_lora
from pagedpack.passes.pipeline import rewrite
from pagedpack.step.contract import lora_input_names

from conftest import hf_greedy, random_prompts

V = 258
_BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
CONFIGS = {
    "llama": T.LlamaConfig(**_BASE),
    "qwen2": T.Qwen2Config(**_BASE),
    "gemma3": T.Gemma3TextConfig(**_BASE, head_dim=16, sliding_window=24,
                                 layer_types=["sliding_attention", "full_attention"]),
}
# (rank, alpha, targets, rslora): a few layers, the attention only, every linear with rank-stabilized scaling
ADAPTERS = {
    "qv": (2, 4, ["q_proj", "v_proj"], False),
    "mlp": (4, 16, ["o_proj", "gate_proj", "down_proj"], False),
    "all": (8, 8, "all-linear", True),
}
MAX_TOKENS = 6


def base_model(family: str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(CONFIGS[family]).eval()


def save_adapter(model: torch.nn.Module, name: str, directory, seed: int) -> str:
    """A random PEFT adapter (B non-zero) of ``ADAPTERS[name]`` on a copy of ``model``, saved under ``directory``."""
    rank, alpha, targets, rslora = ADAPTERS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                               use_rslora=rslora, init_lora_weights=False))
    path = str(directory / name)
    peft.save_pretrained(path)
    return path


def merged(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """PEFT's own merge of the adapter at ``path`` into a copy of ``model``: the reference."""
    return PeftModel.from_pretrained(copy.deepcopy(model), path).merge_and_unload().eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def served(request, tmp_path_factory):
    """``(llm, {adapter name: (LoRARequest, merged reference)}, base reference)`` of one family: two
    slots for three adapters (so they swap), chunked prefill, prefix caching on."""
    model = base_model(request.param)
    directory = tmp_path_factory.mktemp(f"adapters_{request.param}")
    adapters = {}
    for i, name in enumerate(sorted(ADAPTERS)):
        path = save_adapter(model, name, directory, seed=i + 1)
        adapters[name] = (LoRARequest(name, i + 1, path), merged(model, path))
    reference = copy.deepcopy(model)
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=16, num_blocks=256,
              max_num_batched_tokens=40, enable_prefix_caching=True)
    return llm, adapters, reference


def expected(served, prompt, name) -> list[int]:
    _, adapters, reference = served
    return hf_greedy(reference if name is None else adapters[name][1], prompt, MAX_TOKENS)


def test_the_pass_gives_every_decoder_linear_a_slot_input():
    model = base_model("llama")
    rewritten = rewrite(capture(model))
    specs = add_lora(rewritten.graph_module, model)
    assert rewritten.input_names[-len(lora_input_names(specs)):] == lora_input_names(specs)
    merged_qkv = [s for s in specs if len(s.modules) == 3]
    assert [m.rsplit(".", 1)[1] for m in merged_qkv[0].modules] == ["q_proj", "k_proj", "v_proj"]
    assert merged_qkv[0].slice_sizes == (64, 32, 32)
    modules = {m for s in specs for m in s.modules}
    assert len(modules) == 2 * 7 and not any("lm_head" in m for m in modules)


def test_a_mixed_batch_gives_each_request_its_merged_model_s_tokens(served):
    llm, adapters, _ = served
    shared = random_prompts([24], seed=3, vocab=V)[0]
    # the same prompt under every adapter and the base (a prefix-cache hit across them would be wrong),
    # then prompts longer than a step's 40 tokens (chunked) and short ones
    prompts = [shared] * 4 + random_prompts([70, 5, 33, 12, 50, 9], seed=4, vocab=V)
    names = [None, "qv", "mlp", "all", "all", None, "qv", "mlp", "qv", "all"]
    llm.generate([shared], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks cached for the base model
    loras = [None if n is None else adapters[n][0] for n in names]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False,
                           lora_request=loras)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.error is None
        assert out.outputs[0].token_ids == expected(served, prompt, name), (name, len(prompt))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_arrival_order_and_adapter_mix(served, data):
    llm, adapters, _ = served
    n = data.draw(st.integers(1, 6), label="requests")
    lens = data.draw(st.lists(st.integers(1, 60), min_size=n, max_size=n), label="prompt lengths")
    names = data.draw(st.lists(st.sampled_from([None, *sorted(ADAPTERS)]), min_size=n, max_size=n), label="adapters")
    prompts = random_prompts(lens, seed=data.draw(st.integers(0, 99), label="seed"), vocab=V)
    loras = [None if name is None else adapters[name][0] for name in names]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False,
                           lora_request=loras)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.outputs[0].token_ids == expected(served, prompt, name), (name, len(prompt))


def test_an_adapter_is_refused_without_enable_lora(tmp_path):
    model = base_model("llama")
    path = save_adapter(model, "qv", tmp_path, seed=1)
    llm = LLM(model, num_blocks=64)
    with pytest.raises(ValueError, match="lora_request: this engine serves no LoRA adapters"):
        llm.generate([[1, 2, 3]], lora_request=LoRARequest("qv", 1, path), use_tqdm=False)


def test_one_id_cannot_name_two_adapters(served):
    llm, adapters, _ = served
    request = adapters["qv"][0]
    llm.llm_engine.add_lora(request)
    other = LoRARequest("other", request.lora_int_id, adapters["mlp"][0].lora_path)
    with pytest.raises(ValueError, match=f"lora_request.lora_int_id: {request.lora_int_id} serves 'qv'"):
        llm.generate([[1, 2, 3]], lora_request=other, use_tqdm=False)


@pytest.mark.parametrize("field, value, message", [
    ("lora_name", "", "lora_request.lora_name"),
    ("lora_int_id", 0, "lora_request.lora_int_id"),
    ("lora_path", "", "lora_request.lora_path"),
])
def test_lora_request_fields_are_checked(field, value, message):
    given = {"lora_name": "a", "lora_int_id": 1, "lora_path": "/x", field: value}
    with pytest.raises(ValueError, match=message):
        LoRARequest(**given)


@pytest.mark.parametrize("kwargs, message", [
    (dict(target="onnx"), "enable_lora: the onnx target does not run LoRA adapters"),
    (dict(tensor_parallel_size=2), "enable_lora: LoRA adapters are not sharded over tensor-parallel ranks"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras: expected at least max_loras=4"),
])
def test_what_lora_does_not_run_with_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(base_model("llama"), enable_lora=True, num_blocks=64, **kwargs)


def test_a_running_request_keeps_its_adapter_when_it_is_removed_and_its_id_reused(served, tmp_path):
    """The adapter is removed and its folder deleted after the request's first step, and its id then
    serves other files: the running request still gets its own adapter's tokens (it holds the weights,
    the stepping thread reads no file), and the id's new requests get the new adapter's."""
    import shutil

    llm, adapters, _ = served
    engine = llm.llm_engine
    shutil.copytree(adapters["qv"][0].lora_path, tmp_path / "qv")
    first = LoRARequest("moving", 99, str(tmp_path / "qv"))
    prompt = random_prompts([20], seed=7, vocab=V)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine.add_request("running", prompt, params, made=engine.make_request("running", prompt, params, first))
    tokens = {"running": list(engine.step()[0].outputs[0].token_ids)}
    assert engine.remove_lora(99)
    shutil.rmtree(tmp_path / "qv")
    second = LoRARequest("moved", 99, adapters["mlp"][0].lora_path)
    engine.add_request("later", prompt, params, made=engine.make_request("later", prompt, params, second))
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert tokens == {"running": expected(served, prompt, "qv"), "later": expected(served, prompt, "mlp")}


def test_a_name_or_id_given_other_files_never_reads_the_old_adapter_s_cached_blocks(served, tmp_path):
    """From an adversarial trial: the prefix cache was keyed by the adapter's name, so a name unloaded and
    loaded again from other files (or under another id) got the old adapter's cached KV blocks."""
    llm, adapters, _ = served
    prompt = random_prompts([48], seed=11, vocab=V)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = LoRARequest("same", 50, adapters["qv"][0].lora_path)
    assert llm.generate([prompt], params, lora_request=first, use_tqdm=False)[0].outputs[0].token_ids == \
        expected(served, prompt, "qv")
    assert llm.llm_engine.remove_lora(50)
    for again in (LoRARequest("same", 50, adapters["mlp"][0].lora_path),
                  LoRARequest("same", 51, adapters["mlp"][0].lora_path)):
        out = llm.generate([prompt], params, lora_request=again, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected(served, prompt, "mlp")


def test_a_folder_changed_since_its_first_load_is_refused(tmp_path):
    """Dropped from host memory (max_cpu_loras), an adapter is read again: a config or weights file
    changed since is refused (its digest), not served as another adapter under the same id."""
    import json
    import shutil

    model = base_model("llama")
    paths = {name: save_adapter(model, name, tmp_path, seed=i) for i, name in enumerate(("qv", "mlp"))}
    llm = LLM(model, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, num_blocks=64)
    moving = LoRARequest("moving", 1, str(tmp_path / "moving"))
    shutil.copytree(paths["qv"], moving.lora_path)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    assert llm.generate([[1, 2, 3]], params, lora_request=moving, use_tqdm=False)[0].error is None
    llm.generate([[1, 2, 3]], params, lora_request=LoRARequest("other", 2, paths["mlp"]), use_tqdm=False)
    config = json.loads((tmp_path / "moving" / "adapter_config.json").read_text())
    (tmp_path / "moving" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 800}))
    with pytest.raises(ValueError, match="lora_request 'moving': .*changed since it was first loaded as id 1"):
        llm.generate([[1, 2, 3]], params, lora_request=moving, use_tqdm=False)


def test_an_adapter_a_request_holds_is_taken_again_not_read_again(served):
    """Dropped from host memory while a request holds it, an adapter named again is that copy (one copy,
    one slot), not a second read of its files."""
    llm, adapters, _ = served
    manager = llm.llm_engine.lora
    held = manager.adapter(adapters["qv"][0])
    for name in ("mlp", "all"):  # max_cpu_loras=2: qv is dropped
        manager.adapter(adapters[name][0])
    assert adapters["qv"][0].lora_int_id not in [r.lora_int_id for r in manager.list_loras()]
    assert manager.adapter(adapters["qv"][0]) is held


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_lora_rank=1024), "max_lora_rank: expected at most 512"),
    (dict(max_loras=64, max_lora_rank=512), r"max_loras, max_lora_rank: 64 slots of rank 512 take \d+ bytes"),
])
def test_slots_beyond_the_machine_are_refused_before_they_are_allocated(kwargs, message, monkeypatch):
    import pagedpack.runtime.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda: 64 << 20)
    with pytest.raises(ValueError, match=message):
        LLM(base_model("llama"), enable_lora=True, num_blocks=64, **kwargs)


def test_a_lora_request_sha256_is_hexadecimal():
    with pytest.raises(ValueError, match="lora_request.sha256: expected 64 hexadecimal digits"):
        LoRARequest("a", 1, "/x", sha256=5)
