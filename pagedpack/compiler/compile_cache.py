"""Step programs of checkpoints, captured in a child process and kept on disk for ``LLM(path)``.

vLLM builds its model in an engine process of its own and keeps the graphs it compiles under
``~/.cache/vllm/torch_compile_cache``. pagedpack does the like for a local checkpoint served on
the CPU by the reference target: a child Python process loads it, captures and rewrites it and
writes the step graph as a ``.pt2`` export (:func:`pagedpack.lowering.reference.pt2.export_pt2`, with the pass
report); the ``LLM`` loads that file and lowers it as ``LLM.from_exported`` does. The serving
process so never imports ``transformers``' modeling code, dynamo's capture or the passes (their
memory: ``docs/cpu-kernels.md``), and a later ``LLM`` of the same checkpoint starts from the file.

An entry is ``<cache>/compiled/<digest of the checkpoint's path, dtype and enable_lora>/`` (``<cache>``:
``$PAGEDPACK_CACHE`` or ``~/.cache/pagedpack``) with ``step.pt2`` and ``info.json`` (the pass
report as JSON, and a ``key`` (the checkpoint's files with sizes and times, dtype, ``enable_lora``, the
versions of torch and transformers, a digest of pagedpack's own source) which must equal the current one,
else the entry is built again in its place: one entry per checkpoint, dtype and ``enable_lora``. With
``enable_lora`` the child rewrites the model with LoRA inputs and the ``.pt2`` carries them: the adapters
are loaded into its slots when served, as for a capture in process. A checkpoint the child
cannot compile (the pass refuses it, or ``torch.export`` fails) is recorded as such, and its
``LLM`` captures in its own process, which raises the errors that capture raises there.

``PAGEDPACK_COMPILE_CACHE=0`` (or ``false``, ``off``, ``no``) turns this off: everything in one
process, as for an ``nn.Module``, the built-in ``tiny`` model, a hub id, another target or device,
``keep_source_model=True``, a ``memory_budget``, ``extra_passes`` or ``PAGEDPACK_DUMP_GRAPHS``
(the passes' graphs are written where they run), which all capture in process. The child's messages (``transformers``'
loading report among them) show on the run that builds the entry; the report's pass times are that
run's. Entries of checkpoints that are gone, and what a killed build left, are removed when the next
entry is built.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedpack.engine_args import EngineArgs
from pagedpack.formats.files import pid_alive
from pagedpack.host.child_process import die_with_parent
from pagedpack.host.devices import is_cpu
from pagedpack.models.aliases import cache_dir, checkpoint_stamp
from pagedpack.passes.report import PassReport

ENV = "PAGEDPACK_COMPILE_CACHE"
_OFF = ("0", "false", "off", "no")
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
    entry = _entry_dir(stamp, args.dtype, args.enable_lora)
    key = _key(stamp, args.dtype, enable_lora=args.enable_lora)
    info = _read_json(entry / "info.json")
    current = info.get("key") == key
    if current and isinstance(info.get("error"), str):  # recorded: the child cannot compile this checkpoint
        return None
    compiled = _parse(info, entry, stamp) if current else None
    return compiled or _parse(_compile(stamp[0], args.dtype, args.enable_lora, entry, key), entry, stamp)


def _parse(info: dict, entry: Path, stamp: tuple) -> CompiledStep | None:
    """The entry ``info`` (an ``info.json`` record) describes; None for a failed or damaged one."""
    try:
        if info.get("error") is not None or not (entry / "step.pt2").is_file():
            return None
        report = PassReport.from_dict(info["report"])  # JSON data: a record is never unpickled
        report.notes.insert(0, f"pass times: those of the capture that built the compile-cache entry {entry.name}")
        weights = info["source_weight_bytes"]
        if type(weights) is not int:
            return None
        return CompiledStep(str(entry / "step.pt2"), report, stamp, weights)
    except Exception:  # noqa: BLE001 -- whatever a damaged record raises: build the entry again
        return None


def forget(path: str) -> None:
    """Remove the entry whose ``step.pt2`` is ``path`` (one that failed to load)."""
    shutil.rmtree(Path(path).parent, ignore_errors=True)


def _applies(args: EngineArgs) -> bool:
    return (os.environ.get(ENV, "1").lower() not in _OFF and not os.environ.get("PAGEDPACK_DUMP_GRAPHS")
            and bool(sys.executable) and isinstance(args.model, (str, os.PathLike)) and not args.is_exported
            and args.lowering_target.serves_pt2 and is_cpu(args.device)
            and not args.keep_source_model and args.memory_budget is None and not args.extra_passes
            and args.tensor_parallel_size == 1)


def _entry_dir(stamp: tuple, dtype: torch.dtype | None, enable_lora: bool) -> Path:
    digest = hashlib.sha256(os.fsencode(stamp[0]) + f"|{dtype}{'|lora' if enable_lora else ''}".encode()).hexdigest()
    return cache_dir() / "compiled" / digest[:16]
    return cache_dir() / "compiled" / digest


def _key(stamp: tuple, dtype: torch.dtype | None, extra_passes=(), *, enable_lora: bool = False) -> dict:
    """What an entry must have been built from: the checkpoint, dtype, ``enable_lora``, versions, pagedpack's source
    (which covers the step pipeline's own passes) and the uuids of ``extra_passes``
    (:meth:`~pagedpack.passes.manager.Pass.uuid`; passes of this process, so today an ``LLM`` with
    extra passes captures in process and uses no entry)."""
    return {"checkpoint": json.loads(json.dumps(stamp)), "dtype": str(dtype), "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"), "pagedpack": _source_digest(),
            "extra_passes": [p.uuid() for p in extra_passes], "enable_lora": enable_lora}


@functools.cache
def _source_digest() -> str:
    """sha256 over pagedpack's Python source files, so that an entry never outlives the code that wrote it."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for folder in importlib.util.find_spec(package).submodule_search_locations:
            for path in sorted(Path(folder).rglob("*.py")):  # with the target packages under lowering/
                digest.update(f"{package}.{path.relative_to(folder)}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def _read_json(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


# The child's program: pagedpack and everything else imported from the parent's sys.path, not from
# the working directory that ``python -m`` / ``-c`` would put first.
_CHILD = ("import json, os, sys; sys.path[:] = json.loads(os.environ['PAGEDPACK_SYS_PATH']); "
          "from pagedpack.compiler.compile_cache import _main; sys.exit(_main(*sys.argv[1:]))")


def _compile(model: str, dtype: torch.dtype | None, enable_lora: bool, entry: Path, key: dict) -> dict:
    """Build the entry for ``model`` (with LoRA inputs if ``enable_lora``) in a child process
    (:func:`_main`, its messages on this process's stderr) into a staging folder renamed into place;
    its ``info.json`` record. A record whose ``error`` comes from a child that could not run (or a cache
    that cannot be written) is returned, not kept: the next ``LLM`` tries again."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(entry.parent)
        staging = Path(tempfile.mkdtemp(prefix=f".partial-{os.getpid()}-", dir=entry.parent))
    except OSError as err:
        print(f"pagedpack: cannot write the compile cache ({err}); capturing in this process", file=sys.stderr)
        return {"key": key, "error": str(err)}
    print(f"pagedpack: capturing {model} in a child process (compile cache: {entry})", file=sys.stderr, flush=True)
    try:
        dtype_name = "auto" if dtype is None else str(dtype).removeprefix("torch.")
        env = {**os.environ, "PAGEDPACK_SYS_PATH": json.dumps(sys.path)}
        try:
            done = subprocess.run([sys.executable, "-c", _CHILD, model, dtype_name, str(int(enable_lora)),
                                   str(staging)], env=env, preexec_fn=die_with_parent())
        except OSError as err:  # no interpreter to start (an embedded or frozen Python)
            done = subprocess.CompletedProcess([], None, stderr=str(err))
        result = _read_json(staging / "result.json")
        if done.returncode not in (0, _UNCOMPILABLE) or not result:
            reason = result.get("error") or done.stderr or f"exit status {done.returncode}"
            print(f"pagedpack: the child process failed ({reason}); capturing in this process",
                  file=sys.stderr, flush=True)
            return {"key": key, "error": reason}
        if result["error"] is not None:
            print(f"pagedpack: {model} cannot be compiled ({result['error'][:300]}); capturing in this process",
                  file=sys.stderr, flush=True)
        info = {"key": key, **result}
        (staging / "result.json").unlink()
        (staging / "info.json").write_text(json.dumps(info))
        shutil.rmtree(entry, ignore_errors=True)
        try:
            staging.rename(entry)
        except OSError:  # another process put its entry there first
            pass
        return info
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_leftovers(folder: Path) -> None:
    """Remove staging folders of processes that are gone (killed while a child compiled) and the
    entries of checkpoints that no longer exist."""
    for path in folder.iterdir():
        if path.name.startswith(".partial-"):
            pid = path.name.split("-")[1]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
        elif path.is_dir():
            key = _read_json(path / "info.json").get("key")
            checkpoint = key.get("checkpoint") if isinstance(key, dict) else None
            if isinstance(checkpoint, list) and checkpoint and isinstance(checkpoint[0], str) \
                    and not os.path.isdir(checkpoint[0]):
                shutil.rmtree(path, ignore_errors=True)


# Failures of the machine, not of the checkpoint: reported, never recorded.
_TRANSIENT = (ImportError, MemoryError, OSError)


def _main(model: str, dtype_name: str, enable_lora: str, out: str) -> int:
    """The child: capture and rewrite ``model`` (with LoRA inputs if ``enable_lora`` is ``"1"``), write
    ``step.pt2`` to ``out`` and ``result.json``:
    ``{"error": None, "source_weight_bytes": n, "report": PassReport.to_dict()}``, or for a checkpoint it
    cannot compile ``{"error": reason}`` (exit status :data:`_UNCOMPILABLE`). It dies with its parent
    (:func:`pagedpack.host.child_process.die_with_parent`, set before it starts)."""
    from pagedpack.compiler.planner import resident_weight_bytes
    from pagedpack.compiler.source import capture_source
    from pagedpack.lowering.reference.pt2 import export_pt2

    args = EngineArgs(model=model, dtype=None if dtype_name == "auto" else getattr(torch, dtype_name),
                      enable_lora=enable_lora == "1")
    result = Path(out) / "result.json"
    try:
        module, description, rewritten = capture_source(args)
        rewritten.raise_if_refused()
        export_pt2(rewritten, os.path.join(out, "step.pt2"), description)
    except _TRANSIENT as err:
        result.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:1000]}))
        return 1
    except Exception as err:  # noqa: BLE001 -- the parent captures in process and raises it there
        result.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[:1000]}))
        return _UNCOMPILABLE
    result.write_text(json.dumps({"error": None,
                                  "source_weight_bytes": resident_weight_bytes(rewritten.graph_module, module),
                                  "report": rewritten.report.to_dict()}))
    return 0
