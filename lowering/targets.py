"""The target registry: every lowering target the project knows, by name.

A target is one object (a :class:`Target`) saying its default block size, which limits a
rewritten model must meet, how to lower it, what runs the result and whether that is an
emulation. ``LLM``, the CLI and the exporters look targets up here and nowhere else know their
names. Adding a target is one module defining a :class:`Target` subclass plus one line in
:data:`_BUILTIN` (or, from user code, one :func:`register_target` call).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedpack.contract import KVCacheSpec


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
class GraphConfig:
    """Which steps a target that compiles graphs runs in them: ``mode`` (one of the target's
    ``graph_modes``) and ``batch_sizes`` (the batch sizes graphs are compiled for, ascending).
    Made by :meth:`Target.graph_config`, which fills in the target's defaults."""

    mode: str | None = None
    batch_sizes: tuple[int, ...] = ()


@dataclass
class LoweredStep:
    """A :class:`~pagedpack.contract.StepProgram` made by a target: ``run`` called with the step
    signature, plus the report line saying what was lowered to what."""

    run: Callable
    kv_cache_specs: list[KVCacheSpec]
    functional: bool = False
    note: str | None = None
    graphs: object | None = None  # what the graph mode did (a GraphStats with describe()), if any
    padding_blocks: int = 0  # KV blocks the runner allocates beyond the pool for padding writes
    # run uses nothing of the rewritten model's graph (a lowered copy, another runtime's session):
    # the LLM may let the rewritten model and the source model go (their shared tensors aside)
    standalone: bool = False

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
    may capture in a child process (:mod:`pagedpack.compile_cache`).
    """

    name: str = ""
    default_block_size: int = 16
    description: str = ""
    builtin_model: dict = field(default_factory=dict)
    graph_modes: tuple[str, ...] = ()
    serves_pt2: bool = False

    def graph_config(self, mode: str | None = None, batch_sizes=None) -> GraphConfig:
        """The :class:`GraphConfig` for ``mode`` / ``batch_sizes`` (None: the target's defaults);
        ``ValueError`` naming the argument for one the target does not take."""
        if mode is not None or batch_sizes is not None:
            raise ValueError(f"graph_mode, graph_batch_sizes: the {self.name} target compiles no step graphs; "
                             f"expected None, got {mode!r}, {batch_sizes!r}")
        return GraphConfig()

    def prepare_device(self, device: torch.device | str) -> None:
        """Make ``device`` usable before the model is moved there (e.g. import a device plugin)."""

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        """Raise ``ValueError`` naming every limit ``rewritten`` (a ``RewrittenModel``) breaks."""

    def lower(self, rewritten, *, block_size: int, bounds: StepBounds, device: torch.device | str) -> LoweredStep:
        """The program that runs ``rewritten``'s steps on this target (may lower it in place). A
        target with ``graph_modes`` also takes ``graph=`` (a :class:`GraphConfig` from :meth:`graph_config`)."""
        return LoweredStep(rewritten, rewritten.kv_cache_specs)

    def emulated(self, device: torch.device | str) -> bool:
        """True if on ``device`` the target's ops run as an emulation of the real ones."""
        return False


@dataclass
class ReferenceTarget(Target):
    """The project's own ops, run as the rewrite left them (any device PyTorch runs); on the CPU the
    linears of a copy run on prepacked oneDNN weights (:meth:`lower`)."""

    name: str = "reference"
    description: str = "the project's ops (pagedpack::reshape_and_cache, paged_attention), any device"
    serves_pt2: bool = True

    def lower(self, rewritten, *, block_size: int, bounds: StepBounds, device: torch.device | str) -> LoweredStep:
        """``rewritten`` as it is, except on the CPU: there a copy of its graph with prepacked
        oneDNN linears and direct native kernel calls (:mod:`pagedpack.lowering.cpu`); the
        rewritten graph itself, which ``LLM.export`` writes, stays as it is."""
        from pagedpack.lowering.cpu import cpu_step

        program, note = cpu_step(rewritten.graph_module, rewritten.kv_cache_specs, device, bounds.max_model_len)
        if program is rewritten.graph_module:
            return LoweredStep(rewritten, rewritten.kv_cache_specs, note=note)
        return LoweredStep(program, rewritten.kv_cache_specs, note=note, standalone=True)


# name -> "module:attribute" of a Target subclass, imported on first use.
_BUILTIN = {
    "reference": "pagedpack.lowering.targets:ReferenceTarget",
    "ascend": "pagedpack.lowering.ascend_target:AscendTarget",
    "onnx": "pagedpack.lowering.onnx_target:OnnxTarget",
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
