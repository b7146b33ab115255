"""Load a causal LM and its tokenizer: the built-in default, a local directory or a hub id."""
from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from pagedpack.models.aliases import DEFAULT_MODEL
from pagedpack.models.config import DEFAULT_MAX_MODEL_LEN, first_set, position_limit, text_config
from pagedpack.models.tiny import default_model
from pagedpack.step.contract import ModelDescription


def load(model: str | None = None, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         builtin: dict | None = None):
    """``(model, tokenizer)`` for ``model``: None or :data:`DEFAULT_MODEL` for the built-in tiny
    Llama (with the config overrides ``builtin``, a target's ``builtin_model``), else a local
    Hugging Face directory or a hub id (``AutoModelForCausalLM``).

    The model is in eval mode on ``device``; ``dtype`` None keeps the checkpoint's dtype. A
    local directory without tokenizer files gives tokenizer None (token-id prompts only).
    ``"tiny"`` is the built-in model; a named alias (``"smollm2-135m"``, ``"gemma3-270m"``) is its
    converted directory in the cache, fetched on first use (:mod:`pagedpack.models.aliases`).
    """
    from pagedpack.models.aliases import resolve  # tiny -> None, an alias -> its cached directory

    model = resolve(model)
    if model in (None, DEFAULT_MODEL):
        module, tokenizer = default_model(**(builtin or {}))
    elif not os.path.isdir(model) and (os.path.isabs(model) or model.startswith(".") or model.count("/") > 1):
        raise ValueError(f"model: expected a local Hugging Face directory or a hub id, got {model!r} "
                         "(no such directory)")
    else:
        # transformers' own choice: sdpa where the family has it, eager where not (Gemma 2, Bloom, MPT)
        module = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or "auto")
        tokenizer = AutoTokenizer.from_pretrained(model) if has_tokenizer(model) else None
    if dtype is not None:
        module = module.to(dtype)
    return module.to(device).eval(), tokenizer


def max_model_len(config: PretrainedConfig) -> tuple[int, str | None]:
    """Longest sequence the rewritten model serves, and a note when it is not the config's limit.

    The limit is the family's own field (:func:`pagedpack.models.config.position_limit`); a
    model with none (ALiBi) gets :data:`~pagedpack.models.config.DEFAULT_MAX_MODEL_LEN`.
    Sliding windows do not limit it: the paged op attends within each layer's window.
    """
    limit = position_limit(config)
    if limit is None:
        return DEFAULT_MAX_MODEL_LEN, (f"the config records no position limit: max_model_len defaults to "
                                       f"{DEFAULT_MAX_MODEL_LEN} (pass max_model_len to change it)")
    return limit, None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer(model: str) -> bool:
    """False for a local directory holding none of :data:`TOKENIZER_FILES` (a hub id: True)."""
    return not os.path.isdir(model) or any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES)


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
    vocab_size = text_config(model.config).vocab_size  # a multimodal config nests it (Qwen2-VL)
    return ModelDescription(eos_token_ids(model, tokenizer), limit, vocab_size, name, tokenizer), note


def eos_token_ids(model: torch.nn.Module, tokenizer=None) -> list[int]:
    """All end-of-sequence ids that ``model.generate`` stops on (configs may list several)."""
    ids = first_set(getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                    getattr(text_config(model.config), "eos_token_id", None),
                    getattr(tokenizer, "eos_token_id", None))
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
