"""The reference target's tensor-parallel format: one ``.pt2`` program per rank and a JSON manifest
naming them (:data:`MANIFEST`, ``"tp"``, files starting with ``{``; its rank files are :data:`~.pt2.FORMAT`'s).

Why a format of the reference target, not a format-neutral wrapper around any target's files: the
rank files are ``.pt2`` programs whose functional collectives only the reference target's lowering
keeps and runs (gloo, CPU), their shards come from the reference step graph
(:mod:`pagedpack.passes.tensor_parallel`), and no other target runs tensor-parallel; a second
target would bring its own manifest format (its rank files, its collectives) the same way.

``export_tensor_parallel`` writes, beside the manifest ``NAME.json``, ``NAME.rank<r>.pt2`` for every
rank ``r`` (:func:`~pagedpack.lowering.reference.pt2.export_pt2` of the rank's shard,
:mod:`pagedpack.passes.tensor_parallel`), then the manifest::

    {"format": "pagedpack-tensor-parallel", "version": 1, "tensor_parallel_size": N, "export_id": "<uuid>",
     "ranks": [{"file": "NAME.rank0.pt2", "sha256": "..."}, ...]}

and each rank file records ``{"rank": r, "size": N, "export_id": ...}`` in its own metadata.

``LLM("NAME.json")`` serves it with N ranks (:mod:`pagedpack.runtime.tensor_parallel`), each
loading its file. A manifest is untrusted input: it is read as JSON only (at most
:data:`MAX_MANIFEST_BYTES`), every field is checked, a rank file must be a plain name in the
manifest's own folder (not a symbolic link), its sha256 must be the one recorded, and once loaded
its metadata must say it is that rank of that export (a rank file of another export, or one file
twice, is refused); each ``.pt2`` then passes its own checks (:func:`~pagedpack.lowering.reference.pt2.load_pt2`). The
all-reduces in the files name the process group they were exported with; the loader points them
at the group of the processes serving them (:func:`pagedpack.passes.tensor_parallel.set_group_name`).
"""
from __future__ import annotations

import json
import os
import uuid
import zipfile

from pagedpack.formats.export import META_FILE, ExportedStep, check_output_path
from pagedpack.formats.files import atomic_write, check_file_name, parse_json, sha256_file
from pagedpack.lowering.reference.pt2 import export_pt2, load_pt2
from pagedpack.lowering.targets import FileFormat

FORMAT = "pagedpack-tensor-parallel"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 16


def export_tensor_parallel(rewritten, model, path, description, *, tp_size: int) -> str:
    """Write ``rewritten`` (a ``RewrittenModel`` captured from the ``transformers`` ``model``) split
    over ``tp_size`` ranks as the manifest ``path`` and its rank files (module docstring); the split
    is checked on a sample first. Returns ``str(path)``. ``ValueError`` if it cannot be split so (a
    model with recurrent layers or LoRA inputs (``enable_lora``) among others) or ``path`` cannot be written."""
    from pagedpack.passes.pipeline import RewrittenModel
    from pagedpack.passes.tensor_parallel import (
        check_no_recurrent_state,
        check_no_sparse_attention,
        check_shards,
        shard_step_graph,
    )

    path = check_output_path(path)
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 2:
        raise ValueError(f"tensor_parallel_size: expected an int >= 2 for a tensor-parallel export, got {tp_size!r}")
    if rewritten.lora_specs:
        raise ValueError("enable_lora: LoRA adapters are not sharded over tensor-parallel ranks yet, so a "
                         "tensor-parallel export does not carry the LoRA inputs; export it as one pt2 file")
    check_no_recurrent_state(rewritten.state_specs, tp_size)
    check_no_sparse_attention(rewritten.graph_module, tp_size)
    check_shards(rewritten.graph_module, rewritten.kv_cache_specs, model, tp_size=tp_size)
    folder, stem = os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0]
    ranks, export_id = [], uuid.uuid4().hex
    for rank in range(tp_size):
        gm, specs = shard_step_graph(rewritten.graph_module, rewritten.kv_cache_specs, model, tp_size=tp_size,
                                     rank=rank, group_name="0")
        name = f"{stem}.rank{rank}.pt2"
        export_pt2(RewrittenModel(gm, rewritten.report, specs), os.path.join(folder, name), description,
                   tensor_parallel={"rank": rank, "size": tp_size, "export_id": export_id})
        ranks.append({"file": name, "sha256": sha256_file(os.path.join(folder, name))})
    manifest = {"format": FORMAT, "version": VERSION, "tensor_parallel_size": tp_size, "export_id": export_id,
                "ranks": ranks}
    with atomic_write(path) as tmp, open(tmp, "w") as file:
        json.dump(manifest, file, indent=1)
    return path


def manifest_size(path: str) -> int:
    """The ``tensor_parallel_size`` of the manifest at ``path`` (its fields checked, not its files)."""
    return len(_parse(path)["ranks"])


def read_manifest(path: str) -> list[str]:
    """The rank files of the manifest at ``path``, in rank order, each checked against its sha256 and
    its own record of its rank and export; ``ValueError`` naming the field for anything else."""
    manifest = _parse(path)
    folder, files = os.path.dirname(os.path.abspath(path)), []
    for rank, entry in enumerate(manifest["ranks"]):
        name = check_file_name(entry.get("file"), f"ranks[{rank}].file")
        file = os.path.join(folder, name)
        if os.path.islink(file):
            raise ValueError(f"path: {path!r}: ranks[{rank}].file: {name!r} is a symbolic link; expected a file "
                             f"beside the manifest")
        if not os.path.isfile(file):
            raise ValueError(f"path: {path!r}: ranks[{rank}].file: no file {name!r} beside the manifest")
        if sha256_file(file) != entry["sha256"]:
            raise ValueError(f"path: {path!r}: ranks[{rank}].file: {name!r} is not the file the manifest records "
                             f"(sha256 differs)")
        _check_rank(file, path, rank, len(manifest["ranks"]), manifest["export_id"])
        files.append(file)
    return files


def _check_rank(file: str, path: str, rank: int, size: int, export_id: str) -> None:
    """``ValueError`` unless the rank file ``file`` says (its ``pagedpack.json``) it is that rank of that export."""
    try:
        with zipfile.ZipFile(file) as archive:
            (member,) = [n for n in archive.namelist() if n.endswith(f"/extra/{META_FILE}")]
            if archive.getinfo(member).file_size > MAX_MANIFEST_BYTES << 8:
                raise ValueError("its metadata is too large")
            said = parse_json(archive.read(member)).get("tensor_parallel")
    except (zipfile.BadZipFile, ValueError, AttributeError) as err:
        raise ValueError(f"path: {path!r}: ranks[{rank}].file: not a pagedpack .pt2 archive ({err})") from err
    want = {"rank": rank, "size": size, "export_id": export_id}
    if said != want:
        raise ValueError(f"path: {path!r}: ranks[{rank}].file: its metadata says {said!r:.200}, expected {want} "
                         f"(a rank file of another export, or of another rank)")


def _parse(path: str) -> dict:
    with open(path, "rb") as file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"path: {path!r}: a tensor-parallel manifest of at most {MAX_MANIFEST_BYTES} bytes expected")
    try:
        manifest = parse_json(data)
    except ValueError as err:
        raise ValueError(f"path: {path!r} is not a JSON tensor-parallel manifest ({err})") from err
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT and type(manifest.get("version")) is int
            and manifest["version"] == VERSION and isinstance(manifest.get("export_id"), str)):
        got = ({k: manifest.get(k) for k in ("format", "version", "export_id")} if isinstance(manifest, dict)
               else manifest)
        raise ValueError(f"path: {path!r}: expected format {FORMAT!r}, version {VERSION} and an export_id, got "
                         f"{got!r:.120}")
    size, ranks = manifest.get("tensor_parallel_size"), manifest.get("ranks")
    if not (isinstance(size, int) and not isinstance(size, bool) and 2 <= size <= 64
            and isinstance(ranks, list) and len(ranks) == size):
        raise ValueError(f"path: {path!r}: tensor_parallel_size: expected an int in [2, 64] and as many ranks, got "
                         f"{size!r:.40} and {len(ranks) if isinstance(ranks, list) else ranks!r:.40}")
    for rank, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise ValueError(f"path: {path!r}: ranks[{rank}]: expected {{'file': NAME, 'sha256': HEX}}, "
                             f"got {entry!r:.120}")
    return manifest


def _export(rewritten, path, description=None, *, model, tensor_parallel_size: int) -> str:
    return export_tensor_parallel(rewritten, model, path, description, tp_size=tensor_parallel_size)


def load_rank(path, *, trust_file: bool = False, rank: int = 0) -> ExportedStep:
    """Rank ``rank``'s program of the manifest at ``path`` (:func:`read_manifest`, then its ``.pt2``)."""
    return load_pt2(read_manifest(path)[rank], trust_file=trust_file)


MANIFEST = FileFormat("tp", ".json", b"{", _export, load_rank, ranks_of="pt2", world_size=manifest_size,
                    description="a JSON manifest of one .pt2 file per tensor-parallel rank, run by the reference "
                                "target")
