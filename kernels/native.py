"""The native CPU kernels (``kernels/csrc/paged_attention_cpu.cpp``): built on first use, cached.

The source is compiled with the system C++ compiler against the installed torch's headers and
libraries (paths from :mod:`torch.utils.cpp_extension`) into a shared library registering
``torch.ops.pagedpack_cpu.{paged_attention, reshape_and_cache}``, and loaded with
``torch.ops.load_library``. The library is cached under ``$PAGEDPACK_CACHE`` (default
``~/.cache/pagedpack``) ``/native/<key>/``, the key hashing the source, the torch version, the
compiler flags and the CPU capability, so a change of any of them rebuilds (about 30 s on two
cores) and a second process reuses the build.

Without a compiler, or with ``PAGEDPACK_NATIVE=0``, :func:`native_ops` returns ``None`` and the
ops run their PyTorch reference kernels (:mod:`pagedpack.kernels.ops`); :func:`status` says
which and why. Decision and measurements: ``docs/cpu-kernels.md``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
_ISA_FLAGS = {  # torch.backends.cpu.get_cpu_capability() -> flags selecting ATen's Vectorized<float> width
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"],
}
_reason: str | None = None


def enabled() -> bool:
    """False when ``PAGEDPACK_NATIVE=0`` asks for the reference kernels."""
    return os.environ.get("PAGEDPACK_NATIVE", "1") != "0"


def native_ops():
    """``torch.ops.pagedpack_cpu`` once the library is built and loaded, else ``None``."""
    return _load() if enabled() else None


def status() -> str:
    """One line: which CPU kernels the ops use and, if the reference ones, why."""
    if not enabled():
        return "reference kernels (PAGEDPACK_NATIVE=0)"
    return "native CPU kernels" if _load() is not None else f"reference kernels ({_reason})"


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DCPU_CAPABILITY={capability if capability in _ISA_FLAGS else 'DEFAULT'}",
        *_ISA_FLAGS.get(capability, []),
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()),
        "-lc10", "-ltorch_cpu", "-ltorch",
    ]


@functools.cache
def _load():
    global _reason
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _reason = f"no C++ compiler {compiler!r} on PATH"
        return None
    flags = _flags()
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), torch.__version__.encode(), *map(str.encode, flags)]))
    cache = Path(os.environ.get("PAGEDPACK_CACHE", Path.home() / ".cache" / "pagedpack"))
    library = cache / "native" / key.hexdigest()[:16] / "libpagedpack_cpu.so"
    try:
        if not library.exists():
            _build(compiler, flags, library)
        torch.ops.load_library(str(library))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        _reason = f"native build failed: {str(e).strip()[-500:]}"
        warnings.warn(f"pagedpack: {_reason}; using the reference kernels", RuntimeWarning, stacklevel=3)
        return None
    return torch.ops.pagedpack_cpu


def _build(compiler: str, flags: list[str], library: Path) -> None:
    """Compile into a temporary file beside ``library``, then rename (safe with concurrent builds)."""
    print(f"pagedpack: building the native CPU kernels into {library.parent} (first use only, about 30 s)",
          file=sys.stderr, flush=True)
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, str(_SOURCE), "-o", tmp, *flags], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
