"""The ``onnx`` target's file format (:data:`FORMAT`, ``"onnx"``): the step graph as an ONNX model
(:func:`export_onnx`), loaded back onto an onnxruntime session (:func:`load_onnx`).

The model has the step signature of :mod:`pagedpack.step.contract`, made functional::

    (input_ids [num_tokens] int64, positions [num_tokens] int64, cu_seqlens_q [num_seqs + 1] int32,
     seq_lens [num_seqs] int32, block_table [num_seqs, max_blocks_per_seq] int32,
     slot_mapping [num_tokens] int64, logits_indices [num_logits_rows] int64,
     key_cache_0, value_cache_0, ...)                    # [num_blocks, block_size, H_kv, D]
      -> (logits [num_logits_rows, vocab], key_cache_out_0, value_cache_out_0, ...)

with those named dynamic axes (``num_logits_rows``: ``num_seqs``, plus any prompt rows for
``prompt_logprobs``; onnxruntime takes any length for it, in a file naming it ``num_seqs`` too).
The attention lowering (:mod:`pagedpack.lowering.onnx.functions`) is either
the ``pagedpack`` domain's functions, which onnxruntime runs on any provider, or
``com.microsoft.PagedAttention`` (onnxruntime's CUDA provider only). ``metadata_props["pagedpack.json"]``
carries the same metadata as a ``.pt2`` archive, plus the attention lowering used.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings

import torch

from pagedpack.formats.checksum import seal_onnx, verify_onnx, verify_onnx_data
from pagedpack.formats.export import (
    META_FILE,
    ExportedStep,
    check_export_file,
    check_output_path,
    check_portable,
    check_program_signature,
    example_step,
    export_metadata,
    static_shape,
    step_from_metadata,
    writing,
)
from pagedpack.formats.files import publish, temp_path
from pagedpack.kernels.sparse_attention import sparse_attention_layers
from pagedpack.lowering.onnx.session import OnnxSessionStep, check_cache_dtypes
from pagedpack.lowering.targets import FileFormat
from pagedpack.step.contract import METADATA_INPUTS, ModelDescription, cache_input_names, state_layers

ATTENTIONS = ("pagedpack", "com.microsoft")
# the metadata fields of this format's own (pagedpack.formats.export.step_from_metadata): the program returns
# the updated caches, and the attention lowering it was exported with
METADATA_CHOICES = {"cache_mutation": ("returned",), "attention": ATTENTIONS}


def export_onnx(rewritten, path: str | os.PathLike, description: ModelDescription | None = None, *,
                attention: str = "pagedpack") -> str:
    """Export ``rewritten`` (a ``RewrittenModel`` of the reference target) to the ONNX file ``path``,
    storing ``description`` as every format does (:func:`pagedpack.formats.export.export_metadata`).

    ``attention``: ``"pagedpack"`` (functions with standard-op bodies; runs on onnxruntime CPU)
    or ``"com.microsoft"`` (``com.microsoft.PagedAttention``; float16/bfloat16 models only).
    Weights are stored in the file (next to it, as external data, above 2 GB). Returns ``str(path)``.

    Raises:
        ValueError: an unknown ``attention``; ``"com.microsoft"`` with a KV dtype the op's schema
            does not take; a source that is not a rewritten reference-target model, or one with
            recurrent layers (``state_specs``: the format carries no state) or LoRA inputs
            (``enable_lora``, named); a ``path`` that cannot
            be written (checked before exporting).
        TypeError: ``path`` is not a path.
    """
    check_attention(attention, rewritten)
    meta = export_metadata(rewritten, description)
    path = check_output_path(path)
    program = onnx_program(rewritten, attention)
    if meta["vocab_size"] is None:  # read it off the logits output
        meta["vocab_size"] = int(program.model.graph.outputs[0].shape[-1])
    meta["attention"] = attention
    meta["cache_mutation"] = "returned"
    program.model.metadata_props[META_FILE] = json.dumps(meta)
    with writing(path):
        _save(program, path)
    return path


def _save(program: torch.onnx.ONNXProgram, path: str) -> None:
    """Save and seal ``program`` in a staging folder beside ``path``, then rename its external data
    file (``<path>.data``, above 2 GB) and the model into place: the data first, so a model never
    names data that is not there (an old model beside new data fails its data checksum)."""
    staging = temp_path(path)
    name = os.path.basename(path)
    try:
        os.mkdir(staging)
        model, data = os.path.join(staging, name), os.path.join(staging, name + ".data")
        program.save(model)
        seal_onnx(model, data if os.path.exists(data) else None)
        if os.path.exists(data):
            publish(data, path + ".data")
        publish(model, path)
    except OSError as err:
        raise OSError(err.errno, f"cannot write {path!r}: {err.strerror or err}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_attention(attention, rewritten) -> None:
    """``attention`` is one of :data:`ATTENTIONS` and takes ``rewritten``'s KV dtypes, and ``rewritten`` is
    a reference-target model the format carries (no recurrent state, no sparse attention, no complex tensors);
    ``ValueError`` otherwise."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: expected one of {list(ATTENTIONS)}, got {attention!r}")
    check_portable(rewritten)
    if rewritten.lora_specs:
        raise ValueError("enable_lora: the model's step graph takes LoRA inputs, which the onnx format does not carry "
                         "yet; export it as pt2 (format='pt2', --format pt2), which takes adapters when served")
    if rewritten.state_specs:
        raise ValueError(f"rewritten: the model's recurrent layers ({state_layers(rewritten.state_specs)}) keep a "
                         f"state the onnx format does not carry yet; export it as pt2 (format='pt2', --format pt2) "
                         f"or serve it in process (LLM(model))")
    layers = sparse_attention_layers(rewritten.graph_module.graph)
    if layers:
        raise ValueError(f"rewritten: the model's sparse-attention (DSA) layers ({', '.join(layers)}) have no onnx "
                         "function yet; export it as pt2 (format='pt2', --format pt2) or serve it in process "
                         "(LLM(model))")
    check_real_valued(rewritten)
    dtypes = sorted({str(spec.dtype).removeprefix("torch.") for spec in rewritten.kv_cache_specs})
    if attention == "pagedpack" and "bfloat16" in dtypes:
        raise ValueError(f"attention: 'pagedpack' functions take float32 or float16 (opset 20's Compress has no "
                         f"bfloat16, and NumPy, which feeds onnxruntime, neither), got a model with KV dtype {dtypes}; "
                         f"load it with dtype float16 or float32, or use attention='com.microsoft'")
    if attention == "com.microsoft":
        from pagedpack.lowering.onnx.functions import ORT_FLOAT_TYPES, unsupported_params

        dtypes = {spec.dtype for spec in rewritten.kv_cache_specs}
        if not dtypes <= set(ORT_FLOAT_TYPES):
            raise ValueError(f"attention: 'com.microsoft' (PagedAttention) takes float16 or bfloat16 activations "
                             f"and caches, got a model with KV dtype {sorted(str(d) for d in dtypes)}; load it "
                             f"in float16 (dtype=torch.float16, CLI --dtype float16) or use attention='pagedpack'")
        unsupported = unsupported_params(rewritten.graph_module, attention)
        if unsupported:
            raise ValueError("attention: 'com.microsoft' (PagedAttention) cannot express:\n  "
                             + "\n  ".join(unsupported) + "\nuse attention='pagedpack'")


def check_real_valued(rewritten) -> None:
    """``ValueError`` if ``rewritten``'s step graph computes with complex tensors, which ONNX has no type
    for (the exporter fails deep inside on the first such node)."""
    node = next((n for n in rewritten.graph_module.graph.nodes
                 if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()), None)
    if node is not None:
        raise ValueError(f"rewritten: its step graph computes with complex tensors ({node.name}: "
                         f"{str(node.meta['val'].dtype).removeprefix('torch.')}, e.g. Llama-4's rotary embedding "
                         f"through view_as_complex), and ONNX has no complex type; serve the model on the cpu "
                         f"target or export it as .pt2")


def onnx_program(rewritten, attention: str = "pagedpack") -> torch.onnx.ONNXProgram:
    """The functional step program of ``rewritten`` as an ``ONNXProgram`` (module docstring),
    with ``attention``'s lowering (:func:`check_attention` first)."""
    from pagedpack.lowering.onnx import functions as lowering

    args, dynamic_shapes = example_step(rewritten)
    num_layers = len(rewritten.kv_cache_specs)
    with torch.no_grad(), _quiet_exporter():
        step_graph = lowering.functionalize_caches(rewritten.graph_module).eval()
        program = torch.onnx.export(
            step_graph, args, dynamic_shapes=dynamic_shapes,
            input_names=[*METADATA_INPUTS, *cache_input_names(num_layers)],
            output_names=["logits", *cache_input_names(num_layers, "_out")],
            custom_translation_table=lowering.translation_table(attention),
            opset_version=lowering.OPSET, dynamo=True, optimize=False, verbose=False)
    lowering.optimize(program.model)
    return program


@contextlib.contextmanager
def _quiet_exporter():
    """Silence what ``torch.onnx.export`` says that is not about this model: each KV dim is
    named once although it repeats over the cache inputs, torchvision ops are not registered,
    a deprecated pytree spelling inside torch."""
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used", category=UserWarning)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            yield
    finally:
        registry_log.setLevel(level)


def load_onnx(path: str | os.PathLike) -> ExportedStep:
    """Load an ONNX file written by :func:`export_onnx` onto an onnxruntime
    CPU session, once its sha256 record (:mod:`pagedpack.formats.checksum`) checks out. (An ONNX model is
    data: loading one runs no code of the file's.)

    Raises ``ValueError`` if ``path`` is not such a file, is damaged, its metadata disagrees with its
    graph or describes recurrent state (``state_specs``) or LoRA inputs (``lora_specs``), or its attention is
    ``com.microsoft.PagedAttention``, which onnxruntime implements for
    CUDA only.
    """
    import onnx
    import onnxruntime

    path = check_export_file(path)
    with open(path, "rb") as file:
        data = file.read()
    try:
        model = onnx.load_model_from_string(data)
    except Exception as err:  # not a protobuf, truncated, ...
        raise ValueError(f"path: {path!r} is neither a .pt2 archive (a zip file) nor a loadable ONNX model "
                         f"({type(err).__name__}: {err})") from err
    props = {p.key: p.value for p in model.metadata_props}
    if META_FILE not in props:
        raise ValueError(f"path: {path!r} is not a pagedpack ONNX model (no {META_FILE} metadata)")
    verify_onnx(data, props, path)
    verify_onnx_data(model, props, path)
    del data, model
    step = step_from_metadata(None, props[META_FILE], path, METADATA_CHOICES)  # the session is attached below
    if step.state_specs:
        raise ValueError(f"path: {path!r}: state_specs: expected none (the onnx format carries no recurrent state), "
                         f"got {len(step.state_specs)} of {state_layers(step.state_specs)}")
    if step.lora_specs:
        raise ValueError(f"path: {path!r}: lora_specs: expected none (the onnx format carries no LoRA inputs), "
                         f"got {len(step.lora_specs)}")
    if step.attention == "com.microsoft":
        raise ValueError(f"path: {path!r} uses com.microsoft.PagedAttention, which onnxruntime runs on its CUDA "
                         f"provider only; export with attention='pagedpack' to run it here")
    check_cache_dtypes(step.kv_cache_specs)
    try:
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as err:  # a graph onnxruntime rejects
        raise ValueError(f"path: {path!r} does not load in onnxruntime ({type(err).__name__}: {err})") from err
    check_program_signature(step, _onnx_signature(session), path)
    step.run = OnnxSessionStep(session, step.kv_cache_specs)
    return step


_ORT_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16}


def _onnx_signature(session) -> tuple[dict[str, tuple], tuple]:
    """The program signature of an onnxruntime session (its first output is the logits), as
    :func:`pagedpack.formats.export.check_program_signature` takes it."""
    inputs = {i.name: (static_shape(i.shape), _ORT_DTYPES.get(i.type, i.type)) for i in session.get_inputs()}
    return inputs, static_shape(session.get_outputs()[0].shape)


def _load(path, *, trust_file: bool = False) -> ExportedStep:
    return load_onnx(path)  # an ONNX model is data: nothing in it runs as code, trusted or not


def _serve_hint(path: str, options: dict) -> str:
    if options.get("attention") == "com.microsoft":
        return "onnxruntime's CUDA provider"
    return f"LLM({path!r}, num_blocks=...)"  # each step copies the whole pool: size it for the batch


# An ONNX ModelProto starts with its ir_version (field 1, a varint): the byte 0x08.
FORMAT = FileFormat("onnx", ".onnx", b"\x08", export_onnx, _load, options=("attention",), serve_hint=_serve_hint,
                    description="an ONNX model (protobuf), run by onnxruntime's CPU session (the onnx target)")
