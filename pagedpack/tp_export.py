"""Tensor-parallel exports: one ``.pt2`` program per rank and a JSON manifest naming them.

``export_tensor_parallel`` writes, beside the manifest ``NAME.json``, ``NAME.rank<r>.pt2`` for every
rank ``r`` (:func:`pagedpack.export.export_pt2` of the rank's shard,
:mod:`pagedpack.passes.tensor_parallel`), then the manifest::

    {"format": "pagedpack-tensor-parallel", "version": 1, "tensor_parallel_size": N,
     "ranks": [{"file": "NAME.rank0.pt2", "sha256": "..."}, ...]}

``LLM("NAME.json")`` serves it with N ranks (:mod:`pagedpack.runtime.tensor_parallel`), each
loading its file. A manifest is untrusted input: it is read as JSON only (at most
:data:`MAX_MANIFEST_BYTES`), every field is checked, a rank file must be a plain name in the
manifest's own folder, and its sha256 must be the one recorded (a rank file of another export is
refused); each ``.pt2`` then passes its own checks (:func:`pagedpack.export.load_pt2`). The
all-reduces in the files name the process group they were exported with; the loader points them
at the group of the processes serving them (:func:`pagedpack.passes.tensor_parallel.set_group_name`).
"""
from __future__ import annotations

import hashlib
import json
import os

from pagedpack.files import atomic_write, check_file_name

FORMAT = "pagedpack-tensor-parallel"
VERSION = 1
MAX_MANIFEST_BYTES = 1 << 16


def export_tensor_parallel(rewritten, model, path, description, *, tp_size: int) -> str:
    """Write ``rewritten`` (a ``RewrittenModel`` captured from the ``transformers`` ``model``) split
    over ``tp_size`` ranks as the manifest ``path`` and its rank files (module docstring); the split
    is checked on a sample first. Returns ``str(path)``. ``ValueError`` if it cannot be split so or
    ``path`` cannot be written."""
    from pagedpack.export import check_output_path, export_pt2
    from pagedpack.passes.pipeline import RewrittenModel
    from pagedpack.passes.tensor_parallel import check_shards, shard_step_graph

    path = check_output_path(path)
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 2:
        raise ValueError(f"tensor_parallel_size: expected an int >= 2 for a tensor-parallel export, got {tp_size!r}")
    check_shards(rewritten.graph_module, rewritten.kv_cache_specs, model, tp_size=tp_size)
    folder, stem = os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0]
    ranks = []
    for rank in range(tp_size):
        gm, specs = shard_step_graph(rewritten.graph_module, rewritten.kv_cache_specs, model, tp_size=tp_size,
                                     rank=rank, group_name="0")
        name = f"{stem}.rank{rank}.pt2"
        export_pt2(RewrittenModel(gm, rewritten.report, specs), os.path.join(folder, name), description)
        ranks.append({"file": name, "sha256": _sha256(os.path.join(folder, name))})
    manifest = {"format": FORMAT, "version": VERSION, "tensor_parallel_size": tp_size, "ranks": ranks}
    with atomic_write(path) as tmp, open(tmp, "w") as file:
        json.dump(manifest, file, indent=1)
    return path


def manifest_size(path: str) -> int:
    """The ``tensor_parallel_size`` of the manifest at ``path`` (its fields checked, not its files)."""
    return len(_parse(path)["ranks"])


def read_manifest(path: str) -> list[str]:
    """The rank files of the manifest at ``path``, in rank order, each checked against its sha256;
    ``ValueError`` naming the field for anything else."""
    folder, files = os.path.dirname(os.path.abspath(path)), []
    for rank, entry in enumerate(_parse(path)["ranks"]):
        name = check_file_name(entry.get("file"), f"ranks[{rank}].file")
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            raise ValueError(f"path: {path!r}: ranks[{rank}].file: no file {name!r} beside the manifest")
        if _sha256(file) != entry["sha256"]:
            raise ValueError(f"path: {path!r}: ranks[{rank}].file: {name!r} is not the file the manifest records "
                             f"(sha256 differs)")
        files.append(file)
    return files


def _parse(path: str) -> dict:
    with open(path, "rb") as file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"path: {path!r}: a tensor-parallel manifest of at most {MAX_MANIFEST_BYTES} bytes expected")
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"path: {path!r} is not a JSON tensor-parallel manifest ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"path: {path!r}: expected format {FORMAT!r} version {VERSION}, got "
                         f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r:.80}")
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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
