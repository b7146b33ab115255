"""Export the rewritten step graph as a ``torch.export`` ``.pt2`` archive, and load it back;
the metadata and example step shared with the ONNX export (:mod:`pagedpack.onnx_export`).

The archive holds one ``ExportedProgram`` of the step graph (the signature of
:mod:`pagedpack.passes.pipeline`)::

    forward(input_ids [T], positions [T], cu_seqlens_q [B+1], seq_lens [B],
            block_table [B, max_blocks_per_seq], slot_mapping [T], logits_indices [B],
            key_cache_0, value_cache_0, ...)            # [num_blocks, block_size, H_kv, D]
        -> logits [B, vocab]

dynamic in ``T``, ``B`` (``cu_seqlens_q`` is ``B + 1``), ``max_blocks_per_seq``,
``num_blocks`` and ``block_size``: the block size is a runtime choice, not baked in.

KV caches: the program is kept in export's default IR, where ``pagedpack::reshape_and_cache``
stays an in-place call on the cache inputs (no functionalisation, so no per-step copy of the
caches); the loaded ``.module()`` therefore updates the caller's cache tensors, as the step
graph does, and the runner passes its own caches exactly as for the un-exported graph.

Besides the program, ``extra_files["pagedpack.json"]`` stores what the runtime needs (see
:func:`export_metadata` and :class:`ExportedStep`): format version, input names, KV cache specs,
eos ids, ``max_model_len``, vocabulary size, the model name, and the tokenizer's files (base64)
when there is one. ``import pagedpack`` registers the custom ops the program calls, which is all
a fresh process needs before :func:`load_pt2` (or :func:`load_exported`, for either format).
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedpack.passes.pipeline import METADATA_INPUTS, KVCacheSpec, RewrittenModel, cache_input_names

FORMATS = ("pt2", "onnx")
FORMAT_VERSION = 1
META_FILE = "pagedpack.json"


@dataclass
class ExportedStep:
    """A loaded step program plus its metadata; what :class:`ModelRunner` needs
    (``graph_module``, ``kv_cache_specs``) in the shape of :class:`RewrittenModel`."""

    # ``torch.export.load(path).module()``, or an onnxruntime session adapter returning
    # ``(logits, *updated caches)`` (:class:`pagedpack.runtime.onnx_session.OnnxSessionStep`)
    graph_module: Callable
    kv_cache_specs: list[KVCacheSpec]
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int | None = None
    vocab_size: int | None = None
    model_name: str | None = None
    tokenizer: object | None = None
    attention: str | None = None  # ONNX: the attention lowering it was exported with
    report = None  # no pass report travels with the file

    bytes_per_token = RewrittenModel.bytes_per_token  # the same sum over kv_cache_specs

    def raise_if_refused(self) -> None:  # an exported file only ever holds a rewritten program
        return None


def check_format(fmt: str) -> str:
    """``fmt`` if it is an export format pagedpack writes, else ``ValueError``."""
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def export_pt2(source, path: str | os.PathLike, *, eos_token_ids: list[int] | None = None,
               max_model_len: int | None = None, tokenizer=None, model_name: str | None = None) -> str:
    """Export ``source`` (an :class:`~pagedpack.LLM` or a :class:`RewrittenModel`) to ``path``.

    For an ``LLM`` the eos ids, ``max_model_len``, vocabulary size and tokenizer are read off it;
    for a bare ``RewrittenModel`` pass them (optional). Returns ``str(path)``.
    Raises ``ValueError`` for a source that is not a rewritten reference-target model, or a
    ``path`` that cannot be written (checked before exporting); ``TypeError`` if ``path`` is not
    a path.
    """
    rewritten, meta = export_metadata(source, eos_token_ids=eos_token_ids, max_model_len=max_model_len,
                                      tokenizer=tokenizer, model_name=model_name)
    path = check_output_path(path)
    program = _export_program(rewritten)
    if meta["vocab_size"] is None:  # a bare RewrittenModel: read it off the exported logits
        output = next(n for n in program.graph.nodes if n.op == "output")
        meta["vocab_size"] = int(output.args[0][0].meta["val"].shape[-1])
    # "in_place": the program calls reshape_and_cache on the cache inputs; "copied_back": export
    # functionalised it and the loaded .module() copies the new caches into the inputs.
    meta["cache_mutation"] = "copied_back" if any(spec.kind.name == "USER_INPUT_MUTATION" for spec in
                                                  program.graph_signature.output_specs) else "in_place"
    with writing(path):
        torch.export.save(program, path, extra_files={META_FILE: json.dumps(meta)})
    return path


def export_metadata(source, *, eos_token_ids=None, max_model_len=None, tokenizer=None, model_name=None,
                    ) -> tuple[RewrittenModel, dict]:
    """``(rewritten step graph, metadata)`` of an export ``source``: an ``LLM`` (reference target)
    or a ``RewrittenModel``. The metadata is what :func:`step_from_metadata` reads back: format
    version, input names, KV cache specs, eos ids, ``max_model_len``, vocabulary size (None for a
    ``RewrittenModel``: the exporter reads it off its program), model name and the tokenizer's
    files (base64). ``ValueError`` for any other source or a refused rewrite."""
    from pagedpack.llm import LLM

    vocab_size = None
    if isinstance(source, LLM):
        if not isinstance(source.rewritten, RewrittenModel):
            raise ValueError("source: an LLM served from an exported file (LLM.from_exported) cannot be exported "
                             "again; export the original model")
        if source.target != "reference":
            raise ValueError(f"source: expected an LLM with target='reference', got target={source.target!r}")
        rewritten = source.rewritten
        eos_token_ids = source._eos if eos_token_ids is None else eos_token_ids
        max_model_len = max_model_len or source.max_model_len
        tokenizer = tokenizer or source.tokenizer
        vocab_size = source.vocab_size
        if model_name is None:
            model_name = getattr(getattr(source.model, "config", None), "_name_or_path", None) or None
    elif isinstance(source, RewrittenModel):
        rewritten = source
    else:
        raise ValueError(f"source: expected an LLM or a RewrittenModel, got {type(source).__name__}")
    rewritten.raise_if_refused()
    meta = {
        "format_version": FORMAT_VERSION,
        "signature": [*METADATA_INPUTS, *cache_input_names(len(rewritten.kv_cache_specs))],
        "kv_cache_specs": [{"num_kv_heads": s.num_kv_heads, "key_head_size": s.key_head_size,
                            "value_head_size": s.value_head_size, "dtype": str(s.dtype).removeprefix("torch.")}
                           for s in rewritten.kv_cache_specs],
        "eos_token_ids": [int(i) for i in (eos_token_ids or [])],
        "max_model_len": max_model_len,
        "vocab_size": vocab_size,
        "model_name": model_name,
        "tokenizer_files": _tokenizer_files(tokenizer),
    }
    return rewritten, meta


def check_output_path(path) -> str:
    """``str(path)`` if a file can be written there; ``TypeError``/``ValueError`` naming ``path``
    otherwise (checked before any work is done)."""
    path = _path_arg(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"path: expected a file name, got {path!r} (a directory)")
    if not os.path.isdir(parent):
        raise ValueError(f"path: expected a file in an existing directory, got {path!r} (no such directory)")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"path: expected a writable directory, got {path!r} (cannot write to {parent!r})")
    return path


@contextlib.contextmanager
def writing(path: str):
    """Turn what a writer raises for ``path`` (``OSError``, torch's ``RuntimeError``) into a ``ValueError``."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        raise ValueError(f"path: cannot write {path!r} ({type(err).__name__}: {err})") from err


def _path_arg(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"path: expected a non-empty str or os.PathLike, got {path!r}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path: expected a str or os.PathLike of str, got {path!r}")
    return path


def check_export_file(path) -> str:
    path = _path_arg(path)
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no such file"
        raise ValueError(f"path: expected a .pt2 archive or .onnx model written by 'pagedpack export', "
                         f"got {path!r} ({what})")
    return path


def load_exported(path) -> ExportedStep:
    """Load a file written by ``pagedpack export``, whatever its name: a ``.pt2`` archive (a zip
    file) or an ONNX model (anything else); ``ValueError`` if it is neither."""
    path = check_export_file(path)
    if zipfile.is_zipfile(path):
        return load_pt2(path)
    from pagedpack.onnx_export import load_onnx

    return load_onnx(path)


def load_pt2(path) -> ExportedStep:
    """Load an archive written by :func:`export_pt2`; ``ValueError`` if ``path`` is missing or
    is not a pagedpack ``.pt2`` archive."""
    path = check_export_file(path)
    extra = {META_FILE: ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except Exception as err:  # zip errors, missing archive entries, unknown ops, ...
        raise ValueError(f"path: {path!r} is not a loadable torch.export archive ({type(err).__name__}: {err})") from err
    if not extra[META_FILE]:
        raise ValueError(f"path: {path!r} is a torch.export archive but not a pagedpack one (no {META_FILE})")
    return step_from_metadata(program.module(), extra[META_FILE], path)


_CACHE_DTYPES = ("float32", "float16", "bfloat16")
_OPTIONAL = {"max_model_len": int, "model_name": str, "tokenizer_files": dict}
_REQUIRED = {"signature": list, "kv_cache_specs": list, "eos_token_ids": list, "vocab_size": int}


def step_from_metadata(step: Callable, raw: str, path: str) -> ExportedStep:
    """An :class:`ExportedStep` running ``step``, from the metadata JSON :func:`export_metadata`
    wrote; ``ValueError`` naming ``path`` and the field for another format version or metadata
    that does not describe a pagedpack step program."""
    def invalid(name, expected, got):
        return ValueError(f"path: {path!r} has invalid pagedpack metadata: {name}: expected {expected}, "
                          f"got {got!r:.80}")

    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as err:
        raise invalid(META_FILE, "JSON", raw) from err
    if not isinstance(meta, dict):
        raise invalid(META_FILE, "a JSON object", meta)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"path: {path!r} has pagedpack format_version {meta.get('format_version')!r}, "
                         f"this pagedpack reads {FORMAT_VERSION}")
    for name, kind in (*_REQUIRED.items(), *_OPTIONAL.items()):
        value = meta.get(name)
        if not (isinstance(value, kind) and not isinstance(value, bool)) and not (name in _OPTIONAL and value is None):
            raise invalid(name, kind.__name__ + (" or null" if name in _OPTIONAL else ""), value)
    specs = []
    for spec in meta["kv_cache_specs"]:
        sizes = [spec.get(k) if isinstance(spec, dict) else None
                 for k in ("num_kv_heads", "key_head_size", "value_head_size")]
        if not all(isinstance(n, int) and n > 0 for n in sizes) or spec.get("dtype") not in _CACHE_DTYPES:
            raise invalid("kv_cache_specs", f"positive head counts/sizes and a dtype in {_CACHE_DTYPES}", spec)
        specs.append(KVCacheSpec(*sizes, getattr(torch, spec["dtype"])))
    signature = [*METADATA_INPUTS, *cache_input_names(len(specs))]
    if not specs or meta["signature"] != signature:
        raise invalid("signature", f"{signature} (one cache pair per kv_cache_specs entry)", meta["signature"])
    if not all(isinstance(i, int) for i in meta["eos_token_ids"]):
        raise invalid("eos_token_ids", "a list of ints", meta["eos_token_ids"])
    try:
        tokenizer = _load_tokenizer(meta.get("tokenizer_files"))
    except Exception as err:  # corrupt files: whatever transformers raises
        raise invalid("tokenizer_files", "a saved tokenizer", f"{type(err).__name__}: {err}") from err
    return ExportedStep(step, specs, meta["eos_token_ids"], meta.get("max_model_len"), meta["vocab_size"],
                        meta.get("model_name"), tokenizer, meta.get("attention"))


def _export_program(rewritten: RewrittenModel) -> torch.export.ExportedProgram:
    """``torch.export`` the step graph on :func:`example_step` with every size dynamic."""
    args, dynamic_shapes = example_step(rewritten)
    with torch.no_grad():
        return torch.export.export(rewritten.graph_module, args, dynamic_shapes=dynamic_shapes, strict=False)


def example_step(rewritten: RewrittenModel) -> tuple[tuple, tuple]:
    """``(args, dynamic_shapes)``: a small valid step for the rewritten graph, and the
    ``torch.export`` dims that make every size dynamic (tokens, sequences, blocks per sequence,
    number of blocks, block size; ``cu_seqlens_q`` is sequences + 1).

    Example sizes are distinct and >= 2 (export specialises 0 and 1); the dims' minimum is 1,
    so a step of one token of one sequence runs too.
    """
    device = next(rewritten.graph_module.parameters()).device
    q_lens, block_size, num_blocks, max_blocks = [2, 5, 4], 6, 11, 3  # T=11 tokens, B=3 sequences
    num_tokens, num_seqs = sum(q_lens), len(q_lens)
    positions = torch.cat([torch.arange(n) for n in q_lens])
    block_table = torch.arange(num_seqs * max_blocks, dtype=torch.int32).view(num_seqs, max_blocks) % num_blocks
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(q_lens))
    slots = block_table[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = [torch.zeros(num_tokens, dtype=torch.long), positions, cu, torch.tensor(q_lens, dtype=torch.int32),
            block_table, slots, cu[1:].long() - 1]
    for spec in rewritten.kv_cache_specs:
        args += [torch.zeros(shape, dtype=spec.dtype) for shape in spec.cache_shapes(num_blocks, block_size)]

    dim = torch.export.Dim
    t, b = dim("num_tokens", min=1), dim("num_seqs", min=1)
    m, n, bs = dim("max_blocks_per_seq", min=1), dim("num_blocks", min=1), dim("block_size", min=1)
    dynamic_shapes = [{0: t}, {0: t}, {0: b + 1}, {0: b}, {0: b, 1: m}, {0: t}, {0: b}]
    dynamic_shapes += [{0: n, 1: bs}] * (2 * len(rewritten.kv_cache_specs))
    return tuple(a.to(device) for a in args), tuple(dynamic_shapes)


def _tokenizer_files(tokenizer) -> dict[str, str] | None:
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {}
        for root, _, names in os.walk(tmp):
            for name in names:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    files[os.path.relpath(full, tmp)] = base64.b64encode(f.read()).decode("ascii")
    return files


def _load_tokenizer(files: dict[str, str] | None):
    if not files:
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            full = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(base64.b64decode(data))
        return AutoTokenizer.from_pretrained(tmp)
