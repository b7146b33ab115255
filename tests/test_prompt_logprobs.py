"""``SamplingParams.prompt_logprobs`` (vLLM's semantics) against the unmodified model's logits over
the whole prompt in one forward pass: chunked prefill, a mixed batch, prefix caching, preemption,
``n > 1``, streaming, bad values, and the targets' step programs."""
import pytest
import torch

import pagedpack.formats.export as export
import pagedpack.lowering.reference.pt2 as pt2_format
from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.outputs import merge
from pagedpack.step.metadata import example_metadata

from conftest import hf_greedy, random_prompts, snapshot

BUDGET = 16  # max_num_batched_tokens: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    return snapshot(model)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, num_blocks=64, block_size=8, max_num_batched_tokens=BUDGET, max_num_seqs=4)


def assert_prompt_logprobs(reference, prompt: list[int], got: list, k: int, atol: float = 1e-5) -> None:
    """``got`` (``RequestOutput.prompt_logprobs``) against ``log_softmax`` of the unmodified model's
    fp32 logits over ``prompt`` in one pass: None first, then per token the token itself and the
    top ``k``, each with its logprob and its rank in the reference's ranking."""
    with torch.no_grad():
        logprobs = reference(torch.tensor([prompt]), use_cache=False).logits[0].float().log_softmax(-1)
    assert got[0] is None and len(got) == len(prompt)
    for q in range(1, len(prompt)):
        row, entry = logprobs[q - 1], got[q]
        assert set(entry) == {prompt[q], *row.topk(k).indices.tolist()}, f"position {q}"
        for token, logprob in entry.items():
            assert abs(logprob.logprob - float(row[token])) < atol, f"position {q}, token {token}"
            assert logprob.rank == int((row > row[token]).sum()) + 1, f"position {q}, token {token}"


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **kwargs})


@pytest.mark.parametrize("k", [0, 5])
def test_a_chunked_prompt_gives_the_models_prompt_logprobs(llm, reference, k):
    prompt = random_prompts((53,), seed=3)[0]  # four chunks of the step budget
    steps = llm.get_stats().num_steps
    out = llm.generate({"prompt_token_ids": prompt}, _params(prompt_logprobs=k), use_tqdm=False)[0]
    assert llm.get_stats().num_steps - steps >= 53 // BUDGET + 1
    assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, k)
    if k == 0:
        assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 4)


def test_in_a_mixed_batch_only_the_requests_asking_get_them(llm, reference):
    prompts = random_prompts((5, 23, 40, 9, 31), seed=4)
    asking = {1, 2, 4}
    params = [_params(prompt_logprobs=3) if i in asking else _params() for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 4), f"prompt {i}"
        if i in asking:
            assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, 3)
        else:
            assert out.prompt_logprobs is None


def test_a_request_asking_takes_no_prefix_cache_hit(llm, reference):
    """As vLLM: the cached positions' logits are not computed, so a request asking for prompt
    logprobs computes its whole prompt; one not asking still hits."""
    shared = random_prompts((24,), seed=5)[0]
    first, asking, plain = (shared + tail for tail in random_prompts((5, 7, 3), seed=6))
    llm.generate({"prompt_token_ids": first}, _params(), use_tqdm=False)
    before = llm.get_stats()
    out = llm.generate({"prompt_token_ids": asking}, _params(prompt_logprobs=2), use_tqdm=False)[0]
    after = llm.get_stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == len(asking)
    assert_prompt_logprobs(reference, asking, out.prompt_logprobs, 2)
    llm.generate({"prompt_token_ids": plain}, _params(), use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits - after.prefix_cache_hits >= 24


def test_parallel_samples_get_the_prompt_logprobs_once(llm, reference):
    prompt = random_prompts((29,), seed=7)[0]
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=5, prompt_logprobs=4)
    deltas = list(llm.generate({"prompt_token_ids": prompt}, params, stream=True))
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0]  # with the first output tokens
    whole = None
    for delta in deltas:
        whole = merge(whole, delta)
    assert [len(c.token_ids) for c in whole.outputs] == [5, 5]
    assert_prompt_logprobs(reference, prompt, whole.prompt_logprobs, 4)


def test_a_request_preempted_mid_prompt_emits_each_position_once(model, reference):
    """A small pool: the decoding request ``a`` grows into the blocks of ``b``, preempted with part
    of its prompt logprobs taken; recomputing its prompt (partly from the prefix cache, up to the
    first position still needed) takes only the missing ones."""
    llm = LLM(model, num_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine = llm.llm_engine
    prompt_a, prompt_b = random_prompts((6, 40), seed=1)
    engine.add_request("a", {"prompt_token_ids": prompt_a}, _params(max_tokens=40, ignore_eos=True))
    deltas, taken_when_preempted = {"a": engine.step(), "b": []}, []
    engine.add_request("b", {"prompt_token_ids": prompt_b}, _params(prompt_logprobs=2))
    while engine.has_unfinished():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
        b = [r for r in engine.scheduler.waiting if r.request_id == "b" and r.num_computed_tokens == 0]
        if b and b[0].num_preemptions and not taken_when_preempted:
            taken_when_preempted.append(len(b[0].prompt_logprobs))
    assert 0 < taken_when_preempted[0] < len(prompt_b) - 1
    assert [d.prompt_logprobs is not None for d in deltas["b"]] == [True] + [False] * (len(deltas["b"]) - 1)
    assert_prompt_logprobs(reference, prompt_b, deltas["b"][0].prompt_logprobs, 2)
    assert all(d.prompt_logprobs is None for d in deltas["a"])
    assert [t for d in deltas["b"] for t in d.outputs[0].token_ids] == hf_greedy(reference, prompt_b, 4)
    assert [t for d in deltas["a"] for t in d.outputs[0].token_ids] == hf_greedy(reference, prompt_a, 40)
    assert llm.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_bad_values_are_refused_naming_prompt_logprobs(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs: expected None or an int in \[0, 20\], got"):
        SamplingParams(prompt_logprobs=value)


def test_more_than_the_vocabulary_is_refused(llm, monkeypatch):
    monkeypatch.setattr(llm.llm_engine.description, "vocab_size", 16)  # a vocabulary below the 20 allowed
    for name in ("prompt_logprobs", "logprobs"):
        with pytest.raises(ValueError, match=rf"^{name}: expected at most vocab_size=16 tokens, got 17"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, _params(**{name: 17}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()


# ---------------------------------------------------------------- the targets' step programs


@pytest.fixture(scope="module")
def source(model):
    return LLM(snapshot(model), num_blocks=32, block_size=8, keep_source_model=True)


def _tied_example_step(rewritten):
    """:func:`pagedpack.formats.export.example_step` as before the logits rows had a size of their own."""
    args, dynamic_shapes = _real_example_step(rewritten)
    args = (*args[:6], args[6][:3], *args[7:])  # each sequence's last row only
    return args, (*dynamic_shapes[:6], dynamic_shapes[3], *dynamic_shapes[7:])


_real_example_step = export.example_step


def test_a_pt2_export_serves_prompt_logprobs_and_an_older_one_refuses_them(source, reference, tmp_path, monkeypatch):
    prompt = random_prompts((37,), seed=8)[0]
    served = LLM.from_exported(source.export(tmp_path / "new.pt2"), num_blocks=32, block_size=8,
                               max_num_batched_tokens=BUDGET)
    out = served.generate({"prompt_token_ids": prompt}, _params(prompt_logprobs=3), use_tqdm=False)[0]
    assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, 3)
    monkeypatch.setattr(pt2_format, "example_step", _tied_example_step)
    older = LLM.from_exported(source.export(tmp_path / "old.pt2"), num_blocks=32, block_size=8)
    with pytest.raises(ValueError, match=r"prompt_logprobs: the reference target's \.pt2 program .* returns one "
                                         r"logits row per sequence"):
        older.generate({"prompt_token_ids": prompt}, _params(prompt_logprobs=3), use_tqdm=False)
    assert older.generate({"prompt_token_ids": prompt}, _params(), use_tqdm=False)[0].outputs[0].token_ids == \
        out.outputs[0].token_ids


def test_the_onnx_target_serves_prompt_logprobs(source, reference, tmp_path):
    """An ONNX export served by the onnx target (the onnxruntime session that ``target="onnx"`` runs)."""
    served = LLM.from_exported(source.export(tmp_path / "m.onnx", format="onnx"), num_blocks=32, block_size=8,
                               max_num_batched_tokens=BUDGET)
    assert served.target == "onnx"
    prompt = random_prompts((37,), seed=8)[0]
    out = served.generate({"prompt_token_ids": prompt}, _params(prompt_logprobs=3), use_tqdm=False)[0]
    assert_prompt_logprobs(reference, prompt, out.prompt_logprobs, 3, atol=1e-4)


@pytest.mark.parametrize("mode", ["full_decode_only", "full_and_piecewise"])
def test_an_ascend_decode_step_with_prompt_rows_runs_eagerly_or_in_pieces(mode):
    """A step of one-token chunks (``T == B``) that also returns a prompt row is not a decode
    bucket's (whose padded logits are cut to ``B`` rows): it runs the eager program, or in pieces
    (whose logits are computed eagerly on the real rows) in the default graph mode."""
    llm = LLM(tiny_model("llama", dtype=torch.bfloat16, head_dim=128), target="ascend", block_size=128,
              num_blocks=4, target_options={"graph_mode": mode, "graph_batch_sizes": [4]})
    runner = llm.llm_engine.runner
    batch = example_metadata([1, 1], [3, 5], block_size=128, num_blocks=4)
    rows = batch._replace(logits_indices=torch.tensor([0, 1, 0]))
    logits = runner.execute(rows)
    assert logits.shape[0] == 3 and torch.equal(logits[2], logits[0])
    graphs = llm.program.graphs
    assert graphs.graph_steps == 0 and (graphs.eager_steps, graphs.piecewise_steps) == \
        ((1, 0) if mode == "full_decode_only" else (0, 1))
