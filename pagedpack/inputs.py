"""Checks and normalisation of what users pass to :class:`pagedpack.LLM`.

Every failure is a ``ValueError`` naming the argument, what was expected and what came.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ATTENTION_FORMS = ("sdpa", "eager")


@dataclass
class Prompt:
    """One prompt: ``content`` (text or token ids) and its ``cache_salt`` (None: unsalted)."""

    content: str | list[int]
    cache_salt: str | None = None


def normalize_prompts(prompts) -> list[Prompt]:
    """``prompts`` as a list of :class:`Prompt`: a string, a list of ints, a 1-D tensor or a dict
    (vLLM's ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, either with an optional
    ``"cache_salt"`` string) is one prompt; a list of those (or a 2-D tensor) is several."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        prompts = [prompts]
    elif isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts: expected a string, a list of token ids, a dict, or a list of those, "
                         f"got {type(prompts).__name__}")
    return [normalize_prompt(prompt, f"prompts[{i}]") for i, prompt in enumerate(prompts)]


def normalize_prompt(prompt, name: str = "prompt") -> Prompt:
    """One prompt as a :class:`Prompt` (the forms of :func:`normalize_prompts`); ``ValueError`` naming ``name``."""
    if isinstance(prompt, Prompt):
        return prompt
    if isinstance(prompt, str):
        return Prompt(_text(name, prompt))
    if _is_token_list(prompt):
        return Prompt([int(t) for t in prompt])
    if isinstance(prompt, dict):
        keys = set(prompt) - {"cache_salt"}
        salt = prompt.get("cache_salt")
        if salt is not None:
            check_cache_salt(f"{name}['cache_salt']", salt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return Prompt(_text(f"{name}['prompt']", prompt["prompt"]), salt)
        if keys == {"prompt_token_ids"} and _is_token_list(prompt["prompt_token_ids"]):
            return Prompt([int(t) for t in prompt["prompt_token_ids"]], salt)
        raise ValueError(f"{name}: expected a dict of 'prompt' (a string) or 'prompt_token_ids' (a list of int "
                         f"token ids), and optionally 'cache_salt', got {prompt!r:.80}")
    raise ValueError(f"{name}: expected a string, a list of int token ids or a dict, got {prompt!r:.80}")


def _text(name: str, text: str) -> str:
    if not _encodable(text):
        raise ValueError(f"{name}: expected text encodable as UTF-8, got {text!r:.80} (a lone surrogate)")
    return text


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_cache_salt(name: str, salt) -> None:
    """A salt is a non-empty string encodable as UTF-8 (vLLM rejects an empty one as well)."""
    if not isinstance(salt, str) or not salt or not _encodable(salt):
        raise ValueError(f"{name}: expected a non-empty string encodable as UTF-8, got {salt!r:.80}")


def _is_token_list(value) -> bool:
    if isinstance(value, torch.Tensor):
        return (value.dim() == 1 and not value.is_floating_point() and not value.is_complex()
                and value.dtype != torch.bool)
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Every id is in ``[0, vocab_size)``."""
    bad = next(((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt: expected token ids in [0, vocab_size={vocab_size}), "
                         f"got {bad[1]} at position {bad[0]}")


def resolve_dtype(dtype) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype: expected a torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


# kv_cache_dtype names (vLLM's ``--kv-cache-dtype``; "fp8" is fp8_e4m3 there too) -> the dtype the KV
# cache is stored in; "auto": the model's. int8 / fp8 rows carry their scale (pagedpack.kernels.kv_quant).
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                   "fp8": torch.float8_e4m3fn}


def check_kv_cache_dtype(name) -> str:
    """``name`` if it is a :data:`KV_CACHE_DTYPES` name, else ``ValueError`` listing them."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    return name


def check_causal_lm(model) -> None:
    """``model`` is a ``transformers`` causal LM that generates, with an attention form the
    capture supports."""
    name = type(model).__name__
    can_generate = getattr(model, "can_generate", None)
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and callable(can_generate)
            and can_generate() and not model.config.is_encoder_decoder):
        raise ValueError(f"model: expected a transformers causal LM (a ...ForCausalLM that can generate), got {name}")
    form = getattr(model.config, "_attn_implementation", None)
    if form not in _ATTENTION_FORMS:
        raise ValueError(f"model: attn_implementation={form!r} is not supported; expected one of "
                         f"{_ATTENTION_FORMS} (load the model with attn_implementation='sdpa')")


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` is an int (not a bool) ``>= minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(name: str, value) -> int:
    """A positive byte count from an int, a float or a string such as ``"4GiB"``, ``"512 MB"``,
    ``"1.5e9"`` (``KB``/``MB``/``GB``: powers of 1000; ``KiB``/``MiB``/``GiB``: of 1024)."""
    number, unit = value, ""
    if isinstance(value, str):
        text = value.strip().lower()
        stripped = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = stripped.strip(), text[len(stripped):]
        try:
            number = float(number)
        except ValueError:
            number = None
    ok = (isinstance(number, (int, float)) and not isinstance(number, bool) and unit in _UNITS
          and (isinstance(number, int) or math.isfinite(number)) and number * _UNITS[unit] >= 1)
    if not ok:
        raise ValueError(f"{name}: expected a positive number of bytes such as 4294967296, '4GiB' or '512MB', "
                         f"got {value!r}")
    return int(number * _UNITS[unit])


def parse_config(cls, value, name: str):
    """An instance of the dataclass ``cls`` from JSON text (the command line's), a dict of its fields, or
    an instance; None passes. ``ValueError`` naming ``name`` (or ``name.<field>``, for a field ``cls``
    lacks) otherwise; the fields' own checks are ``cls``'s."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, (str, bytes)):
        import msgspec

        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as err:
            raise ValueError(f"{name}: expected a JSON object, got {value!r:.80} ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object (a dict), got {value!r:.80}")
    known = [f.name for f in fields(cls)]
    for key in value:
        if key not in known:
            raise ValueError(f"{name}.{key}: expected one of the fields {known}, got {key!r:.80}")
    return cls(**value)
