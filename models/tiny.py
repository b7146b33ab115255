"""Built-in tiny configurations: random weights from a fixed seed, no download needed.

Used by the tests (one per supported family) and as the CLI's default model. The vocabulary
matches the byte-level tokenizer in :mod:`pagedpack.models.tokenizer`.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from pagedpack.models.tokenizer import NUM_BYTES, byte_level_tokenizer

VOCAB_SIZE = NUM_BYTES + 2  # bytes + BOS + EOS
_FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
FAMILIES = tuple(_FAMILIES)

# Grouped-query attention (4 query heads on 2 KV heads); a wide weight init so that greedy
# decoding has clear argmax margins instead of near-ties between near-uniform logits.
_TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=NUM_BYTES,
    eos_token_id=NUM_BYTES + 1,
    tie_word_embeddings=False,
)


# Per family: what makes it differ from Llama in the tests' prompts. Mistral's window (12 tokens: shorter
# than most test prompts, not a multiple of a block size) engages; its own default, 4096, never would.
_FAMILY_TINY = {"mistral": dict(sliding_window=12)}


def tiny_config(family: str = "llama", **overrides) -> PretrainedConfig:
    """A tiny config of ``family`` (one of :data:`FAMILIES`); keyword overrides win."""
    if family not in _FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    return _FAMILIES[family](**{**_TINY, **_FAMILY_TINY.get(family, {}), **overrides})


def tiny_model(family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", **overrides) -> torch.nn.Module:
    """A tiny ``family`` causal LM in eval mode with weights drawn from ``seed``."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def default_model(**overrides):
    """The CLI's default: a tiny Llama with byte-level tokenizer, ``(model, tokenizer)``.

    ``overrides`` reshape it for a target's attention form (a target's ``builtin_model``, e.g.
    bf16 and head_dim 128 for ``ascend``).
    """
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2)
    model = tiny_model("llama", num_hidden_layers=4, max_position_embeddings=1024, **{**shape, **overrides})
    return model, byte_level_tokenizer()
