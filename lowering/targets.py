"""The target registry: every lowering target the project knows, by name.

A target is one object (a :class:`Target`) saying its default block size, which limits a
rewritten model must meet, how to lower it, what runs the result and whether that is an
emulation, which options it takes (a :class:`TargetOptions` dataclass), what it can do
(``supports_tensor_parallel``, ...), the file formats it writes and serves (:class:`FileFormat`) and
how it serves a file of one. ``LLM``, the CLI and the exporters look targets and formats up here
(:func:`get_target`, :func:`get_format`, :func:`format_of`: a file's format and target by its first
bytes) and nowhere else compare their names. Each built-in target is one package under ``lowering/``
(``reference/``, ``ascend/``, ``onnx/``: its lowering, limits, runner and formats, the
:class:`Target` in ``target.py``); adding one is such a package plus one line in :data:`_BUILTIN`
(or, from user code, one :func:`register_target` call: a process knows a user target, and the files
of its formats, once it has registered it).
"""
from __future__ import annotations

import importlib
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
import torch.fx

from pagedpack.formats.export import check_export_file
from pagedpack.kernels.sparse_attention import sparse_attention_layers
from pagedpack.step.contract import LoweredStep, state_input_names


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


@dataclass(frozen=True)
class FileFormat:
    """A file format a target writes (``pagedpack export --format NAME``, ``LLM.export(format=NAME)``)
    and serves (``LLM(path)``): one module in the target's package defines the value and its two
    functions, and the target lists it in :attr:`Target.formats`.

    ``name``: the registry key (unique over all targets); ``suffix``: the file name's usual ending;
    ``magic``: the bytes every file of the format starts with (how :func:`format_of` knows a file,
    whatever its name); ``export(rewritten, path, description, **options) -> str`` writes a
    ``RewrittenModel`` with its :class:`~pagedpack.step.contract.ModelDescription`; ``load(path, *,
    trust_file) -> ExportedStep`` reads one back (:mod:`pagedpack.formats.export` has the format-neutral
    parts: metadata, tokenizer, checks); ``options``: the export options it takes by name (e.g.
    ONNX's ``attention``); ``serve_hint(path, options) -> str``: how to serve what it wrote (the
    CLI prints it). A tensor-parallel manifest names one file of the format ``ranks_of`` per rank:
    its ``export`` takes ``model=`` and ``tensor_parallel_size=``, its ``load`` ``rank=``, and
    ``world_size(path)`` is the ranks a file needs.
    """

    name: str
    suffix: str
    magic: bytes
    export: Callable
    load: Callable
    description: str = ""
    options: tuple[str, ...] = ()
    serve_hint: Callable | None = None
    ranks_of: str | None = None
    world_size: Callable | None = None

    def check_options(self, options: dict) -> None:
        """``ValueError`` naming an export option this format does not take, and the formats that do."""
        for key, value in options.items():
            if key not in self.options:
                takers = [f.name for f, _ in file_formats().values() if key in f.options]
                raise ValueError(f"{key}: only with format {' or '.join(map(repr, takers)) or 'none'}, got "
                                 f"{key}={value!r} with {self.name!r}")

    def hint(self, path: str, options: dict) -> str:
        """How to serve the file this format wrote at ``path`` with ``options``."""
        return self.serve_hint(path, options) if self.serve_hint else f"LLM({path!r}) or pagedpack serve {path}"


@dataclass
class Target:
    """One lowering target. Subclasses override what differs from the defaults below.

    ``name``: the registry key (``LLM(target=...)``, ``--target``); ``default_block_size``:
    tokens per KV block when the user gives none; ``builtin_model``: config overrides that shape
    the built-in tiny model for this target (:func:`pagedpack.models.tiny.default_model`);
    ``description``: one line for ``--help``; ``serves_pt2``: its program for a rewritten graph on
    the CPU is the one ``LLM.from_exported`` builds from the graph's ``.pt2`` export, so ``LLM(path)``
    may capture in a child process (:mod:`pagedpack.compiler.compile_cache`); ``options_type``: the
    :class:`TargetOptions` subclass of its options; ``formats``: the :class:`FileFormat` s it writes
    and serves; ``supports_tensor_parallel``: it runs a step graph sharded over ranks whose
    collectives it keeps (``tensor_parallel_size > 1``, CPU, gloo); ``recurrent_ops``: the recurrent
    ops (:mod:`pagedpack.kernels.recurrent`, by name: :data:`RECURRENT_OPS`) it runs, with their state
    inputs; a model with a layer of another one is refused naming the layer and the op
    (:meth:`recurrent_refusals`); ``sparse_attention``: it runs the sparse-attention (DSA) ops
    (:mod:`pagedpack.kernels.sparse_attention`); a model with such layers is refused elsewhere, naming
    each layer and the lowering it lacks (:meth:`sparse_attention_refusals`).
    """

    name: str = ""
    default_block_size: int = 16
    description: str = ""
    builtin_model: dict = field(default_factory=dict)
    serves_pt2: bool = False
    options_type: type = TargetOptions
    formats: tuple[FileFormat, ...] = ()
    supports_tensor_parallel: bool = False
    recurrent_ops: frozenset[str] = frozenset()
    sparse_attention: bool = False
    supports_lora: bool = False  # runs pagedpack::lora_shrink / lora_expand (enable_lora)

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

    def recurrent_refusals(self, rewritten) -> list[str]:
        """One line per recurrent site of ``rewritten`` whose op is not one of :attr:`recurrent_ops`:
        its layer, the op and why (:meth:`missing_recurrent_op`)."""
        return [f"{layer}: {op}: {self.missing_recurrent_op(op)}" for op, layer in recurrent_sites(rewritten)
                if op not in self.recurrent_ops]

    def missing_recurrent_op(self, op: str) -> str:
        """Why this target does not run the recurrent op ``op`` (one of :data:`RECURRENT_OPS`)."""
        return f"the {self.name} target does not run it yet"

    def sparse_attention_refusals(self, rewritten) -> list[str]:
        """One line per sparse-attention (DSA) layer of ``rewritten`` if this target does not run
        :attr:`sparse_attention`: the layer and why (:meth:`missing_sparse_attention`)."""
        if self.sparse_attention:
            return []
        return [f"{layer}: {self.missing_sparse_attention()}"
                for layer in sparse_attention_layers(rewritten.graph_module.graph)]

    def missing_sparse_attention(self) -> str:
        """Why this target does not run a sparse-attention layer."""
        return (f"the {self.name} target has no lowering of the lightning indexer and sparse attention "
                "(indexer_k_cache, paged_indexer_topk, sparse_paged_attention) yet")

    def lower(self, rewritten, options: TargetOptions, *, block_size: int, bounds: StepBounds,
              device: torch.device | str) -> LoweredStep:
        """The program that runs ``rewritten``'s steps on this target (may lower it in place);
        ``options`` from :meth:`options`."""
        return LoweredStep(rewritten, rewritten.kv_cache_specs)

    def load_exported(self, path: str, fmt: FileFormat, *, trust_file: bool, device: torch.device | str,
                      max_model_len: int | None, rank: int = 0) -> LoweredStep:
        """The program serving ``path``, a file of ``fmt`` (one of :attr:`formats`, as :func:`format_of`
        found it), with its ``description``: by default what ``fmt.load`` returns; a target that
        lowers loaded programs further overrides it. ``rank``: which rank of a manifest."""
        return fmt.load(path, trust_file=trust_file, **({"rank": rank} if fmt.world_size else {}))

    def emulated(self, device: torch.device | str) -> bool:
        """True if on ``device`` the target's ops run as an emulation of the real ones."""
        return False


# the recurrent ops a rewritten step may hold (pagedpack.kernels.recurrent), by name
RECURRENT_OPS = ("causal_conv1d_varlen", "gated_delta_rule_varlen", "selective_scan_varlen",
                 "lightning_attention_varlen")


def recurrent_sites(rewritten) -> list[tuple[str, str]]:
    """``(op name, layer)`` of each recurrent op call in ``rewritten``'s step graph, in graph order; the
    layer is that of the state input it reads (``rewritten.state_specs``, in state-input order)."""
    specs = list(getattr(rewritten, "state_specs", ()))
    layers = dict(zip(state_input_names(specs), (spec.layer for spec in specs)))
    sites = []
    for node in rewritten.graph_module.graph.nodes:
        op = getattr(node.target, "_opname", None)
        if node.op == "call_function" and op in RECURRENT_OPS and node.target.namespace == "pagedpack":
            state = next(a.name for a in node.args if isinstance(a, torch.fx.Node) and a.name in layers)
            sites.append((op, layers[state]))
    return sites


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


def target_names(*, supports_tensor_parallel: bool = False) -> list[str]:
    """Every registered target name, sorted; with ``supports_tensor_parallel``, only those of targets
    that have that capability (:attr:`Target.supports_tensor_parallel`)."""
    names = sorted({*_BUILTIN, *_REGISTRY})
    return [n for n in names if get_target(n).supports_tensor_parallel] if supports_tensor_parallel else names


def get_target(name=None) -> Target:
    """The target registered as ``name`` (None: :data:`DEFAULT_TARGET`); ``ValueError`` listing the
    names for any other value."""
    if name is None:
        name = DEFAULT_TARGET
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not isinstance(name, str) or name not in _BUILTIN:
        raise ValueError(f"target: expected one of {target_names()}, got {name!r}")
    module, attribute = _BUILTIN[name].split(":")
    return register_target(getattr(importlib.import_module(module), attribute)(name=name))


def file_formats() -> dict[str, tuple[FileFormat, Target]]:
    """Every format of every registered target (the built-in ones imported), by name, with its
    target; ``ValueError`` if two targets register one name."""
    out: dict[str, tuple[FileFormat, Target]] = {}
    for target in map(get_target, target_names()):
        for fmt in target.formats:
            if fmt.name in out and out[fmt.name][1] is not target:
                raise ValueError(f"format: {fmt.name!r} is registered by the {out[fmt.name][1].name} and the "
                                 f"{target.name} targets")
            out[fmt.name] = (fmt, target)
    return out


def format_names() -> list[str]:
    """The formats a model can be exported as (``--format``): all but the tensor-parallel manifests."""
    return sorted(name for name, (fmt, _) in file_formats().items() if fmt.ranks_of is None)


def get_format(name) -> tuple[FileFormat, Target]:
    """The export format ``name`` (one of :func:`format_names`) and its target; ``ValueError`` otherwise."""
    found = file_formats().get(name) if isinstance(name, str) else None
    if found is None or found[0].ranks_of is not None:
        raise ValueError(f"format: expected one of {format_names()}, got {name!r}")
    return found


def export_format_for(path, name: str | None) -> tuple[FileFormat, Target]:
    """The export format to write ``path`` as: ``name`` (:func:`get_format`), or, None, the one whose
    suffix ``path`` ends with (``pt2`` for any other name). ``ValueError`` naming ``format`` when ``path``
    ends with another format's suffix (``model.onnx`` written as a ``.pt2`` archive would be served as
    neither)."""
    path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    named = [fmt.name for fmt, _ in map(get_format, format_names()) if path.lower().endswith(fmt.suffix)]
    if name is None:
        return get_format(named[0] if len(named) == 1 else "pt2")
    found = get_format(name)
    if named and name not in named:
        raise ValueError(f"format: {path!r} ends with the {named[0]} suffix, got format={name!r}; name the file "
                         f"{found[0].suffix} or leave format out")
    return found


def tensor_parallel_format(name: str) -> tuple[FileFormat, Target]:
    """The manifest format that splits a model over ranks as files of the export format ``name``;
    ``ValueError`` if that format has none."""
    fmt, target = get_format(name)
    for manifest, owner in file_formats().values():
        if manifest.ranks_of == fmt.name and owner is target and target.supports_tensor_parallel:
            return manifest, owner
    raise ValueError(f"tensor_parallel_size: a tensor-parallel export is written as files of a format with a "
                     f"manifest ({[f.name for f, _ in file_formats().values() if f.ranks_of]} of "
                     f"{sorted({f.ranks_of for f, _ in file_formats().values() if f.ranks_of})}), got format {name!r}")


def format_of(path) -> tuple[FileFormat, Target]:
    """The format of the file at ``path`` and the target serving it, by the file's first bytes
    (:attr:`FileFormat.magic`), whatever its name; where several formats claim them, the one whose
    suffix the name has. ``ValueError`` for no file, an empty one or one no format claims."""
    path = check_export_file(path)
    with open(path, "rb") as file:
        head = file.read(64)
    if not head:
        raise ValueError(f"path: {path!r} is empty (0 bytes), not an export")
    formats = file_formats().values()
    claims = [(fmt, target) for fmt, target in formats if head.startswith(fmt.magic)]
    if len(claims) > 1:
        claims = [(fmt, target) for fmt, target in claims if path.endswith(fmt.suffix)]
    if len(claims) != 1:
        known = "; ".join(f"{fmt.name}: {fmt.description}" for fmt, _ in formats)
        raise ValueError(f"path: {path!r} is not a file of any registered export format ({known})")
    return claims[0]
