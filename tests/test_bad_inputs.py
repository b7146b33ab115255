"""Bad inputs: each gets a clear ``ValueError`` naming the argument (or a per-request ``error``),
never a traceback from deep inside, a silent wrong answer, or a poisoned ``LLM``.

Tests marked "wrong now:" describe what the code currently does instead.
"""
import re

import pytest
import torch
import transformers

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack)
from pagedpack import LLM, SamplingParams
from pagedpack.models.loading import load
from pagedpack.models.tiny import VOCAB_SIZE, tiny_config, tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer

from conftest import assert_greedy_tokens_or_tie, hf_greedy, random_prompts, snapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def model():
    """The unmodified reference: LLMs are built from copies of it (``snapshot``), never from it."""
    return tiny_model("llama", num_hidden_layers=1)  # one layer: capture is the cost here


@pytest.fixture(scope="module")
def llm(model):
    """Shared by tests whose bad input is rejected before any request is queued."""
    return LLM(snapshot(model), tokenizer=byte_level_tokenizer(), block_size=16, num_blocks=64)


def _fresh(model, **kwargs):
    return LLM(snapshot(model), **{"block_size": 16, "num_blocks": 64, **kwargs})


@pytest.fixture(scope="module")
def bare(model):
    """An LLM with no tokenizer, shared by the tests whose refused calls must leave it serving."""
    return _fresh(model)


def _assert_still_serves(llm, model):
    """After a rejected call nothing is left queued and the next call is served correctly."""
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.has_unfinished(), f"left behind: waiting={scheduler.waiting} running={scheduler.running}"
    prompt = [3, 4, 5]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].token_ids == hf_greedy(model, prompt, 4)


def _rejected(llm, model, prompts, bad_index: int, *needles: str, branch: str) -> None:
    """``prompts[bad_index]`` must be refused clearly, the way ``branch`` pins: ``"call"``,
    ``generate`` raises ``ValueError`` with ``needles`` in the message and queues nothing;
    ``"request"``, that request alone gets ``error`` (with ``needles``) and the others finish with
    the unmodified model's tokens. Either way the LLM stays usable."""
    if branch == "call":
        with pytest.raises(ValueError) as err:
            llm.generate(prompts, GREEDY, use_tqdm=False)
        for needle in needles:
            assert needle in str(err.value), f"{needle!r} not in {str(err.value)!r}"
    else:
        assert branch == "request", branch
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            if i == bad_index:
                assert out.error, f"prompt {prompt!r} was accepted: {out.outputs}"
                for needle in needles:
                    assert needle in out.error, f"{needle!r} not in {out.error!r}"
            else:
                assert out.error is None
                assert out.outputs[0].token_ids == hf_greedy(model, prompt, 4)
    _assert_still_serves(llm, model)


# ---------------------------------------------------------------- LLM.generate: prompts


def test_token_id_outside_vocab_is_refused_and_the_rest_finish(model, bare):
    # wrong now: IndexError "index out of range in self" from the embedding inside the step; every
    # request of the call is lost and the LLM keeps them running, so the next generate fails too
    llm = bare
    for bad in (-1, VOCAB_SIZE):
        _rejected(llm, model, [[5, 6], [1, bad, 3], [7, 8, 9]], 1, str(bad), str(VOCAB_SIZE), branch="request")


def test_fractional_token_id_is_refused(model, llm):
    # wrong now: [1.7, 2] is silently truncated to [1, 2] and generated from (a silent wrong answer)
    _rejected(llm, model, [[1.7, 2]], 0, "prompts[0]", "1.7", branch="call")


def test_bad_prompt_after_good_ones_leaves_nothing_queued(model, bare):
    # wrong now: the good prompts before the bad one stay queued in the scheduler after the error,
    # and the next generate() crashes with KeyError('0') on a request it does not know
    llm = bare  # no tokenizer: a string prompt, or a stop string, is a bad request here
    stop = SamplingParams(temperature=0.0, max_tokens=4, stop=["x"])
    for bad, params, message in ((None, GREEDY, "prompts[2]: expected a string"),
                                 ("hello", GREEDY, "prompts: got a string but the model"),
                                 ([5, 6], [GREEDY, GREEDY, stop], "stop: stop strings need a tokenizer")):
        steps = llm.get_stats().num_steps
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([[1, 2], [3, 4, 5, 6], bad], params, use_tqdm=False)
        # was (stop): refused in the engine's thread, after a step had run the first two
        assert llm.get_stats().num_steps == steps
        _assert_still_serves(llm, model)


@pytest.mark.parametrize("prompts", [5, [[[1, 2]]], [["a", "b"]]], ids=["int", "nested-list", "list-of-str-tokens"])
def test_malformed_prompts_raise_naming_prompts(llm, prompts):
    # wrong now: TypeError "'int' object is not subscriptable" / "int() argument must be ... not
    # 'list'" / ValueError "invalid literal for int() with base 10: 'a'", none naming the prompts
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.scheduler.has_unfinished()


@pytest.mark.parametrize("prompts, message", [
    ([[5, 6, 7], {"prompt_token_ids": [1, 2, 3, 4, 5], "cache_salt": "\ud800"}],
     r"prompts\[1\]\['cache_salt'\]: expected a non-empty string encodable as UTF-8"),
    ({"prompt_token_ids": [1, 2], "cache_salt": ""}, "expected a non-empty string"),
    ({"prompt_token_ids": [1, 2], "cache_salt": 7}, "expected a non-empty string"),
    ({"prompt_token_ids": [1, 2], "salt": "a"}, r"expected a dict of 'prompt' .* or 'prompt_token_ids'"),
    (["\ud800abc"], r"prompts\[0\]: expected text encodable as UTF-8"),
    (torch.tensor([True, False]), "prompt"),
], ids=["lone-surrogate-salt", "empty-salt", "int-salt", "unknown-key", "lone-surrogate-text", "bool-tensor"])
def test_bad_prompt_fields_fail_before_anything_is_queued(llm, prompts, message):
    """From an adversarial trial: a salt that cannot be encoded used to abort the whole batch from
    inside the block hash (UnicodeEncodeError), once the prompt filled a block."""
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.scheduler.has_unfinished() and llm.get_stats().kv_blocks_used == 0


def test_tensor_prompt_is_served_as_its_token_ids(model, llm):
    # was: RuntimeError "Boolean value of Tensor with more than one value is ambiguous"
    outputs = llm.generate(torch.tensor([3, 4, 5]), GREEDY, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].error is None
    assert outputs[0].outputs[0].token_ids == hf_greedy(model, [3, 4, 5], 4)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, "greedy"], ids=["dict", "str"])
def test_sampling_params_of_wrong_type_raise_naming_it(llm, params):
    # wrong now: AttributeError "'dict' object has no attribute 'max_tokens'" from the scheduler
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["ab", "cd"], params, use_tqdm=False)
    assert not llm.llm_engine.scheduler.has_unfinished()


def test_sampling_params_as_tuple_is_one_per_prompt(model, llm):
    # was: AttributeError "'tuple' object has no attribute 'max_tokens'"
    longer = SamplingParams(temperature=0.0, max_tokens=6)
    outputs = llm.generate(["ab", "cd"], (GREEDY, longer), use_tqdm=False)
    ids = [llm.tokenizer("ab").input_ids, llm.tokenizer("cd").input_ids]
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, ids[0], 4), hf_greedy(model, ids[1], 6)]
    assert not llm.llm_engine.scheduler.has_unfinished()


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(("field", "value"), [("seed", 2**64), ("seed", -(2**63) - 1),
                                              ("stop_token_ids", None), ("stop_token_ids", 5), ("top_k", 2**63),
                                              ("stop", ["a"] * 17), ("stop", "a" * 257)])
def test_sampling_params_rejects_naming_the_field(field, value):
    # wrong now: seed=2**64 is accepted and later fails inside the sampler with "Overflow when
    # unpacking long long" (losing the whole batch); stop_token_ids=None/5 give a bare TypeError
    with pytest.raises(ValueError, match=rf"^{field}: expected .*, got "):
        SamplingParams(**{field: value})


# ---------------------------------------------------------------- LLM constructor


def test_kv_cache_memory_as_float_sizes_the_pool(model):
    # was: TypeError from torch.zeros in ModelRunner ("must be tuple of ints, but found element of type float")
    llm = LLM(snapshot(model), kv_cache_memory=1e6)
    assert llm.num_blocks == int(1e6 // (llm.bytes_per_token * llm.block_size))
    assert llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(model, [3, 4, 5], 4)


@pytest.mark.parametrize("value", [100.5, "100"])
def test_max_model_len_of_wrong_type(model, value):
    # wrong now: AssertionError "(VR[2, int_oo], VR[1, 100.5])" from torch.export / bare TypeError
    with pytest.raises(ValueError, match=r"^max_model_len: expected"):
        LLM(model, max_model_len=value)


@pytest.mark.parametrize("value", [4, 8])
def test_small_max_model_len_in_the_advertised_range(model, value):
    # was: "max_num_tokens: expected > 8, got 4" (an internal name) although the error for
    # max_model_len=0 advertises "expected 1 .. 512"; a model with <= 8 positions could not load at all
    llm = _fresh(model, max_model_len=value)
    out = llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, [1, 2], 4)[: value - 2]


@pytest.mark.parametrize("model_arg", [None, "instance"])
def test_dtype_as_string_is_accepted(model_arg):
    # was: RuntimeError "Invalid device string: 'bfloat16'" (built-in model) / TypeError
    # "to() received an invalid combination of arguments" (model instance)
    module = tiny_model("llama", num_hidden_layers=1) if model_arg else None
    llm = LLM(module, dtype="bfloat16", num_blocks=16)
    assert llm.llm_engine.runner.kv_caches[0].dtype == torch.bfloat16
    reference = (module if model_arg else load(None)[0]).to(torch.bfloat16)  # the instance is cast in place
    prompt = [3, 4, 5, 6, 7]
    got = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_greedy_tokens_or_tie(reference, prompt, got, hf_greedy(reference, prompt, 4))


def _not_causal_lms():
    torch.manual_seed(0)
    return {
        "linear": lambda: torch.nn.Linear(4, 4),
        "base-model": lambda: transformers.LlamaModel(tiny_config("llama", num_hidden_layers=1)).eval(),
        "token-classification": lambda: transformers.LlamaForTokenClassification(
            tiny_config("llama", num_hidden_layers=1, num_labels=5)).eval(),
        "sequence-classification": lambda: transformers.LlamaForSequenceClassification(
            tiny_config("llama", num_hidden_layers=1, num_labels=3, pad_token_id=0)).eval(),
    }


@pytest.mark.parametrize("kind", list(_not_causal_lms()))
def test_model_that_is_not_a_causal_lm_is_refused_at_construction(kind):
    # wrong now: linear -> AttributeError 'Linear' object has no attribute 'config'; base model ->
    # AttributeError 'BaseModelOutputWithPast' object has no attribute 'logits' (from capture);
    # token classification -> accepted, and generate() returns label ids as tokens (silently);
    # sequence classification -> accepted ("5 rewritten"), generate() then dies with RuntimeError
    # "INDICES element is out of DATA bounds" inside the step
    module = _not_causal_lms()[kind]()
    with pytest.raises(ValueError, match="model"):
        LLM(module, num_blocks=16)


def test_unsupported_attention_implementation_is_reported():
    # wrong now: RuntimeError "8*s52 ... is not tracked with proxy for <..._ModuleStackTracer>"
    # from deep inside torch.export, instead of a refusal that names the attention form
    module = tiny_model("llama", num_hidden_layers=1, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="flex_attention|attn_implementation"):
        LLM(module, num_blocks=16)


# ---------------------------------------------------------------- the ops


def _attention_args():
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return dict(query=torch.randn(5, 4, 8), key_cache=torch.randn(6, 4, 2, 8), value_cache=torch.randn(6, 4, 2, 8),
                block_table=i32([0, 1], [2, 3]), cu_seqlens_q=i32(0, 3, 5), seq_lens=i32(3, 6), scale=0.35)


def _cache_args():
    return dict(key=torch.randn(3, 2, 8), value=torch.randn(3, 2, 8), key_cache=torch.zeros(6, 4, 2, 8),
                value_cache=torch.zeros(6, 4, 2, 8), slot_mapping=torch.tensor([0, 5, -1]))


def _bad_op_calls():
    a, c = _attention_args(), _cache_args()
    return {
        # wrong now: int64/bool queries run and return an int64/bool "attention output"
        "attention-int-query": ("paged_attention", "query", dict(a, query=a["query"].long())),
        "attention-bool-query": ("paged_attention", "query", dict(a, query=a["query"] > 0)),
        # wrong now: integer caches are read as if they held K/V
        "attention-int-cache": ("paged_attention", "key_cache",
                                dict(a, key_cache=a["key_cache"].long(), value_cache=a["value_cache"].long())),
        # wrong now: ZeroDivisionError "integer modulo by zero"
        "attention-zero-kv-heads": ("paged_attention", "key_cache",
                                    dict(a, key_cache=a["key_cache"][:, :, :0],
                                         value_cache=a["value_cache"][:, :, :0])),
        # wrong now: float K/V are silently truncated into an int32 cache; int keys silently cast
        "cache-int-cache": ("reshape_and_cache", "key_cache",
                            dict(c, key_cache=c["key_cache"].int(), value_cache=c["value_cache"].int())),
        "cache-int-key": ("reshape_and_cache", "key", dict(c, key=torch.randint(0, 5, (3, 2, 8)))),
    }


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta runs the fake kernel
@pytest.mark.parametrize("case", list(_bad_op_calls()))
def test_op_rejects_non_floating_or_empty_heads(case, device):
    op, arg, kwargs = _bad_op_calls()[case]
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=rf"^{op}: {arg}: expected .*, got "):
        getattr(torch.ops.pagedpack, op)(**kwargs)


# ---------------------------------------------------------------- what already holds (end to end)


def test_preemption_under_a_tiny_pool_keeps_every_request_exact(model):
    """Pool of 8 blocks x 4 tokens, long request needing all of them, many short ones, an
    impossible one, a duplicate and a max_tokens=1: all finish as the unmodified model alone."""
    llm = LLM(snapshot(model), block_size=4, num_blocks=8, max_num_batched_tokens=12, max_num_seqs=8)
    prompts = random_prompts((22, 3, 9, 14, 1, 30, 6), seed=21)
    prompts += [prompts[2], random_prompts((40,), seed=22)[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (10, 8, 8, 6, 8, 2, 1, 8, 8)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts) and llm.llm_engine.stats.num_preemptions > 0
    assert "more than the whole pool of num_blocks=8" in outputs[-1].error
    for prompt, p, out in zip(prompts[:-1], params, outputs):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, p.max_tokens)
    assert llm.llm_engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_seeded_request_same_tokens_across_batch_compositions(model, llm):
    prompt, *others = random_prompts((7, 30, 3, 40), seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=10)
    noise = SamplingParams(temperature=0.8, max_tokens=6)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    chunked = LLM(snapshot(model), block_size=4, num_blocks=64, max_num_batched_tokens=16)
    mixed = chunked.generate([others[2], prompt, others[0]], [noise, seeded, noise], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
