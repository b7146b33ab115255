"""The target registry: every lowering target the project knows, by name.

A target is one object (a :class:`Target`) saying its default block size, which limits a
rewritten model must meet, how to lower it, what runs the result and whether that is an
emulation, which options it takes (a :class:`TargetOptions` dataclass) and how it serves an
exported file. ``LLM``, the CLI and the exporters look targets up here and nowhere else know their
names. Each built-in target is one package under ``lowering/`` (``reference/``, ``ascend/``,
``onnx/``: its lowering, limits, runner and exporter, the :class:`Target` in ``target.py``); adding
one is such a package plus one line in :data:`_BUILTIN` (or, from user code, one
:func:`register_target` call).
"""
from __future__ import annotations

import importlib
import typing
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from pagedpack.contract import KVCacheSpec, ModelDescription


class TargetUnavailableError(RuntimeError):
    """A target's runtime (a device plugin, a compiler) cannot be imported on this machine."""


@dataclass(frozen=True)
class StepBounds:
    """Upper bounds of every step a lowered program will run: tokens ``T`` and sequences ``B``;
    ``max_model_len``: most tokens per sequence (None: not known yet)."""

    max_num_tokens: int
    max_num_seqs: int
    max_model_len: int | None = None


@dataclass(frozen=True)
class TargetOptions:
    """A target's own options (``LLM(target_options={...})``, ``--target-option key=value``): a
    frozen dataclass whose fields are the options, with defaults, checked in ``__post_init__``
    (``ValueError`` naming the option). This base has none; a target with options subclasses it
    and names the subclass in :attr:`Target.options_type`."""

    @classmethod
    def from_strings(cls, target: str, pairs) -> dict:
        """``{"key": value}`` from ``["key=value", ...]`` (the command line), each value read as its
        field's type: ``int``, ``float``, ``bool`` (true/false/1/0), ``str``, or a tuple of ints
        (``4,8,16``); ``ValueError`` naming ``--target-option`` otherwise."""
        hints = typing.get_type_hints(cls)
        out = {}
        for pair in pairs:
            key, sep, text = pair.partition("=")
            if not sep or key not in hints:
                raise ValueError(f"--target-option: expected KEY=VALUE with KEY one of {sorted(hints)} "
                                 f"(the {target} target's options), got {pair!r}")
            out[key] = _from_string(key, hints[key], text)
        return out


def _from_string(key: str, hint, text: str):
    kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
    kind = kinds[0] if kinds else str
    try:
        if typing.get_origin(kind) is tuple:
            return tuple(int(item) for item in text.split(","))
        if kind is bool:
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        return kind(text)
    except (ValueError, KeyError) as err:
        raise ValueError(f"--target-option: {key}: expected a {getattr(kind, '__name__', kind)}, got {text!r}") from err


@dataclass
class LoweredStep:
    """A :class:`~pagedpack.contract.StepProgram` made by a target: ``run`` called with the step
    signature, plus the report line saying what was lowered to what and the model's
    ``description`` (set by whoever built or loaded it)."""

    run: Callable
    kv_cache_specs: list[KVCacheSpec]
    functional: bool = False
    note: str | None = None
    graphs: object | None = None  # what the graph mode did (a GraphStats with describe()), if any
    padding_blocks: int = 0  # KV blocks the runner allocates beyond the pool for padding writes
    # run uses nothing of the rewritten model's graph (a lowered copy, another runtime's session):
    # the LLM may let the rewritten model and the source model go (their shared tensors aside)
    standalone: bool = False
    description: ModelDescription | None = None
    # None: ``logits_indices`` may hold any rows (prompt_logprobs asks for more than one per sequence);
    # else why the program takes exactly one per sequence (the error refusing prompt_logprobs says it)
    one_logits_row_per_seq: str | None = None

    def __call__(self, *inputs: torch.Tensor):
        return self.run(*inputs)


@dataclass
class Target:
    """One lowering target. Subclasses override what differs from the defaults below.

    ``name``: the registry key (``LLM(target=...)``, ``--target``); ``default_block_size``:
    tokens per KV block when the user gives none; ``builtin_model``: config overrides that shape
    the built-in tiny model for this target (:func:`pagedpack.models.tiny.default_model`);
    ``description``: one line for ``--help``; ``serves_pt2``: its program for a rewritten graph on
    the CPU is the one ``LLM.from_exported`` builds from the graph's ``.pt2`` export, so ``LLM(path)``
    may capture in a child process (:mod:`pagedpack.compile_cache`); ``options_type``: the
    :class:`TargetOptions` subclass of its options.
    """

    name: str = ""
    default_block_size: int = 16
    description: str = ""
    builtin_model: dict = field(default_factory=dict)
    serves_pt2: bool = False
    options_type: type = TargetOptions

    def options(self, given=None) -> TargetOptions:
        """The target's validated :attr:`options_type` from ``given`` (None, a dict by option name, or
        an instance); ``ValueError`` naming ``target_options`` for an option it does not take."""
        if isinstance(given, self.options_type):
            return given
        if given is None:
            given = {}
        names = [f.name for f in fields(self.options_type)]
        if not isinstance(given, dict) or any(key not in names for key in given):
            unknown = [key for key in given if key not in names] if isinstance(given, dict) else given
            raise ValueError(f"target_options: the {self.name} target takes {names or 'no options'}, "
                             f"got {unknown!r:.120}")
        return self.options_type(**given)

    def prepare_device(self, device: torch.device | str) -> None:
        """Make ``device`` usable before the model is moved there (e.g. import a device plugin)."""

    def check_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
        """Raise ``ValueError`` unless this target's programs run with KV caches of ``kv_cache_dtype``
        where the program was built for ``cache_dtype`` (the model's). By default only the same."""
        if kv_cache_dtype != cache_dtype:
            raise ValueError(f"kv_cache_dtype: the {self.name} target keeps the KV cache in the model's dtype "
                             f"({_name(cache_dtype)}), got {_name(kv_cache_dtype)}")

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        """Raise ``ValueError`` naming every limit ``rewritten`` (a ``RewrittenModel``) breaks."""

    def lower(self, rewritten, options: TargetOptions, *, block_size: int, bounds: StepBounds,
              device: torch.device | str) -> LoweredStep:
        """The program that runs ``rewritten``'s steps on this target (may lower it in place);
        ``options`` from :meth:`options`."""
        return LoweredStep(rewritten, rewritten.kv_cache_specs)

    def load_exported(self, path: str, *, trust_file: bool, device: torch.device | str,
                      max_model_len: int | None) -> LoweredStep:
        """The program serving ``path``, a file ``pagedpack export`` wrote in a format this target runs
        (:data:`pagedpack.export.FILE_TARGETS`), with its ``description``; ``ValueError`` if it is not one."""
        raise ValueError(f"model: the {self.name} target serves no exported file, got {path!r}")

    def emulated(self, device: torch.device | str) -> bool:
        """True if on ``device`` the target's ops run as an emulation of the real ones."""
        return False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# name -> "module:attribute" of a Target subclass, imported on first use.
_BUILTIN = {
    "reference": "pagedpack.lowering.reference.target:ReferenceTarget",
    "ascend": "pagedpack.lowering.ascend.target:AscendTarget",
    "onnx": "pagedpack.lowering.onnx.target:OnnxTarget",
}
_REGISTRY: dict[str, Target] = {}
DEFAULT_TARGET = "reference"


def register_target(target: Target) -> Target:
    """Make ``target`` available under ``target.name`` (replacing any target of that name)."""
    if not isinstance(target, Target) or not target.name:
        raise ValueError(f"target: expected a Target with a name, got {target!r}")
    _REGISTRY[target.name] = target
    return target


def target_names() -> list[str]:
    """Every registered target name, sorted."""
    return sorted({*_BUILTIN, *_REGISTRY})


def get_target(name) -> Target:
    """The target registered as ``name``; ``ValueError`` listing the names for any other value."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not isinstance(name, str) or name not in _BUILTIN:
        raise ValueError(f"target: expected one of {target_names()}, got {name!r}")
    module, attribute = _BUILTIN[name].split(":")
    return register_target(getattr(importlib.import_module(module), attribute)(name=name))
