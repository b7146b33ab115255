"""Structured outputs (``SamplingParams.structured_outputs``, xgrammar): every finished output
follows its JSON schema, regex, choice or grammar, on a tiny random Llama with SmolLM2's real
tokenizer (49,152 tokens), under n > 1, preemption, chunked prefill, prefix caching, stop strings
and min_tokens; unconstrained requests beside constrained ones are untouched; bad constraints are
refused naming the field before any step."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.engine import LLMEngine
from pagedpack.runtime.sampling_params import StructuredOutputsParams
from pagedpack.step.contract import ModelDescription

from conftest import fetch_alias_or_skip

VOCAB = 49152  # SmolLM2's
PROMPTS = ["Give me a person as JSON:", "Hello there", "The answer is", "Once upon a time, in a land far away"]
def parse(text: str):
    """JSON text as xgrammar 0.2.9 writes it: a string with minLength / maxLength may hold raw control
    characters (its rule is ``[^"\\\r\n]{m,n}``), which strict JSON refuses (docs/structured-outputs.md)."""
    return json.loads(text, strict=False)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "maxLength": 5}}, "required": ["zip"]},
}, "required": ["name", "age", "role", "tags", "address"]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(fetch_alias_or_skip("smollm2-135m"))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB, eos_token_id=2, bos_token_id=1)


@pytest.fixture(scope="module")
def llm(model, tokenizer):
    return LLM(model, tokenizer=tokenizer, num_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def tight(model, tokenizer):
    """Few blocks (preemption) and a small token budget (chunked prefill)."""
    return LLM(model, tokenizer=tokenizer, num_blocks=16, block_size=16, max_num_batched_tokens=32)


def greedy(max_tokens: int = 120, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint or None)


def texts(llm, prompts, params) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


def test_each_kind_of_constraint_is_followed(llm):
    cases = [
        (greedy(json=SCHEMA, disable_any_whitespace=True), lambda t: jsonschema.validate(parse(t), SCHEMA)),
        (greedy(regex=r"[a-c]{2,5}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", t) or 1 / 0),
        (greedy(choice=["yes", "no", "I don't know"]), lambda t: t in ("yes", "no", "I don't know") or 1 / 0),
        (greedy(grammar='root ::= "A" ("b" | "c"){1,6} "!"'), lambda t: re.fullmatch("A[bc]{1,6}!", t) or 1 / 0),
    ]
    for params, check in cases:
        for text, reason in texts(llm, PROMPTS, params):
            assert reason == "stop", (params.structured_outputs, text)
            check(text)
    # unbounded ones (any whitespace, the default; any object): a random model may never close them; what ends parses
    for text, reason in texts(llm, PROMPTS, greedy(json=SCHEMA, max_tokens=60)):
        assert reason == "length" or jsonschema.validate(parse(text), SCHEMA) is None
    for text, reason in texts(llm, PROMPTS, greedy(json_object=True, max_tokens=60)):
        assert text.lstrip().startswith("{") and (reason == "length" or isinstance(parse(text), dict))


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPTS[:2], greedy(max_tokens=5, regex="[0-9]{60}"), use_tqdm=False)
    for o in out:  # SmolLM2 spells numbers one digit a token
        assert (o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) == ("length", 5)
        assert re.fullmatch("[0-9]{5}", o.outputs[0].text)


def test_n_completions_each_follow_the_grammar(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=40,
                            structured_outputs={"regex": "[a-z]{3}-[0-9]{2}"})
    (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    got = [(c.text, c.finish_reason) for c in out.outputs]
    assert all(reason == "stop" and re.fullmatch("[a-z]{3}-[0-9]{2}", text) for text, reason in got), got
    assert len({text for text, _ in got}) > 1, got  # each its own matcher and draws


def test_preemption_chunked_prefill_and_prefix_caching_change_nothing(llm, tight):
    prompts = [p * 6 for p in PROMPTS]  # 40-70 tokens: chunked under a budget of 32
    params = greedy(json=SCHEMA, disable_any_whitespace=True, max_tokens=120)
    roomy = texts(llm, prompts, params)
    before = tight.get_stats().num_preemptions
    assert texts(tight, prompts, params) == roomy
    assert tight.get_stats().num_preemptions > before
    hits = llm.get_stats().prefix_cache_hits
    assert texts(llm, prompts, params) == roomy  # again: the prompts' blocks come from the prefix cache
    assert llm.get_stats().prefix_cache_hits > hits


def test_unconstrained_requests_beside_constrained_ones_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=20)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [plain] * 4 + [greedy(regex="[xyz]{4,8}")] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch("[xyz]{4,8}", o.outputs[0].text) for o in mixed[4:])


def test_stop_strings_and_min_tokens_with_a_grammar(llm):
    (text, reason), = texts(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, stop="b",
                                                             structured_outputs={"regex": "a{0,3}b[a-c]{5}"}))
    assert reason == "stop" and re.fullmatch("a{0,3}", text)
    # the grammar allows only EOS after "yes" and min_tokens bans it: that request fails alone
    banned = SamplingParams(max_tokens=8, min_tokens=4, structured_outputs={"choice": ["yes"]})
    out = llm.generate(PROMPTS[:2], [banned, greedy(choice=["no"])], use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error" and "structured_outputs" in out[0].error, out[0].error
    assert (out[1].outputs[0].text, out[1].outputs[0].finish_reason) == ("no", "stop")


def test_a_token_the_grammar_rejects_fails_its_request_alone(llm, monkeypatch):
    sampler = llm.llm_engine.sampler
    real = sampler.sample

    def off_grammar(logits, requests, grammar=None):
        out = real(logits, requests, grammar)
        out.token_ids = [ord("Z") if r.grammar is not None else t for r, t in zip(requests, out.token_ids)]
        return out

    monkeypatch.setattr(sampler, "sample", off_grammar)
    out = llm.generate(PROMPTS[:2], [greedy(regex="[a-c]+"), SamplingParams(temperature=0, max_tokens=4)],
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error" and "does not accept" in out[0].error
    assert out[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(("constraint", "field"), [
    ({"json": {"type": "wat"}}, "structured_outputs.json"),
    ({"regex": "a("}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ({"structural_tag": {"type": "nonsense"}}, "structured_outputs.structural_tag"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    # compiling grows with the text: a 1 MB choice list took 20-47 s (found by a break-it session)
    ({"choice": [f"{i:05d}" + "x" * 40 for i in range(2000)]}, "structured_outputs.choice"),
    ({"json": {"type": "number", "default": float("nan")}}, "structured_outputs.json"),
])
def test_a_bad_constraint_is_refused_naming_the_field_before_any_step(llm, constraint, field):
    steps = llm.get_stats().num_steps
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: expected"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert llm.get_stats().num_steps == steps


def test_a_model_without_a_tokenizer_refuses_structured_outputs():
    engine = LLMEngine(None, None, description=ModelDescription(vocab_size=VOCAB, model_name="bare"))
    with pytest.raises(ValueError, match="^structured_outputs: .*has no tokenizer"):
        engine.make_request("r", [1, 2], SamplingParams(structured_outputs={"regex": "a"}))


def test_the_grammar_cache_is_a_bounded_lru(tokenizer):
    from pagedpack.runtime.structured_output import StructuredOutputManager, grammar_key

    manager = StructuredOutputManager(tokenizer, VOCAB, [2], cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = manager.compile(a)
    manager.compile(b)
    assert manager.compile(a) is first  # a hit, now the most recent
    manager.compile(c)  # drops b
    assert manager.num_cached == 2 and manager.compile(a) is first
    assert grammar_key(StructuredOutputsParams(json={"b": 1, "a": 2})) != grammar_key(
        StructuredOutputsParams(json={"a": 2, "b": 1}))  # property order is the output's
    assert grammar_key(StructuredOutputsParams(json='{"a": 2}')) == grammar_key(StructuredOutputsParams(json={"a": 2}))


def test_the_grammar_cache_is_bounded_in_bytes_too(tokenizer):
    from pagedpack.runtime.structured_output import StructuredOutputManager

    regexes = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+")]
    roomy = StructuredOutputManager(tokenizer, VOCAB, [2])
    sizes = [roomy.compile(r).memory_size_bytes for r in regexes]
    assert roomy.num_cached == 3 and roomy.cached_bytes == sum(sizes)
    tight = StructuredOutputManager(tokenizer, VOCAB, [2], cache_bytes=sizes[1] + sizes[2])
    for r in regexes:
        assert tight.compile(r) is not None and tight.cached_bytes <= tight.cache_bytes
    assert tight.num_cached == 2 and tight.cached_bytes == sizes[1] + sizes[2]  # a+ went first
    none = StructuredOutputManager(tokenizer, VOCAB, [2], cache_bytes=0)  # larger than the bound: not kept
    assert none.compile(regexes[0]) is not None and none.num_cached == 0 and none.cached_bytes == 0


def _schemas(depth: int = 2):
    """Small JSON schemas: objects (nested), enums, bounded arrays, integers, booleans, short strings."""
    leaves = st.one_of(
        st.just({"type": "boolean"}),
        st.integers(-50, 50).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 100}),
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.sampled_from(["red", "green", "blue", 1, True]), min_size=1, max_size=3, unique=True)
        .map(lambda values: {"enum": values}))
    if depth == 0:
        return leaves
    inner = _schemas(depth - 1)
    arrays = st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    return st.one_of(leaves, arrays, _objects(inner))


def _objects(values):
    """Objects of 1-3 properties whose schemas ``values`` draws, some of them required."""
    return st.dictionaries(st.sampled_from(["a", "b", "c", "id"]), values, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required}))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_objects(_schemas(1)))
def test_random_schemas_every_finished_output_validates(llm, schema):
    for text, reason in texts(llm, PROMPTS[:2], greedy(json=schema, disable_any_whitespace=True, max_tokens=250)):
        if reason == "stop":
            jsonschema.validate(parse(text), schema)


def test_speculative_steps_keep_each_grammar_s_state(llm):
    """Drafts (the plain run's tokens, one sometimes wrong, which the grammar may forbid) verified
    position by position, each masked by the grammar after the tokens before it: the same outputs as
    without speculation, greedy and seeded."""
    import random

    from test_spec_decode import NGRAM, OracleProposer

    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=120,
                             structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    params = [greedy(json=SCHEMA, disable_any_whitespace=True), sampled, greedy(regex=r"[a-c]{2,9}-[0-9]{3,8}")]
    plain = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    expected = {tuple(out.prompt_token_ids): out.outputs[0].token_ids for out in plain}
    llm.llm_engine.proposer = oracle = OracleProposer(NGRAM, expected, random.Random(2), VOCAB)
    try:
        speculative = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        llm.llm_engine.proposer = None
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in plain]
    assert 0 < oracle.stats.num_accepted_tokens < oracle.stats.num_draft_tokens
