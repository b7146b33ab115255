"""Step programs of checkpoints, captured in a child process and kept on disk for ``LLM(path)``.

vLLM builds its model in an engine process of its own and keeps the graphs it compiles under
``~/.cache/vllm/torch_compile_cache``. pagedpack does the like for a local checkpoint served on
the CPU by the reference target: a child Python process loads it, captures and rewrites it and
writes the step graph as a ``.pt2`` export (:func:`pagedpack.export.export_pt2`, with the pass
report); the ``LLM`` loads that file and lowers it as ``LLM.from_exported`` does. The serving
process so never imports ``transformers``' modeling code, dynamo's capture or the passes (their
memory: ``docs/cpu-kernels.md``), and a later ``LLM`` of the same checkpoint starts from the file.

An entry is ``<cache>/compiled/<digest of the checkpoint's path and dtype>/`` (``<cache>``:
``$PAGEDPACK_CACHE`` or ``~/.cache/pagedpack``) with ``step.pt2`` and ``info.json`` (the pass
report, pickled, and a ``key`` (the checkpoint's files with sizes and times, dtype, the versions of
torch and transformers, a digest of pagedpack's own source) which must equal the current one, else
the entry is built again in its place: one entry per checkpoint and dtype. A checkpoint the child
cannot compile (the pass refuses it, or ``torch.export`` fails) is recorded as such, and its
``LLM`` captures in its own process, which raises the errors that capture raises there.

``PAGEDPACK_COMPILE_CACHE=0`` turns this off (everything in one process, as for an ``nn.Module``,
the built-in ``tiny`` model, a hub id, another target or device, ``keep_source_model=True`` or a
``memory_budget``, which all capture in process).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedpack.engine_args import EngineArgs
from pagedpack.models.aliases import cache_dir, checkpoint_stamp

ENV = "PAGEDPACK_COMPILE_CACHE"
_UNCOMPILABLE = 3  # the child's exit status for a checkpoint it cannot compile (anything else may be passing)
_PACKAGES = ("pagedpack", "pagedpack.passes", "pagedpack.lowering", "pagedpack.kernels", "pagedpack.models",
             "pagedpack.runtime")


@dataclass
class CompiledStep:
    """A cache entry: the ``.pt2`` file ``path``, the pass ``report``, the checkpoint's ``stamp``
    (:func:`~pagedpack.models.aliases.checkpoint_stamp`) and ``source_weight_bytes``, the weights
    the ``transformers`` model and the rewritten graph hold together (``LLM.plan_memory``)."""

    path: str
    report: object
    stamp: tuple
    source_weight_bytes: int


def compiled_step(args: EngineArgs) -> CompiledStep | None:
    """The cache entry of ``args.model``, compiled by a child process first if missing or stale;
    None where the cache does not apply (module docstring) or the child could not compile it."""
    if not _applies(args):
        return None
    stamp = checkpoint_stamp(args.model)
    if stamp is None:  # no local directory
        return None
    entry = _entry_dir(stamp, args.dtype)
    key = _key(stamp, args.dtype)
    info = _read_json(entry / "info.json")
    compiled = _parse(info, entry, stamp) if info.get("key") == key else None
    if compiled is None and not (info.get("key") == key and isinstance(info.get("error"), str)):
        compiled = _parse(_compile(stamp[0], args.dtype, entry, key), entry, stamp)
    return compiled


def _parse(info: dict, entry: Path, stamp: tuple) -> CompiledStep | None:
    """The entry ``info`` (an ``info.json`` record) describes; None for a failed or damaged one."""
    try:
        if info.get("error") is not None or not (entry / "step.pt2").is_file():
            return None
        report = pickle.loads(base64.b64decode(info["report"], validate=True))
        weights = info["source_weight_bytes"]
        if not (callable(getattr(report, "format", None)) and isinstance(weights, int)):
            return None
        return CompiledStep(str(entry / "step.pt2"), report, stamp, weights)
    except Exception:  # noqa: BLE001 -- whatever a damaged record raises: build the entry again
        return None


def forget(path: str) -> None:
    """Remove the entry whose ``step.pt2`` is ``path`` (one that failed to load)."""
    shutil.rmtree(Path(path).parent, ignore_errors=True)


def _applies(args: EngineArgs) -> bool:
    return (os.environ.get(ENV, "1") != "0" and isinstance(args.model, (str, os.PathLike)) and not args.is_exported
            and args.lowering_target.serves_pt2 and args.device_type == "cpu"
            and not args.keep_source_model and args.memory_budget is None)


def _entry_dir(stamp: tuple, dtype: torch.dtype | None) -> Path:
    digest = hashlib.sha256(f"{stamp[0]}|{dtype}".encode()).hexdigest()[:16]
    return cache_dir() / "compiled" / digest


def _key(stamp: tuple, dtype: torch.dtype | None) -> dict:
    return {"checkpoint": json.loads(json.dumps(stamp)), "dtype": str(dtype), "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"), "pagedpack": _source_digest()}


@functools.cache
def _source_digest() -> str:
    """sha256 over pagedpack's Python source files, so that an entry never outlives the code that wrote it."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for folder in importlib.util.find_spec(package).submodule_search_locations:
            for path in sorted(Path(folder).glob("*.py")):
                digest.update(f"{package}.{path.name}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _compile(model: str, dtype: torch.dtype | None, entry: Path, key: dict) -> dict:
    """Build the entry for ``model`` in a child process (``python -m pagedpack.compile_cache``)
    into a staging folder renamed into place; its ``info.json`` record."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".partial-{entry.name}-", dir=entry.parent))
    except OSError as err:
        print(f"pagedpack: cannot write the compile cache ({err}); capturing in this process", file=sys.stderr)
        return {"key": key, "error": str(err)}
    print(f"pagedpack: capturing {model} in a child process; its step program is kept in {entry} for later runs",
          file=sys.stderr, flush=True)
    try:
        dtype_name = "auto" if dtype is None else str(dtype).removeprefix("torch.")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}  # pagedpack as imported here
        done = subprocess.run([sys.executable, "-m", "pagedpack.compile_cache", model, dtype_name, str(staging)],
                              capture_output=True, text=True, env=env)
        result = _read_json(staging / "result.json")
        if done.returncode not in (0, _UNCOMPILABLE) or not result:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            print(f"pagedpack: the child process failed ({last[:300]}); capturing in this process",
                  file=sys.stderr, flush=True)
            return {"key": key, "error": last}  # not recorded: it may pass next time
        info = {"key": key, **result}
        (staging / "result.json").rename(staging / "info.json")
        (staging / "info.json").write_text(json.dumps(info))
        shutil.rmtree(entry, ignore_errors=True)
        try:
            staging.rename(entry)
        except OSError:  # another process put its entry there first
            pass
        return info
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _main(model: str, dtype_name: str, out: str) -> int:
    """The child: capture and rewrite ``model``, write ``step.pt2`` to
    ``out``, and ``result.json``: ``{"error": None, "source_weight_bytes": n, "report": pickled}``,
    or for a checkpoint it cannot compile ``{"error": reason}`` (exit status :data:`_UNCOMPILABLE`)."""
    from pagedpack.export import export_pt2
    from pagedpack.planner import resident_weight_bytes
    from pagedpack.source import capture_source

    args = EngineArgs(model=model, dtype=None if dtype_name == "auto" else getattr(torch, dtype_name))
    result = Path(out) / "result.json"
    try:
        module, description, rewritten = capture_source(args)
        rewritten.raise_if_refused()
        export_pt2(rewritten, os.path.join(out, "step.pt2"), description)
    except Exception as err:  # noqa: BLE001 -- the parent captures in process and raises it there
        result.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:1000]}))
        return _UNCOMPILABLE
    result.write_text(json.dumps({"error": None,
                                  "source_weight_bytes": resident_weight_bytes(rewritten.graph_module, module),
                                  "report": base64.b64encode(pickle.dumps(rewritten.report)).decode("ascii")}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:]))
