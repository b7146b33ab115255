"""End to end: the rewritten model generates what the unmodified model generates, per sequence."""
import random

import pytest
import torch

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import FAMILIES, tiny_model
from pagedpack.runtime.request import Request

from conftest import hf_greedy, hf_last_logits, random_prompts, run_step, snapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return tiny_model(request.param)


def test_mixed_batch_matches_unmodified_model(family_model, mixed_prompts):
    reference = snapshot(family_model)
    llm = LLM(family_model, block_size=16, max_num_batched_tokens=256)
    outputs = llm.generate(mixed_prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(mixed_prompts, outputs, strict=True):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 24), f"prompt length {len(prompt)}"
    assert llm.llm_engine.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def stepped_llm(family_model):
    """The family's LLM for the hand-built steps (``run_step``): the two tests' requests hold 66 and
    9 of its blocks, none shared (each test's requests are its own objects, with ids of their own)."""
    return LLM(family_model, block_size=16, num_blocks=128)


def test_prefill_logits_match(family_model, mixed_prompts, stepped_llm):
    requests = [Request(str(i), p, GREEDY) for i, p in enumerate(mixed_prompts)]
    logits = run_step(stepped_llm, [(r, r.num_tokens) for r in requests])
    for row, prompt in zip(logits, mixed_prompts):
        torch.testing.assert_close(row, hf_last_logits(family_model, prompt), atol=1e-4, rtol=0)


def test_mixed_prefill_decode_and_chunked_prefillrun_step(family_model, stepped_llm):
    """One step holding a fresh prefill, a decode, and a chunked prefill resuming mid-block."""
    llm = stepped_llm
    fresh, decoding, chunked = (Request(name, p, GREEDY) for name, p in
                                zip(("fresh", "decoding", "chunked"), random_prompts((37, 21, 70), seed=3)))
    run_step(llm, [(decoding, 20), (chunked, 21)])  # earlier step: both cached in part (21 = mid-block)
    logits = run_step(llm, [(fresh, 37), (decoding, 1), (chunked, 30)])
    expected = [hf_last_logits(family_model, fresh.all_token_ids),
                hf_last_logits(family_model, decoding.all_token_ids),
                hf_last_logits(family_model, chunked.all_token_ids[:51])]
    torch.testing.assert_close(logits, torch.stack(expected), atol=1e-4, rtol=0)


def test_one_capture_serves_every_batch_composition(monkeypatch):
    model = tiny_model("llama")
    exports = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    llm = LLM(model, block_size=16, max_num_batched_tokens=40, max_num_seqs=6)
    rng = random.Random(0)
    prompts = random_prompts([rng.randint(1, 90) for _ in range(32)], seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12)) for _ in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(llm.llm_engine.stats.compositions) >= 30
    assert len(exports) == 1
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, p.max_tokens)


def test_impossible_requests_fail_alone():
    model = tiny_model("llama")  # max_position_embeddings=512
    llm = LLM(model, block_size=16, num_blocks=20)  # the pool holds 320 tokens
    prompts = random_prompts((600, 10, 400, 33), seed=2)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert "max_model_len=512" in outputs[0].error
    assert "more than the whole pool of num_blocks=20" in outputs[2].error
    for i in (1, 3):
        assert outputs[i].error is None
        assert outputs[i].outputs[0].token_ids == hf_greedy(model, prompts[i], 24)
