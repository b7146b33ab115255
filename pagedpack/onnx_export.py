"""Export the step graph as an ONNX model, and load one back onto an onnxruntime session.

The model has the step signature of :mod:`pagedpack.export`, made functional::

    (input_ids [num_tokens] int64, positions [num_tokens] int64, cu_seqlens_q [num_seqs + 1] int32,
     seq_lens [num_seqs] int32, block_table [num_seqs, max_blocks_per_seq] int32,
     slot_mapping [num_tokens] int64, logits_indices [num_seqs] int64,
     key_cache_0, value_cache_0, ...)                    # [num_blocks, block_size, H_kv, D]
      -> (logits [num_seqs, vocab], key_cache_out_0, value_cache_out_0, ...)

with those named dynamic axes. The attention lowering (:mod:`pagedpack.lowering.onnx`) is either
the ``pagedpack`` domain's functions, which onnxruntime runs on any provider, or
``com.microsoft.PagedAttention`` (onnxruntime's CUDA provider only). ``metadata_props["pagedpack.json"]``
carries the same metadata as a ``.pt2`` archive, plus the attention lowering used.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings

import torch

from pagedpack.export import (META_FILE, ExportedStep, check_export_file, check_output_path, example_step,
                              export_metadata, step_from_metadata, writing)
from pagedpack.passes.pipeline import cache_input_names


def export_onnx(source, path: str | os.PathLike, *, attention: str = "pagedpack",
                eos_token_ids: list[int] | None = None, max_model_len: int | None = None, tokenizer=None,
                model_name: str | None = None) -> str:
    """Export ``source`` (an :class:`~pagedpack.LLM` or a ``RewrittenModel``) to the ONNX file ``path``.

    ``attention``: ``"pagedpack"`` (functions with standard-op bodies; runs on onnxruntime CPU)
    or ``"com.microsoft"`` (``com.microsoft.PagedAttention``; float16/bfloat16 models only).
    Weights are stored in the file (next to it, as external data, above 2 GB). Other arguments
    as for :func:`pagedpack.export.export_pt2`. Returns ``str(path)``.

    Raises:
        ValueError: an unknown ``attention``; ``"com.microsoft"`` with a KV dtype the op's schema
            does not take; a source that is not a rewritten reference-target model; a ``path``
            that cannot be written (checked before exporting).
        TypeError: ``path`` is not a path.
    """
    from pagedpack.lowering import onnx as lowering

    table = lowering.translation_table(attention)
    rewritten, meta = export_metadata(source, eos_token_ids=eos_token_ids, max_model_len=max_model_len,
                                      tokenizer=tokenizer, model_name=model_name)
    if attention == "com.microsoft":
        dtypes = {spec.dtype for spec in rewritten.kv_cache_specs}
        if not dtypes <= set(lowering.ORT_FLOAT_TYPES):
            raise ValueError(f"attention: 'com.microsoft' (PagedAttention) takes float16 or bfloat16 activations "
                             f"and caches, got a model with KV dtype {sorted(str(d) for d in dtypes)}; load it "
                             f"in float16 (dtype=torch.float16, CLI --dtype float16) or use attention='pagedpack'")
    path = check_output_path(path)
    args, dynamic_shapes = example_step(rewritten)
    num_layers = len(rewritten.kv_cache_specs)
    with torch.no_grad(), _quiet_exporter():
        step_graph = lowering.functionalize_caches(rewritten.graph_module).eval()
        program = torch.onnx.export(
            step_graph, args, dynamic_shapes=dynamic_shapes, input_names=meta["signature"],
            output_names=["logits", *cache_input_names(num_layers, "_out")], custom_translation_table=table,
            opset_version=lowering.OPSET, dynamo=True, optimize=False, verbose=False)
    lowering.optimize(program.model)
    if meta["vocab_size"] is None:  # a bare RewrittenModel: read it off the logits output
        meta["vocab_size"] = int(program.model.graph.outputs[0].shape[-1])
    meta["attention"] = attention
    meta["cache_mutation"] = "returned"
    program.model.metadata_props[META_FILE] = json.dumps(meta)
    with writing(path):
        program.save(path)
    return path


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
    """Load an ONNX file written by :func:`export_onnx` onto an onnxruntime CPU session.

    Raises ``ValueError`` if ``path`` is not such a file, or if its attention is
    ``com.microsoft.PagedAttention``, which onnxruntime implements for CUDA only.
    """
    import onnx
    import onnxruntime

    from pagedpack.runtime.onnx_session import OnnxSessionStep

    path = check_export_file(path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as err:  # not a protobuf, truncated, ...
        raise ValueError(f"path: {path!r} is neither a .pt2 archive (a zip file) nor a loadable ONNX model "
                         f"({type(err).__name__}: {err})") from err
    props = {p.key: p.value for p in model.metadata_props}
    if META_FILE not in props:
        raise ValueError(f"path: {path!r} is not a pagedpack ONNX model (no {META_FILE} metadata)")
    step = step_from_metadata(None, props[META_FILE], path)  # the session is attached below
    if step.attention == "com.microsoft":
        raise ValueError(f"path: {path!r} uses com.microsoft.PagedAttention, which onnxruntime runs on its CUDA "
                         f"provider only; export with attention='pagedpack' to run it here")
    try:
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as err:  # a graph onnxruntime rejects
        raise ValueError(f"path: {path!r} does not load in onnxruntime ({type(err).__name__}: {err})") from err
    step.graph_module = OnnxSessionStep(session, step.kv_cache_specs)
    return step
