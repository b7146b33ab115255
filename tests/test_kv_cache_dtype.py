"""``kv_cache_dtype``: the KV cache stored in another dtype than the model's, or quantized.

The reference is the unmodified ``transformers`` model with its keys and values as the cache holds
them (rounded to the KV dtype, or quantized per row and scaled back, written plainly here) before
attention (an attention function registered under another name), one sequence at a time.
"""
import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pagedpack import LLM, SamplingParams
from pagedpack.engine_args import EngineArgs
from pagedpack.lowering.targets import get_target
from pagedpack.models.tiny import default_model
from pagedpack.runtime.request import Request

from conftest import random_prompts, run_step, snapshot
from test_families import _BASE, WINDOW

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _stored(x: torch.Tensor, dtype) -> torch.Tensor:
    """What a cache of ``dtype`` gives back for ``x [..., head_dim]``: rounded to a float dtype, or
    per row scaled by max |x| / qmax, rounded to the 1-byte dtype and scaled back."""
    if dtype not in QMAX:
        return x.to(dtype).float()
    scale = x.float().abs().amax(-1, keepdim=True) / QMAX[dtype]
    scale = torch.where(scale > 0, scale, 1.0)
    q = x.float() / scale
    q = q.round().clamp(-127, 127) if dtype == torch.int8 else q.to(dtype).float()
    return q * scale


def _stored_kv_attention(dtype):
    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, _stored(key, dtype), _stored(value, dtype), attention_mask,
                                      **kwargs)
    return attention


def _reference_logits(model, prompt, kv_dtype) -> torch.Tensor:
    """The model's last-token logits with its K/V as a cache of ``kv_dtype`` holds them (None: as they are)."""
    name = "sdpa" if kv_dtype is None else f"sdpa_kv_{kv_dtype}".replace("torch.", "")
    if kv_dtype is not None:
        AttentionInterface.register(name, _stored_kv_attention(kv_dtype))
        AttentionMaskInterface.register(name, sdpa_mask)  # else no mask at all (no sliding windows)
    model.config._attn_implementation = name
    with torch.no_grad():
        return model(torch.tensor([prompt]), use_cache=False).logits[0, -1]


@pytest.fixture(scope="module")
def tiny():
    return default_model()[0]


@pytest.fixture(scope="module")
def auto(tiny):
    """An fp32 cache, its source kept (for plans and exports)."""
    return LLM(tiny, num_blocks=32, keep_source_model=True)


@pytest.fixture(scope="module")
def half(tiny):
    return LLM(tiny, num_blocks=32, kv_cache_dtype="bfloat16")


KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _gemma3():
    """A tiny Gemma-3: a sliding-window layer (window 24) and a full one, head_dim 16."""
    config = transformers.Gemma3TextConfig(**dict(_BASE, head_dim=16, sliding_window=WINDOW,
                                                  layer_types=["sliding_attention", "full_attention"]))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


# float16 and fp8_e4m3 differ from these only in the element type, which test_kv_quant_ops reads back exactly
@pytest.mark.parametrize(("family", "name"), [("llama", "bfloat16"), ("llama", "int8"), ("llama", "fp8_e5m2"),
                                              ("gemma3", "int8")])
def test_logits_of_mixed_steps_are_the_model_with_stored_kv(tiny, family, name):
    """Prefills, a decode and a chunked prefill in one step, over caches of ``kv_dtype`` (the native
    kernels; test_kv_quant_ops holds both kernel sets to the same reference at the op level)."""
    kv_dtype = KV_DTYPES[name]
    model = tiny if family == "llama" else _gemma3()
    reference = snapshot(model)
    llm = LLM(model, block_size=16, num_blocks=64, kv_cache_dtype=name)
    assert {c.dtype for c in llm.llm_engine.runner.kv_caches} == {kv_dtype}
    fresh, decoding, chunked = (Request(str(i), p, GREEDY) for i, p in enumerate(random_prompts((37, 21, 70), seed=3)))
    run_step(llm, [(decoding, 20), (chunked, 21)])
    logits = run_step(llm, [(fresh, 37), (decoding, 1), (chunked, 30)])
    for row, request, length in zip(logits, (fresh, decoding, chunked), (37, 21, 51)):
        prompt = request.prompt_token_ids[:length]
        exact = _reference_logits(reference, prompt, None)
        rounded = _reference_logits(reference, prompt, kv_dtype)
        # the reference's own error (the stored K/V's) is reproduced, not just matched in size: an fp32
        # cache would sit at ratio 1, a wrong scale far above; a rounding that flips where the two
        # sides' K/V differ by an fp32 step moves a few elements (measured ratios 0 - 0.04)
        own = (rounded - exact).abs().max()
        assert own > 0 and (row - rounded).abs().max() <= 0.25 * own


def test_the_pool_the_plan_and_the_stats_count_the_kv_dtype(auto, half):
    assert half.bytes_per_token * 2 == auto.bytes_per_token
    assert half.llm_engine.runner.kv_cache_bytes * 2 == auto.llm_engine.runner.kv_cache_bytes
    plans = {name: auto.plan_memory("64MiB", kv_cache_dtype=name) for name in ("auto", "float32", "bfloat16", "int8")}
    assert plans["auto"].num_blocks == plans["float32"].num_blocks
    # int8: one byte a value and 4 for each (token, head) row's scale
    specs = auto.program.kv_cache_specs
    assert plans["int8"].kv_bytes_per_token == sum(s.num_kv_heads * (s.key_head_size + s.value_head_size + 8)
                                                   for s in specs)
    # the same budget less weights and activations, over each dtype's bytes per block
    free = plans["auto"].memory - plans["auto"].weight_bytes - plans["auto"].activation_bytes
    for plan in plans.values():
        assert plan.num_blocks == free // (plan.kv_bytes_per_token * auto.block_size)
    assert plans["bfloat16"].num_blocks >= 2 * plans["auto"].num_blocks
    assert plans["int8"].num_blocks >= 3 * plans["auto"].num_blocks
    half.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    stats = half.get_stats()
    assert stats.kv_cache_dtype == "bfloat16"
    assert stats.kv_cache_bytes_per_block == half.bytes_per_token * half.block_size


def test_greedy_tokens_with_prefix_caching_and_preemption(tiny):
    """Prefix hits, copy-on-write forks and preemption over an int8 pool (the scales move with the
    blocks): each prompt's tokens are those it gets alone, without prefix caching."""
    prompts = random_prompts((40, 40, 9, 33), seed=5)
    prompts[1][:32] = prompts[0][:32]  # a shared prefix of two blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, n=2)
    single = LLM(tiny, block_size=16, num_blocks=32, kv_cache_dtype="int8", enable_prefix_caching=False)
    alone = [single.generate([p], params, use_tqdm=False)[0] for p in prompts]
    llm = LLM(tiny, block_size=16, num_blocks=12, kv_cache_dtype="int8")  # too few blocks: preemption
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0 and llm.get_stats().prefix_cache_hits > 0
    for got, want in zip(outputs, alone, strict=True):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \['auto', .*got 'int4'"):
        EngineArgs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        EngineArgs(kv_cache_dtype=torch.bfloat16)


@pytest.mark.parametrize("target", ["onnx", "ascend"])
def test_targets_that_keep_the_model_dtype_refuse(target):
    """An onnxruntime session's inputs are typed; FIA's int8 KV takes static per-channel scales."""
    get_target(target).check_kv_cache_dtype(torch.float16, torch.float16)
    with pytest.raises(ValueError, match=rf"kv_cache_dtype: the {target} target keeps the KV cache in the model's "
                                         r"dtype \(float16\), got int8"):
        get_target(target).check_kv_cache_dtype(torch.int8, torch.float16)


def test_an_exported_pt2_serves_with_a_bf16_cache(tmp_path, auto, half):
    path = auto.export(tmp_path / "tiny.pt2")
    served = LLM.from_exported(path, num_blocks=32, kv_cache_dtype="bfloat16")
    assert {c.dtype for c in served.llm_engine.runner.kv_caches} == {torch.bfloat16}
    prompts = random_prompts((5, 19, 33), seed=2)
    assert [o.outputs[0].token_ids for o in served.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in half.generate(prompts, GREEDY, use_tqdm=False)]
