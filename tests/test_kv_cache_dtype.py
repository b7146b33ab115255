"""``kv_cache_dtype``: the KV cache stored in another dtype than the model's, or quantized.

The reference is the unmodified ``transformers`` model with its keys and values as the cache holds
them (rounded to the KV dtype, or quantized per row and scaled back, written plainly here) before
attention (an attention function registered under another name), one sequence at a time; the rule
is the suite's for a low-precision whole-model result (``assert_within_own_error``).
"""
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pagedpack import LLM, SamplingParams
from pagedpack.engine_args import EngineArgs
from pagedpack.models.tiny import default_model
from pagedpack.runtime.request import Request
from tests.conftest import assert_within_own_error, random_prompts, run_step, snapshot

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
    model.config._attn_implementation = name
    with torch.no_grad():
        return model(torch.tensor([prompt]), use_cache=False).logits[0, -1]


@pytest.fixture(scope="module")
def tiny():
    return default_model()[0]


KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_logits_of_mixed_steps_are_the_model_with_stored_kv(tiny, name, cpu_kernels):
    """Prefills, a decode and a chunked prefill in one step, over caches of ``kv_dtype``."""
    kv_dtype = KV_DTYPES[name]
    reference = snapshot(tiny)
    llm = LLM(tiny, block_size=16, num_blocks=64, kv_cache_dtype=name)
    assert {c.dtype for c in llm.llm_engine.runner.kv_caches} == {kv_dtype}
    fresh, decoding, chunked = (Request(str(i), p, GREEDY) for i, p in enumerate(random_prompts((37, 21, 70), seed=3)))
    run_step(llm, [(decoding, 20), (chunked, 21)])
    logits = run_step(llm, [(fresh, 37), (decoding, 1), (chunked, 30)])
    for row, request, length in zip(logits, (fresh, decoding, chunked), (37, 21, 51)):
        prompt = request.prompt_token_ids[:length]
        exact = _reference_logits(reference, prompt, None)
        rounded = _reference_logits(reference, prompt, kv_dtype)
        assert_within_own_error(row, rounded, exact)
        # the rounding happened: an fp32 cache would be ~1e-6 off, not the rounded reference's error
        assert (row - exact).abs().max() > 0.1 * (rounded - exact).abs().max()


def test_two_byte_kv_holds_twice_the_tokens(tiny):
    """The pool, the plan and the stats count the KV dtype's bytes."""
    auto = LLM(tiny, num_blocks=8)
    half = LLM(tiny, num_blocks=8, kv_cache_dtype="bfloat16")
    assert half.bytes_per_token * 2 == auto.bytes_per_token
    assert half.llm_engine.runner.kv_cache_bytes * 2 == auto.llm_engine.runner.kv_cache_bytes
    # int8: one byte a value and 4 for each (token, head) row's scale: 4 x 2 x (16 + 4) bytes a layer here
    spec = auto.program.kv_cache_specs[0]
    int8 = LLM(tiny, num_blocks=8, kv_cache_dtype="int8")
    assert int8.bytes_per_token == len(auto.program.kv_cache_specs) * spec.num_kv_heads * 2 * (spec.key_head_size + 4)
    plans = {name: auto.plan_memory("64MiB", kv_cache_dtype=name) for name in ("auto", "float32", "bfloat16")}
    assert plans["auto"].num_blocks == plans["float32"].num_blocks
    # the same budget less weights and activations, over half the bytes per block
    free = plans["auto"].memory - plans["auto"].weight_bytes - plans["auto"].activation_bytes
    assert plans["bfloat16"].num_blocks == free // (auto.bytes_per_token // 2 * auto.block_size)
    assert plans["bfloat16"].num_blocks >= 2 * plans["auto"].num_blocks
    half.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    stats = half.get_stats()
    assert stats.kv_cache_dtype == "bfloat16"
    assert stats.kv_cache_bytes_per_block == half.bytes_per_token * half.block_size


def test_greedy_tokens_with_prefix_caching_and_preemption(tiny):
    """Prefix hits, copy-on-write forks and preemption over a bf16 pool: each prompt's tokens are
    those it gets alone in the same pool."""
    prompts = random_prompts((40, 40, 9, 33), seed=5)
    prompts[1][:32] = prompts[0][:32]  # a shared prefix of two blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, n=2)
    alone = [LLM(tiny, block_size=16, num_blocks=32, kv_cache_dtype="bfloat16").generate([p], params, use_tqdm=False)
             [0] for p in prompts]
    llm = LLM(tiny, block_size=16, num_blocks=12, kv_cache_dtype="bfloat16")  # too few blocks: preemption
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0 and llm.get_stats().prefix_cache_hits > 0
    for got, want in zip(outputs, alone, strict=True):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected one of \['auto', .*got 'int4'"):
        EngineArgs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        EngineArgs(kv_cache_dtype=torch.bfloat16)


def test_targets_that_keep_the_model_dtype_refuse(tmp_path, tiny):
    llm = LLM(tiny, num_blocks=8, keep_source_model=True)
    path = llm.export(tmp_path / "tiny.onnx", format="onnx")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: the onnx target keeps the KV cache in the model's dtype "
                                         r"\(float32\), got bfloat16"):
        LLM.from_exported(path, kv_cache_dtype="bfloat16")


def test_an_exported_pt2_serves_with_a_bf16_cache(tmp_path, tiny):
    llm = LLM(tiny, num_blocks=32, keep_source_model=True)
    path = llm.export(tmp_path / "tiny.pt2")
    served = LLM.from_exported(path, num_blocks=32, kv_cache_dtype="bfloat16")
    assert {c.dtype for c in served.llm_engine.runner.kv_caches} == {torch.bfloat16}
    direct = LLM(tiny, num_blocks=32, kv_cache_dtype="bfloat16")
    prompts = random_prompts((5, 19, 33), seed=2)
    assert [o.outputs[0].token_ids for o in served.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in direct.generate(prompts, GREEDY, use_tqdm=False)]
