"""Every ``...ForCausalLM`` class transformers registers is served exactly, refused with a reason, or
"unrunnable" (transformers' own model fails on it, with its error), never a raw exception, a different
token or "not constructed" (``tests/causal_lm_walk.py``).

The suite walks a fixed sample, one class per outcome and form that matters (a minute or two); with
``PAGEDPACK_WALK_ALL=1`` it walks every registered class, one at a time (about 50 minutes on 2 cores, estimated
from the last full walk: 26 minutes as two walkers in parallel), as the support table of docs/models.md was made
(``python tests/causal_lm_walk.py``)."""
import os

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from causal_lm_walk import walk_one

# class -> its outcome
SAMPLE = {
    "llama": "exact",
    "bart": "exact",  # learned positions computed with arange: read off the positions input
    "dbrx": "unrunnable",  # transformers' own model reads a field its config no longer has
    "gemma3": "exact",  # a ...ForConditionalGeneration on token ids
    "glm4_moe": "exact",
    "falcon_h1": "exact",  # a Mamba2 hybrid: its recurrent state paged
    "recurrent_gemma": "refused",  # RG-LRU: a recurrent state pagedpack does not page (MiniMax's is paged now)
    "bert": "refused",  # bidirectional
    "gpt_oss": "exact",  # attention sinks (the eager_sinks pattern), experts
}
WALKED = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if os.environ.get("PAGEDPACK_WALK_ALL") == "1" else list(SAMPLE)


@pytest.mark.parametrize("model_type", WALKED)
def test_a_registered_class_is_exact_or_refused_with_a_reason(model_type):
    outcome = walk_one(model_type)
    assert outcome.status in ("exact", "refused", "unrunnable"), outcome
    if outcome.status in ("refused", "unrunnable"):
        assert len(outcome.detail) > 20, outcome  # a reason a user can read: for "unrunnable", transformers' error
    if model_type in SAMPLE:
        assert outcome.status == SAMPLE[model_type], outcome


def test_the_cut_renumbers_layer_indices_and_keeps_each_kept_layer_s_source():
    """kolibri1_1 (50 layers, every fifth indexed; layer 9 reads layer 4's KV): per-layer source
    indices, index lists and 0/1 flags survive the cut as the kept layers' own (no model is built)."""
    import transformers as T

    from causal_lm_walk import tiny_overrides

    cut = tiny_overrides(T.CONFIG_MAPPING["kolibri1_1"]())
    kept = cut["num_hidden_layers"]
    assert cut["kv_source_layers"] == [0, 1, 2, 2] and kept == 4  # layers 0, 2, 4, 9 of the 50
    assert cut["layer_types"][2:] == ["indexed_attention"] * 2 and cut["index_layers"] == [2]
    assert cut["mlp_only_layers"] == [0]
    flags = tiny_overrides(T.CONFIG_MAPPING["smollm3"]())["no_rope_layers"]  # 0/1 per layer: kinds, not indices
    assert sorted(set(flags)) == [0, 1]
