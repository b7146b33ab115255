"""What every export format stores besides its program, format-neutral: the metadata record
(``pagedpack.json``: format version, the step signature of :mod:`pagedpack.step.contract`, KV cache specs,
recurrent state specs, eos ids, ``max_model_len``, vocabulary size, model name, the tokenizer's files), the loaded
:class:`ExportedStep`, the example step exporters trace with, and the checks of paths, metadata and
tokenizer files.

A leaf for the formats: it imports nothing of ``pagedpack.lowering`` or ``pagedpack.runtime``. The
formats themselves are the targets' (:class:`pagedpack.lowering.targets.FileFormat`): ``.pt2`` and the
tensor-parallel manifest are the reference target's (:mod:`pagedpack.lowering.reference.pt2`,
:mod:`pagedpack.lowering.reference.tp`), ONNX the ``onnx`` target's
(:mod:`pagedpack.lowering.onnx.export`); :func:`pagedpack.lowering.targets.format_of` finds a file's
format and target, :func:`pagedpack.compiler.program.load_exported` loads it.

The step program every format holds, dynamic in every size::

    forward(input_ids [T], positions [T], cu_seqlens_q [B+1], seq_lens [B],
            block_table [B, max_blocks_per_seq], slot_mapping [T], logits_indices [R],
            key_cache_0, value_cache_0, ...,            # [num_blocks, block_size, H_kv, D]
            [state_indices [B], has_initial_state [B], conv_state_0, ssm_state_1, ...],
            [lora_indices [T], lora_a_0, lora_b_0, ...])    # [max_loras, S * max_rank, in], [max_loras, out, max_rank]
        -> logits [R, vocab]

``R``: the logits rows (``B``, plus the prompt rows of requests asking for ``prompt_logprobs``). The
state inputs (``[num_slots, *StateSpec.shape]``) are those of a model with recurrent layers, which only
the ``.pt2`` format carries (ONNX refuses such a model, naming its layers). The LoRA inputs
(``lora_specs``, :class:`~pagedpack.step.contract.LoRASpec`) are those of a model rewritten with
``enable_lora``, which only the ``.pt2`` format carries (dynamic in ``max_loras`` and the rank: the
adapters are loaded when it is served); ONNX and tensor-parallel exports refuse such a model, naming
``enable_lora``. A file written before LoRA was exported has no ``lora_specs`` and takes no LoRA inputs.
:data:`FORMAT_VERSION` versions the metadata record; a file of another version is refused, naming
the version found and the one this pagedpack reads.
"""
from __future__ import annotations

import base64
import contextlib
import os
import re
import tempfile
from dataclasses import dataclass

import torch

from pagedpack.formats.files import check_file_name, parse_json
from pagedpack.step.contract import (
    LORA_INDICES,
    METADATA_INPUTS,
    STATE_INPUTS,
    STATE_KINDS,
    KVCacheSpec,
    LoRASpec,
    LoweredStep,
    ModelDescription,
    StateSpec,
    lora_input_names,
    state_input_names,
    step_input_names,
)
from pagedpack.step.metadata import example_lora_inputs, example_metadata, example_state_inputs

FORMAT_VERSION = 1
META_FILE = "pagedpack.json"


@dataclass
class ExportedStep(LoweredStep):
    """A step program loaded from a file written by ``pagedpack export`` (a
    :class:`~pagedpack.step.contract.StepProgram`) by its format's ``load``: e.g. ``torch.export.load(path).module()``
    (in place) or an onnxruntime session adapter returning ``(logits, *updated caches)`` (functional).
    ``description``: what the file stores besides the program; ``attention``: the ONNX attention
    lowering it was exported with; ``tensor_parallel``: which rank of which tensor-parallel export it
    is (:mod:`pagedpack.lowering.reference.tp`), None for a whole model."""

    attention: str | None = None
    tensor_parallel: dict | None = None


def export_metadata(rewritten, description: ModelDescription | None = None) -> dict:
    """The metadata record stored with an export of ``rewritten`` (what :func:`step_from_metadata`
    reads back): format version, input names, KV cache specs, recurrent state specs (``[]`` without
    recurrent layers), LoRA specs (``[]`` without ``enable_lora``), and ``description``'s eos ids,
    ``max_model_len``, vocabulary size (None: the exporter reads it off its program), model name and the
    tokenizer's files (base64). ``ValueError`` if ``rewritten`` is not a rewritten reference-target model."""
    check_portable(rewritten)
    description = description or ModelDescription()
    return {
        "format_version": FORMAT_VERSION,
        "signature": step_input_names(len(rewritten.kv_cache_specs), rewritten.state_specs, rewritten.lora_specs),
        "kv_cache_specs": [{"num_kv_heads": s.num_kv_heads, "key_head_size": s.key_head_size,
                            "value_head_size": s.value_head_size, "dtype": _dtype_name(s.dtype)}
                           for s in rewritten.kv_cache_specs],
        "state_specs": [{"kind": s.kind, "shape": list(s.shape), "dtype": _dtype_name(s.dtype), "layer": s.layer}
                        for s in rewritten.state_specs],
        "lora_specs": [{"modules": list(s.modules), "in_features": s.in_features, "slice_sizes": list(s.slice_sizes),
                        "dtype": _dtype_name(s.dtype)} for s in rewritten.lora_specs],
        "eos_token_ids": [int(i) for i in description.eos_token_ids],
        "max_model_len": description.max_model_len,
        "vocab_size": description.vocab_size,
        "model_name": description.model_name,
        "tokenizer_files": _tokenizer_files(description.tokenizer),
    }


def check_portable(rewritten) -> None:
    """``rewritten`` is a rewritten model whose step graph calls the reference ``pagedpack`` ops
    (what the export formats translate: ``paged_attention`` or ``sparse_paged_attention``, or the recurrent
    ops of a model without attention); ``ValueError`` naming what it is otherwise."""
    graph = getattr(getattr(rewritten, "graph_module", None), "graph", None)
    if not (callable(getattr(rewritten, "raise_if_refused", None)) and isinstance(graph, torch.fx.Graph)):
        raise ValueError(f"rewritten: expected a RewrittenModel (pagedpack.rewrite's result, or LLM.rewritten), "
                         f"got {type(rewritten).__name__}")
    rewritten.raise_if_refused()
    # a model without attention layers (Mamba) calls only the recurrent ops, a model of sparse-attention layers
    # only the sparse ones (DeepSeek-V3.2), which no other target lowers
    attention = (torch.ops.pagedpack.paged_attention.default, torch.ops.pagedpack.sparse_paged_attention.default)
    if not (rewritten.state_specs or any(n.target in attention for n in graph.nodes)):
        raise ValueError("rewritten: its step graph was lowered for another target (no pagedpack.paged_attention "
                         "left); export a model rewritten for target='reference'")


def check_output_path(path, arg: str = "path") -> str:
    """``str(path)`` if a file can be written there; ``TypeError``/``ValueError`` naming ``arg`` (the
    argument as the caller spells it, e.g. ``--out``) otherwise (checked before any work is done)."""
    path = _path_arg(path, arg)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{arg}: expected a file name, got {path!r} (a directory)")
    if not os.path.isdir(parent):
        raise ValueError(f"{arg}: expected a file in an existing directory, got {path!r} (no such directory)")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{arg}: expected a writable directory, got {path!r} (cannot write to {parent!r})")
    return path


@contextlib.contextmanager
def writing(path: str):
    """Turn an exporter's ``RuntimeError`` for ``path`` into a ``ValueError``; an ``OSError`` (a
    full disk, no permission) stays one, naming ``path``. The file at ``path`` is left as it was."""
    try:
        yield
    except RuntimeError as err:
        raise ValueError(f"path: cannot write {path!r} ({type(err).__name__}: {err})") from err


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _path_arg(path, arg: str = "path") -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{arg}: expected a non-empty str or os.PathLike, got {path!r}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{arg}: expected a str or os.PathLike of str, got {path!r}")
    return path


def check_export_file(path) -> str:
    path = _path_arg(path)
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no such file"
        raise ValueError(f"path: expected a .pt2 archive or .onnx model written by 'pagedpack export', "
                         f"got {path!r} ({what})")
    return path


def static_shape(sizes) -> tuple:
    """A shape with each symbolic size (a ``SymInt``, an ONNX dim name) as None."""
    return tuple(int(n) if isinstance(n, int) else None for n in sizes)


def check_program_signature(step: ExportedStep, signature: tuple[dict[str, tuple], tuple], path: str) -> None:
    """The metadata of ``step`` (KV cache specs, recurrent state specs, LoRA specs, vocabulary) matches its
    program's own inputs and logits (``signature``: ``({input name: (shape, dtype)}, logits shape)``,
    a shape entry None where symbolic, as each format reads it off its program);
    ``ValueError`` naming the field, what the program has and what the metadata says."""
    inputs, logits = signature
    expected = step_input_names(len(step.kv_cache_specs), step.state_specs, step.lora_specs)
    if list(inputs) != expected:
        raise ValueError(f"path: {path!r}: its metadata describes the inputs {expected}, its program has "
                         f"{list(inputs)}")
    caches = expected[len(METADATA_INPUTS):len(METADATA_INPUTS) + 2 * len(step.kv_cache_specs)]
    for spec, name in zip(step.state_specs, state_input_names(step.state_specs)):
        shape, dtype = inputs[name]
        if tuple(shape[1:]) != spec.shape or dtype != spec.dtype:
            raise ValueError(f"path: {path!r}: state_specs: the metadata says {name} is {spec.dtype} "
                             f"[num_slots, {', '.join(map(str, spec.shape))}], its program takes {dtype} {list(shape)}")
    for spec, names in zip(step.kv_cache_specs, zip(caches[::2], caches[1::2])):
        for name, head_size in zip(names, (spec.key_head_size, spec.value_head_size)):
            shape, dtype = inputs[name]
            if tuple(shape[2:]) != (spec.num_kv_heads, head_size) or dtype != spec.dtype:
                raise ValueError(f"path: {path!r}: kv_cache_specs: the metadata says {name} is {spec.dtype} "
                                 f"[num_blocks, block_size, {spec.num_kv_heads}, {head_size}], its program takes "
                                 f"{dtype} {list(shape)}")
    _check_lora_inputs(step.lora_specs, inputs, path)
    vocab = step.description.vocab_size
    if len(logits) != 2 or logits[1] != vocab:
        raise ValueError(f"path: {path!r}: vocab_size: the metadata says {vocab}, its program returns logits of "
                         f"shape {list(logits)}")


def _check_lora_inputs(specs: list[LoRASpec], inputs: dict[str, tuple], path: str) -> None:
    """The program's LoRA inputs have the ranks, static sizes and dtypes ``specs`` describe
    (:func:`check_program_signature`)."""
    if not specs:
        return
    shape, dtype = inputs[LORA_INDICES]
    if len(shape) != 1 or dtype != torch.int32:
        raise ValueError(f"path: {path!r}: lora_specs: the metadata says {LORA_INDICES} is int32 [num_tokens], its "
                         f"program takes {dtype} {list(shape)}")
    names = lora_input_names(specs)[1:]
    for spec, a, b in zip(specs, names[0::2], names[1::2]):
        for name, dim, size, layout in ((a, 2, spec.in_features, "[max_loras, S * max_rank, {}]"),
                                        (b, 1, spec.out_features, "[max_loras, {}, max_rank]")):
            shape, dtype = inputs[name]
            if len(shape) != 3 or shape[dim] != size or dtype != spec.dtype:
                raise ValueError(f"path: {path!r}: lora_specs: the metadata says {name} is {spec.dtype} "
                                 f"{layout.format(size)}, its program takes {dtype} {list(shape)}")


_CACHE_DTYPES = ("float32", "float16", "bfloat16")
# a file written before recurrent layers (LoRA inputs) were exported has no state_specs (lora_specs)
_OPTIONAL = {"max_model_len": int, "model_name": str, "tokenizer_files": dict, "tensor_parallel": dict,
             "state_specs": list, "lora_specs": list}
_REQUIRED = {"format_version": int, "signature": list, "kv_cache_specs": list, "eos_token_ids": list,
             "vocab_size": int}
_KV_SIZES = ("num_kv_heads", "key_head_size", "value_head_size")
_MODULE_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def _is_a(value, kind: type) -> bool:
    """``isinstance(value, kind)``, where JSON's ``true`` / ``false`` are no ints."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def _positive(n) -> bool:
    return type(n) is int and n > 0


def _state_spec(spec, invalid) -> StateSpec:
    """The :class:`StateSpec` of one ``state_specs`` entry of a file's metadata (``{"kind", "shape",
    "dtype", "layer"}``); ``invalid(field, expected, got)``'s error for anything else."""
    expected = (f"{{'kind', 'shape', 'dtype', 'layer'}}: a kind of {STATE_KINDS} with a shape of that many "
                f"positive sizes, a dtype in {_CACHE_DTYPES} and a module path")
    if not (isinstance(spec, dict) and set(spec) == {"kind", "shape", "dtype", "layer"}
            and isinstance(spec["kind"], str) and spec["kind"] in STATE_KINDS and isinstance(spec["shape"], list)
            and len(spec["shape"]) == STATE_KINDS[spec["kind"]] and all(map(_positive, spec["shape"]))
            and spec["dtype"] in _CACHE_DTYPES and isinstance(spec["layer"], str)
            and _MODULE_PATH.fullmatch(spec["layer"])):
        raise invalid("state_specs", expected, spec)
    return StateSpec(spec["kind"], tuple(spec["shape"]), getattr(torch, spec["dtype"]), spec["layer"])


def _lora_spec(spec, invalid) -> LoRASpec:
    """The :class:`LoRASpec` of one ``lora_specs`` entry of a file's metadata (``{"modules", "in_features",
    "slice_sizes", "dtype"}``); ``invalid(field, expected, got)``'s error for anything else."""
    expected = (f"{{'modules', 'in_features', 'slice_sizes', 'dtype'}}: module paths with one positive slice size "
                f"each, positive in_features and a dtype in {_CACHE_DTYPES}")
    if not (isinstance(spec, dict) and set(spec) == {"modules", "in_features", "slice_sizes", "dtype"}
            and isinstance(spec["modules"], list) and isinstance(spec["slice_sizes"], list) and spec["modules"]
            and len(spec["modules"]) == len(spec["slice_sizes"]) and all(map(_positive, spec["slice_sizes"]))
            and all(isinstance(m, str) and _MODULE_PATH.fullmatch(m) for m in spec["modules"])
            and _positive(spec["in_features"]) and spec["dtype"] in _CACHE_DTYPES):
        raise invalid("lora_specs", expected, spec)
    return LoRASpec(tuple(spec["modules"]), spec["in_features"], tuple(spec["slice_sizes"]),
                    getattr(torch, spec["dtype"]))


def step_from_metadata(run, raw: str, path: str, choices: dict[str, tuple[str, ...]]) -> ExportedStep:
    """An :class:`ExportedStep` calling ``run``, from the metadata JSON
    :func:`export_metadata` wrote (untrusted: nothing in it is run or unpickled) and its format added:
    ``choices``, the format's own fields and the values each may take (e.g. ``cache_mutation``).
    ``ValueError`` naming ``path`` and the field for another format version or metadata that does not
    describe a pagedpack step program of that format: a field of another type (``true`` is no int),
    a field no format writes, eos ids outside the vocabulary, a ``state_specs`` entry of an unknown
    kind, of a shape of another rank, a ``state_specs`` or ``lora_specs`` entry beside a
    ``tensor_parallel`` shard, a ``lora_specs`` entry without a slice size per module, .... Whether the specs
    are those of the file's program is :func:`check_program_signature`'s check."""
    def invalid(name, expected, got):
        return ValueError(f"path: {path!r} has invalid pagedpack metadata: {name}: expected {expected}, "
                          f"got {got!r:.80}")

    try:
        meta = parse_json(raw)
    except ValueError as err:
        raise invalid(META_FILE, "JSON", str(err)) from err
    if not isinstance(meta, dict):
        raise invalid(META_FILE, "a JSON object", meta)
    version = meta.get("format_version")
    if not _is_a(version, int) or version != FORMAT_VERSION:
        raise ValueError(f"path: {path!r} has pagedpack format_version {version!r}, "
                         f"this pagedpack reads {FORMAT_VERSION}")
    unknown = sorted(set(meta) - set(_REQUIRED) - set(_OPTIONAL) - set(choices))
    if unknown:
        raise invalid(META_FILE, f"the fields {sorted({*_REQUIRED, *_OPTIONAL, *choices})}", unknown)
    for name, kind in (*_REQUIRED.items(), *_OPTIONAL.items()):
        value = meta.get(name)
        if not _is_a(value, kind) and not (name in _OPTIONAL and value is None):
            raise invalid(name, kind.__name__ + (" or null" if name in _OPTIONAL else ""), value)
    for name, values in choices.items():
        if not isinstance(meta.get(name), str) or meta[name] not in values:
            raise invalid(name, f"one of {list(values)}", meta.get(name))
    specs = []
    for spec in meta["kv_cache_specs"]:
        sizes = [spec.get(k) if isinstance(spec, dict) else None for k in _KV_SIZES]
        # a value head size of 0: a key-only cache (a sparse-attention layer's indexer keys, indexer_cache_spec)
        key_only = type(sizes[2]) is int and sizes[2] == 0
        if not (all(_positive(n) for n in sizes[:2]) and (key_only or _positive(sizes[2]))
                and set(spec) == {*_KV_SIZES, "dtype"} and spec["dtype"] in _CACHE_DTYPES):
            raise invalid("kv_cache_specs", "{'num_kv_heads', 'key_head_size', 'value_head_size', 'dtype'}: "
                          "positive head counts/sizes (a value head size may be 0: a key-only cache) and a dtype "
                          f"in {_CACHE_DTYPES}", spec)
        specs.append(KVCacheSpec(*sizes, getattr(torch, spec["dtype"])))
    states = [_state_spec(spec, invalid) for spec in meta.get("state_specs") or []]
    loras = [_lora_spec(spec, invalid) for spec in meta.get("lora_specs") or []]
    signature = step_input_names(len(specs), states, loras)
    if not (specs or states) or meta["signature"] != signature:
        raise invalid("signature", f"{signature} (one cache pair per kv_cache_specs entry, then "
                      f"{list(STATE_INPUTS)} and one input per state_specs entry, if any, then {LORA_INDICES} "
                      f"and two inputs per lora_specs entry, if any)", meta["signature"])
    for name in ("max_model_len", "vocab_size"):
        if meta.get(name) is not None and meta[name] < 1:
            raise invalid(name, "an int >= 1", meta[name])
    vocab = meta["vocab_size"]
    outside = [i for i in meta["eos_token_ids"] if not (_is_a(i, int) and 0 <= i < vocab)]
    if outside:
        raise invalid("eos_token_ids", f"token ids in [0, vocab_size={vocab})", outside[:5])
    shard = meta.get("tensor_parallel")
    if shard is not None and not (set(shard) == {"rank", "size", "export_id"} and isinstance(shard["export_id"], str)
                                  and all(type(shard[k]) is int for k in ("rank", "size"))
                                  and 0 <= shard["rank"] < shard["size"]):
        raise invalid("tensor_parallel", "{'rank', 'size', 'export_id'} of one rank's shard", shard)
    if shard is not None and states:
        raise invalid("tensor_parallel", "null with state_specs (recurrent layers are not split over ranks)", shard)
    if shard is not None and loras:
        raise invalid("tensor_parallel", "null with lora_specs (LoRA adapters are not split over ranks)", shard)
    try:
        check_tokenizer_files(meta.get("tokenizer_files"))
    except ValueError as err:
        raise ValueError(f"path: {path!r} has invalid pagedpack metadata: {err}") from err
    try:
        tokenizer = _load_tokenizer(meta.get("tokenizer_files"))
    except Exception as err:  # corrupt files: whatever transformers raises
        raise invalid("tokenizer_files", "a saved tokenizer", f"{type(err).__name__}: {err}") from err
    description = ModelDescription(meta["eos_token_ids"], meta.get("max_model_len"), meta["vocab_size"],
                                   meta.get("model_name"), tokenizer)
    return ExportedStep(run, specs, functional=meta.get("cache_mutation") == "returned", state_specs=states,
                        lora_specs=loras, note=f"loaded from {path}", description=description,
                        attention=meta.get("attention"), tensor_parallel=shard)


def example_step(rewritten) -> tuple[tuple, tuple]:
    """``(args, dynamic_shapes)``: a small valid step for the rewritten graph (from the batch
    builder; with recurrent layers, sequence ``b`` in state slot ``b`` of 4, the first one fresh; with LoRA
    inputs, 2 adapter slots of rank 4, :func:`~pagedpack.step.metadata.example_lora_inputs`), and the
    ``torch.export`` dims that make every size dynamic (tokens, sequences, blocks per sequence, number of
    blocks, block size, state slots, adapter slots, adapter rank; ``cu_seqlens_q`` is sequences + 1, each
    ``lora_a_i``'s rows ``S`` times the rank).

    Example sizes are >= 2 (export specialises 0 and 1) and the token, block and block-size
    counts distinct; the dims' minimum is 1, so a step of one token of one sequence runs too. The
    example's ``R = 5`` logits rows (each sequence's last, and two more of the second) keep the
    logits rows a size of their own.
    """
    device = next(rewritten.graph_module.parameters()).device
    block_size, num_blocks = 6, 11  # T=11 tokens of B=3 sequences, KV lengths 2, 14, 7 (blocks 1, 3, 2)
    q_lens, context_lens = [2, 5, 4], [0, 9, 3]
    batch = example_metadata(q_lens, context_lens, block_size=block_size, num_blocks=num_blocks, device=device)
    batch = batch._replace(logits_indices=torch.tensor([1, 6, 10, 2, 3], device=device))
    inputs = batch.as_inputs()
    args = [inputs[name] for name in METADATA_INPUTS]
    for spec in rewritten.kv_cache_specs:
        args += [torch.zeros(shape, dtype=spec.dtype, device=device)
                 for shape in spec.cache_shapes(num_blocks, block_size)]
    args += example_state_inputs(rewritten.state_specs, context_lens, device, num_slots=4)
    args += example_lora_inputs(rewritten.lora_specs, q_lens, device, max_loras=2, max_rank=4)

    dim = torch.export.Dim
    t, b, r = dim("num_tokens", min=1), dim("num_seqs", min=1), dim("num_logits_rows", min=1)
    m, n, bs = dim("max_blocks_per_seq", min=1), dim("num_blocks", min=1), dim("block_size", min=1)
    dynamic_shapes = [{0: t}, {0: t}, {0: b + 1}, {0: b}, {0: b, 1: m}, {0: t}, {0: r}]
    dynamic_shapes += [{0: n, 1: bs}] * (2 * len(rewritten.kv_cache_specs))
    if rewritten.state_specs:
        slots = dim("num_state_slots", min=1)
        dynamic_shapes += [{0: b}, {0: b}, *[{0: slots}] * len(rewritten.state_specs)]
    if rewritten.lora_specs:
        loras, rank = dim("max_loras", min=1), dim("max_lora_rank", min=1)
        dynamic_shapes += [{0: t}]
        for spec in rewritten.lora_specs:
            dynamic_shapes += [{0: loras, 1: len(spec.modules) * rank}, {0: loras, 2: rank}]
    return tuple(args), tuple(dynamic_shapes)


# The files a tokenizer is saved as (transformers' tokenizer file names); anything else (a config.json,
# a module of custom code) is refused in an export: AutoTokenizer could be led to import code from it.
TOKENIZER_FILE_NAMES = frozenset((
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model"))


def check_tokenizer_files(files: dict[str, str] | None) -> None:
    """``files`` (name -> base64) are a tokenizer's data only: known, plain tokenizer file names, a
    ``tokenizer_config.json`` with no ``auto_map`` whose ``tokenizer_class`` is a tokenizer class of
    ``transformers``; ``ValueError`` naming ``tokenizer_files`` and what is wrong otherwise."""
    files = files or {}
    for name in files:
        try:
            check_file_name(name, "tokenizer_files")
        except ValueError as err:  # they are joined to a folder when loaded
            raise ValueError(f"tokenizer_files: expected plain file names (no folder, no '..'), got {name!r:.80}") \
                from err
    unknown = sorted(set(files) - TOKENIZER_FILE_NAMES)
    if unknown:
        raise ValueError(f"tokenizer_files: expected tokenizer files only, got {unknown[:5]!r:.200} (taken: "
                         f"{', '.join(sorted(TOKENIZER_FILE_NAMES))})")
    if "tokenizer_config.json" not in files:
        return
    try:
        config = parse_json(base64.b64decode(files["tokenizer_config.json"], validate=True))
    except (ValueError, TypeError) as err:
        raise ValueError(f"tokenizer_files: tokenizer_config.json: expected base64 JSON ({err})") from err
    if not isinstance(config, dict) or "auto_map" in config:
        got = "auto_map" if isinstance(config, dict) else repr(config)[:80]
        raise ValueError(f"tokenizer_files: tokenizer_config.json: expected a JSON object without auto_map "
                         f"(custom tokenizer code), got {got}")
    name = config.get("tokenizer_class")
    import transformers  # a tokenizer is loaded with it next
    from transformers import PreTrainedTokenizerBase

    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if name is not None and not (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase)):
        raise ValueError(f"tokenizer_files: tokenizer_config.json: tokenizer_class: expected a tokenizer class of "
                         f"transformers, got {name!r:.80}")


def _tokenizer_files(tokenizer) -> dict[str, str] | None:
    """The files ``tokenizer.save_pretrained`` writes, by plain file name, base64 (those
    :func:`check_tokenizer_files` takes)."""
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {}
        for entry in os.scandir(tmp):
            if not entry.is_file():
                raise ValueError(f"tokenizer: save_pretrained wrote a folder {entry.name!r}; an export stores plain "
                                 "files only")
            with open(entry.path, "rb") as f:
                files[entry.name] = base64.b64encode(f.read()).decode("ascii")
    check_tokenizer_files(files)
    return files


def _load_tokenizer(files: dict[str, str] | None):
    """The tokenizer saved as ``files``; each name must be a plain file name (it comes from the file)."""
    if not files:
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            if not isinstance(data, str):
                raise ValueError(f"tokenizer_files: {name}: expected base64 text, got {type(data).__name__}")
            with open(os.path.join(tmp, check_file_name(name, "tokenizer_files")), "wb") as f:
                f.write(base64.b64decode(data, validate=True))
        tokenizer = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)  # never a file's code
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ValueError(f"tokenizer_files: expected a tokenizer, got a {type(tokenizer).__name__}")
    return tokenizer
