"""Read a ``transformers`` config the way each family spells its fields.

Families name the same facts differently (``max_position_embeddings``, GPT-2's ``n_positions``,
MPT's ``max_seq_len``, ...; ALiBi models such as BLOOM have no position limit at all), and ids
may legitimately be 0, so nothing here falls back with ``or``. The keys and the 2048 default
for models with no limit follow vLLM's ``_get_and_verify_max_len``.
"""
from __future__ import annotations

from transformers import PretrainedConfig

POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                       "max_sequence_length", "max_seq_length", "seq_len")
DEFAULT_MAX_MODEL_LEN = 2048  # for models whose config records no position limit (ALiBi)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's own config (multimodal configs nest it as ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def position_limit(config: PretrainedConfig) -> int | None:
    """The longest sequence the config declares (the first of :data:`POSITION_LIMIT_KEYS` set), or None."""
    config = text_config(config)
    for key in POSITION_LIMIT_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return None


def mask_reach(config: PretrainedConfig) -> int | None:
    """The longest distance, in tokens, at which the config's attention masks change form: its sliding
    window (``sliding_window``, Mistral/Qwen2/Gemma) or attention chunk (``attention_chunk_size``,
    Llama-4), whether or not every layer uses it; None if it declares neither. The passes check
    each site's mask on a sample longer than this."""
    config = text_config(config)
    sizes = [getattr(config, key, None) for key in ("sliding_window", "attention_chunk_size")]
    sizes = [int(v) for v in sizes if isinstance(v, int) and not isinstance(v, bool)]
    return max(sizes) if sizes else None


def rope_type(config: PretrainedConfig) -> str | None:
    """The RoPE variant (``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``, ``"llama3"``, ...), or None."""
    config = text_config(config)
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(config, key, None)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) is not None:
            return params.get("rope_type", params.get("type"))
    return None


def first_set(*values):
    """The first value that is not None (0 counts as set), else None."""
    return next((v for v in values if v is not None), None)
