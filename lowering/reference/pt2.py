"""The reference target's ``.pt2`` format: the rewritten step graph as a ``torch.export`` archive.

The archive holds one ``ExportedProgram`` of the step graph (the signature of
:mod:`pagedpack.step.contract`, dynamic in ``T``, ``B``, ``R``, ``max_blocks_per_seq``, ``num_blocks``
and ``block_size``: the block size is a runtime choice, not baked in; with recurrent layers, the
recurrent ops and the state inputs after the caches, dynamic in the number of state slots, written in
place as the caches are; with ``enable_lora``, ``pagedpack::lora_shrink`` / ``lora_expand`` and the LoRA
inputs last, ``lora_indices`` dynamic in ``T`` and the adapter weights in ``max_loras`` and the rank, so
that the runtime that serves the file chooses its slots and loads adapters into them). An archive written before
``R`` had a dimension of its own takes ``R == B`` only (:func:`load_pt2` marks its program so).

KV caches: the program is kept in export's default IR, where ``pagedpack::reshape_and_cache``
stays an in-place call on the cache inputs (no functionalisation, so no per-step copy of the
caches); the loaded ``.module()`` therefore updates the caller's cache tensors, as the step
graph does, and the runner passes its own caches exactly as for the un-exported graph.

Besides the program, ``extra_files["pagedpack.json"]`` stores the format-neutral metadata
(:func:`pagedpack.formats.export.export_metadata`, the recurrent state specs among it). ``import pagedpack``
registers the custom ops the program calls (:mod:`pagedpack.kernels.recurrent`'s too), which is all a fresh
process needs before :func:`load_pt2` (or
:func:`pagedpack.compiler.program.load_exported`, for any format). :data:`FORMAT` registers it (a zip file:
``PK\\x03\\x04``) with :class:`~pagedpack.lowering.reference.target.ReferenceTarget`.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import zipfile

import torch

from pagedpack.formats.checksum import seal_pt2, verify_pt2
from pagedpack.formats.export import (
    META_FILE,
    ExportedStep,
    check_export_file,
    check_output_path,
    check_program_signature,
    example_step,
    export_metadata,
    static_shape,
    step_from_metadata,
    writing,
)
from pagedpack.formats.files import RecordingWriter, atomic_write
from pagedpack.formats.pt2_check import check_pt2_archive, weights_only_loads
from pagedpack.lowering.targets import FileFormat
from pagedpack.step.contract import ModelDescription, lora_input_names


def export_pt2(rewritten, path: str | os.PathLike, description: ModelDescription | None = None, *,
               tensor_parallel: dict | None = None) -> str:
    """Export ``rewritten`` (a ``RewrittenModel`` of the reference target) to the ``.pt2`` file
    ``path``, storing ``description`` (eos ids, ``max_model_len``, tokenizer, ...; optional) and, for
    one rank's shard, ``tensor_parallel`` (``{"rank", "size", "export_id"}``, :mod:`pagedpack.lowering.reference.tp`).
    Returns ``str(path)``.

    Raises ``ValueError`` for a source that is not a rewritten reference-target model, or a
    ``path`` that cannot be written (checked before exporting); ``TypeError`` if ``path`` is not
    a path.
    """
    meta = export_metadata(rewritten, description)
    meta["tensor_parallel"] = tensor_parallel
    path = check_output_path(path)
    program = _export_program(rewritten)
    if meta["vocab_size"] is None:  # read it off the exported logits
        output = next(n for n in program.graph.nodes if n.op == "output")
        meta["vocab_size"] = int(output.args[0][0].meta["val"].shape[-1])
    meta["cache_mutation"] = "copied_back" if any(spec.kind.name == "USER_INPUT_MUTATION" for spec in
                                                  program.graph_signature.output_specs) else "in_place"
    with writing(path), atomic_write(path) as tmp:
        with open(tmp, "wb") as file:
            writer = RecordingWriter(file)  # a write error must not unwind through torch's C++ writer
            torch.export.save(program, writer, extra_files={META_FILE: json.dumps(meta)})
        if writer.error is not None:
            raise writer.error
        seal_pt2(tmp)
    return path


# The metadata fields of this format's own (pagedpack.formats.export.step_from_metadata): "in_place", the
# program calls reshape_and_cache on the cache inputs; "copied_back", export functionalised it and the loaded
# .module() copies the new caches into the inputs (either way the caller's caches are updated)
METADATA_CHOICES = {"cache_mutation": ("in_place", "copied_back")}


# Ops a captured model may call that a library registers on import, by the prefix of their name in
# an archive: Mixture-of-Experts layers of transformers call torch.ops.transformers.grouped_mm_fallback.
_OP_LIBRARIES = {b"torch.ops.transformers.": "transformers.integrations.moe"}


def load_pt2(path, *, trust_file: bool = False) -> ExportedStep:
    """Load an archive written by :func:`export_pt2`. Checked before ``torch.export.load`` reads
    it: its sha256 record (:mod:`pagedpack.formats.checksum`) and, unless ``trust_file``, that nothing in it
    would run code (:mod:`pagedpack.formats.pt2_check`: pickled members, non-operator node targets, ...;
    refused with :class:`~pagedpack.formats.pt2_check.UntrustedFileError`); after: that its metadata
    (:func:`~pagedpack.formats.export.step_from_metadata`: KV cache, recurrent state and LoRA specs, ...)
    is valid and matches the program's own inputs and logits (and each ``lora_expand`` call, the slices of
    its ``lora_specs`` entry). ``ValueError`` if ``path`` is missing or
    is not such an archive. The libraries that register ops the program calls besides pagedpack's
    (:data:`_OP_LIBRARIES`) are imported first."""
    path = check_export_file(path)
    extra = {META_FILE: ""}
    with open(path, "rb") as file:  # one open file for the checks and the load
        verify_pt2(file, path)
        if not trust_file:
            check_pt2_archive(file, path)
        try:
            file.seek(0)
            _import_op_libraries(file)
            file.seek(0)
            with contextlib.nullcontext() if trust_file else weights_only_loads():
                program = torch.export.load(file, extra_files=extra)
        except Exception as err:  # zip errors, missing archive entries, unknown ops, ...
            raise ValueError(f"path: {path!r} is not a loadable torch.export archive "
                             f"({type(err).__name__}: {err})") from err
    if not extra[META_FILE]:
        raise ValueError(f"path: {path!r} is a torch.export archive but not a pagedpack one (no {META_FILE})")
    step = step_from_metadata(None, extra[META_FILE], path, METADATA_CHOICES)
    check_program_signature(step, _pt2_signature(program), path)
    _check_lora_slices(step.lora_specs, program, path)
    if _logits_rows_tied(program):
        step.one_logits_row_per_seq = (f"the reference target's .pt2 program {path!r} returns one logits row per "
                                       "sequence (exported before logits_indices had a size of its own); export "
                                       "it again to ask for prompt logprobs")
    program._guards_code = []  # module() would exec these strings from the file (pagedpack.formats.pt2_check)
    step.run = program.module()
    return step


def _pt2_signature(program: torch.export.ExportedProgram) -> tuple[dict[str, tuple], tuple]:
    """``({input name: (shape, dtype)}, logits shape)`` of an exported step program; a symbolic size is None."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = {}
    for name in program.graph_signature.user_inputs:
        val = placeholders[name].meta.get("val") if name in placeholders else None
        if isinstance(val, torch.Tensor):
            inputs[name] = (static_shape(val.shape), val.dtype)
    output = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    val = output.meta.get("val") if isinstance(output, torch.fx.Node) else None
    return inputs, static_shape(val.shape) if isinstance(val, torch.Tensor) else ()


def _check_lora_slices(specs, program: torch.export.ExportedProgram, path: str) -> None:
    """The program's ``lora_expand`` call reading ``lora_b_i`` splits it into ``specs[i].slice_sizes``
    (the slices an adapter's modules are copied into); ``ValueError`` naming ``lora_specs`` otherwise."""
    expand = torch.ops.pagedpack.lora_expand.default
    found = {node.args[2].name: list(node.args[4]) for node in program.graph.nodes
             if node.target is expand and isinstance(node.args[2], torch.fx.Node)}
    for name, spec in zip(lora_input_names(specs)[2::2], specs):
        if found.get(name) != list(spec.slice_sizes):
            raise ValueError(f"path: {path!r}: lora_specs: the metadata says {name} holds slices of "
                             f"{list(spec.slice_sizes)} outputs, its program's lora_expand splits it into "
                             f"{found.get(name)}")


def _logits_rows_tied(program: torch.export.ExportedProgram) -> bool:
    """Whether the program's ``logits_indices`` has the size of ``seq_lens`` (one symbol: its
    guard refuses any other length)."""
    sizes = {n.name: n.meta["val"].shape[0] for n in program.graph.nodes
             if n.op == "placeholder" and n.name in ("seq_lens", "logits_indices") and "val" in n.meta}
    return len(sizes) == 2 and str(sizes["seq_lens"]) == str(sizes["logits_indices"])


def _import_op_libraries(file) -> None:
    with zipfile.ZipFile(file) as archive:
        graphs = [archive.read(name) for name in archive.namelist() if name.endswith(".json")]
    for prefix, module in _OP_LIBRARIES.items():
        if any(prefix in graph for graph in graphs):
            importlib.import_module(module)


def _export_program(rewritten) -> torch.export.ExportedProgram:
    """``torch.export`` the step graph on :func:`example_step` with every size dynamic."""
    args, dynamic_shapes = example_step(rewritten)
    try:
        with torch.no_grad():
            return torch.export.export(rewritten.graph_module, args, dynamic_shapes=dynamic_shapes, strict=False)
    except torch._dynamo.exc.UserError as err:  # e.g. a guard on the token count it cannot prove for every size
        first = str(err).strip().splitlines()
        raise ValueError(f"rewritten: torch.export cannot export its step graph for every step size "
                         f"({type(err).__name__}: {' '.join(first[:2])[:400]}); serve the model in process "
                         f"instead") from err


FORMAT = FileFormat("pt2", ".pt2", b"PK\x03\x04", export_pt2, load_pt2,
                    description="a torch.export archive (.pt2, a zip file), run by the reference target")
