"""Load a causal LM and its tokenizer: the built-in default, a local directory or a hub id."""
from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from pagedpack.contract import ModelDescription
from pagedpack.models.tiny import default_model

DEFAULT_MODEL = "pagedpack/tiny-llama"  # the built-in model: no download, random fixed-seed weights


def load(model: str | None = None, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         builtin: dict | None = None):
    """``(model, tokenizer)`` for ``model``: None or :data:`DEFAULT_MODEL` for the built-in tiny
    Llama (with the config overrides ``builtin``, a target's ``builtin_model``), else a local
    Hugging Face directory or a hub id (``AutoModelForCausalLM``).

    The model is in eval mode on ``device``; ``dtype`` None keeps the checkpoint's dtype.
    """
    if model in (None, DEFAULT_MODEL):
        module, tokenizer = default_model(**(builtin or {}))
    elif not os.path.isdir(model) and (os.path.isabs(model) or model.startswith(".") or model.count("/") > 1):
        raise ValueError(f"model: expected a local Hugging Face directory or a hub id, got {model!r} "
                         "(no such directory)")
    else:
        module = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or "auto", attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(model)
    if dtype is not None:
        module = module.to(dtype)
    return module.to(device).eval(), tokenizer


def max_model_len(config: PretrainedConfig) -> tuple[int, str | None]:
    """Longest sequence the rewritten model serves, and why it is below the position limit.

    The paged attention op has no sliding window: a model with one is served only up to its
    window, where full causal attention and windowed attention agree.
    """
    limit = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and getattr(config, "use_sliding_window", True)
    if uses_window and int(window) < limit:
        return int(window), f"max_model_len capped at sliding_window={window} (no sliding-window attention yet)"
    return limit, None


def load_tokenizer(tokenizer):
    """``tokenizer`` itself, or the ``AutoTokenizer`` of a directory / hub id given as a string
    (``ValueError`` naming it if that fails)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as err:  # no such directory / hub id, no tokenizer files, offline
        raise ValueError(f"tokenizer: cannot load {str(tokenizer)!r} as a transformers tokenizer "
                         f"({type(err).__name__}: {err})") from err


def describe_model(model: torch.nn.Module, tokenizer=None) -> tuple[ModelDescription, str | None]:
    """What serving ``model`` needs besides its step program (eos ids, ``max_model_len``,
    vocabulary, name, ``tokenizer``), and the note of :func:`max_model_len` if any."""
    limit, note = max_model_len(model.config)
    name = getattr(model.config, "_name_or_path", None) or None
    return ModelDescription(eos_token_ids(model, tokenizer), limit, model.config.vocab_size, name, tokenizer), note


def eos_token_ids(model: torch.nn.Module, tokenizer=None) -> list[int]:
    """All end-of-sequence ids that ``model.generate`` stops on (configs may list several)."""
    generation_config = getattr(model, "generation_config", None)
    ids = getattr(generation_config, "eos_token_id", None) or model.config.eos_token_id
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
