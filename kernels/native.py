"""The native CPU kernels (``kernels/csrc/*.cpp``): built on first use, cached.

The sources are compiled with the system C++ compiler against the installed torch's headers and
libraries (paths from :mod:`torch.utils.cpp_extension`) into a shared library registering
``torch.ops.pagedpack_cpu.{paged_attention, reshape_and_cache}`` (``paged_attention_cpu.cpp``, its
prefill path in ``flash_prefill_cpu.cpp``),
``{rms_norm, fused_add_rms_norm}`` (``rms_norm_cpu.cpp``), ``rotate_half_rope`` (``rotary_cpu.cpp``) and
``silu_and_mul`` (``silu_and_mul_cpu.cpp``) and ``{bf16_linear_pack, bf16_linear}``
(``linear_bf16_cpu.cpp``), which the CPU lowering calls, the recurrent ops'
kernels (``recurrent_cpu.cpp``: ``causal_conv1d_varlen``, ``gated_delta_rule_varlen`` (lightning
attention's too, without the delta term), ``selective_scan_varlen``, which
:mod:`pagedpack.kernels.recurrent` calls) and the LoRA ops' (``lora_cpu.cpp``: ``lora_shrink``,
``lora_expand``, which :mod:`pagedpack.kernels.lora` calls), and loaded with
``torch.ops.load_library``. The library is cached under ``$PAGEDPACK_CACHE`` (default
``~/.cache/pagedpack``) ``/native/<key>/``, the key hashing the sources, the torch version, the
compiler flags and the CPU capability, so a change of any of them rebuilds (about 30 s on two
cores) and a second process reuses the build. The build records the library's size and sha256
beside it (``libpagedpack_cpu.json``); a library that does not match is built again, never
mapped. An interrupted build leaves no compiler running and no temporary file.

Without a compiler, or with ``PAGEDPACK_NATIVE=0``, :func:`native_ops` returns ``None`` and the
ops run their PyTorch reference kernels (:mod:`pagedpack.kernels.ops`); :func:`status` says
which and why, and whether the library is built yet, without building it. Decision and
measurements: ``docs/cpu-kernels.md``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from pagedpack.formats.files import atomic_write, sha256_file
from pagedpack.host.child_process import die_with_parent

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention_cpu.cpp", "flash_prefill_cpu.cpp", "rms_norm_cpu.cpp",
                                      "rotary_cpu.cpp", "silu_and_mul_cpu.cpp", "recurrent_cpu.cpp",
                                      "lora_cpu.cpp", "linear_bf16_cpu.cpp")]
_HEADERS = sorted(_CSRC.glob("*.h"))
_ISA_FLAGS = {  # torch.backends.cpu.get_cpu_capability() -> flags selecting ATen's Vectorized<float> width
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}
# a build from scratch on two idle cores, for the messages (docs/cpu-kernels.md); 139-146 s measured
# at a 1-minute load of 4-6 on two cores
_BUILD_SECONDS = 30
_MIN_FREE = 256 << 20  # bytes: below this, a failed build's message names the free space
_reason: str | None = None
_library: Path | None = None


def enabled() -> bool:
    """False when ``PAGEDPACK_NATIVE=0`` asks for the reference kernels."""
    return os.environ.get("PAGEDPACK_NATIVE", "1") != "0"


def native_ops():
    """``torch.ops.pagedpack_cpu`` once the library is built and loaded, else ``None``."""
    return _load() if enabled() else None


def status() -> str:
    """One line: which CPU kernels the ops use (or will use on their first call) and, if the reference
    ones, why. A report, never a build: it compiles nothing, loads no library and writes nothing; a
    library not built yet is reported as such (the first op builds it)."""
    if not enabled():
        return "reference kernels (PAGEDPACK_NATIVE=0)"
    if _load.cache_info().currsize:  # this process has loaded the library, or tried to
        return "native CPU kernels" if _load() is not None else f"reference kernels ({_reason})"
    target = _target()
    if isinstance(target, str):
        return f"reference kernels ({target})"
    library = target[2]
    if _valid(library):
        return f"native CPU kernels (built in {library.parent}; loaded on first use)"
    return (f"native CPU kernels, not built yet: built on first use into {library.parent} "
            f"(about {_BUILD_SECONDS} s on two idle cores, minutes on a busy machine)")


def library_path() -> Path | None:
    """The loaded native library (``$PAGEDPACK_CACHE/native/<key>/libpagedpack_cpu.so``); ``None``
    when the reference kernels run. A process with another ``$PAGEDPACK_CACHE`` finds this build
    if that folder is copied to the same place under its cache."""
    return _library if native_ops() is not None else None


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        # -w: torch's headers warn under C++17, and a failed build's message keeps the compiler's last lines
        "-O3", "-w", "-std=c++17", "-shared", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DCPU_CAPABILITY={capability if capability in _ISA_FLAGS else 'DEFAULT'}",
        *_ISA_FLAGS.get(capability, []),
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()),
        "-lc10", "-ltorch_cpu", "-ltorch",
    ]


def _target() -> tuple[str, list[str], Path] | str:
    """``(compiler, flags, library)``: what a build would run and where its library goes (nothing is
    built or written); or why there is no build (no compiler)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH"
    flags = _flags()
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in _SOURCES + _HEADERS), torch.__version__.encode(),
                                    *map(str.encode, flags)]))
    cache = Path(os.environ.get("PAGEDPACK_CACHE", Path.home() / ".cache" / "pagedpack"))
    return compiler, flags, cache / "native" / key.hexdigest()[:16] / "libpagedpack_cpu.so"


@functools.cache
def _load():
    global _reason, _library
    target = _target()
    if isinstance(target, str):
        _reason = target
        return None
    compiler, flags, library = target
    try:
        if not _valid(library):
            _build(compiler, flags, library)
        torch.ops.load_library(str(library))
        _library = library
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        _reason = f"native build failed: {str(e).strip()[-800:]}"
        warnings.warn(f"pagedpack: {_reason}; using the reference kernels", RuntimeWarning, stacklevel=3)
        return None
    return torch.ops.pagedpack_cpu


def _record(library: Path) -> Path:
    return library.with_suffix(".json")


def _valid(library: Path) -> bool:
    """``library`` is the file a build wrote: its size and sha256 are those recorded beside it at
    build time (a truncated or overwritten library is never mapped: that ends in a ``Bus error``)."""
    try:
        record = json.loads(_record(library).read_text())
        return (isinstance(record, dict) and record.get("size") == library.stat().st_size
                and record.get("sha256") == sha256_file(library))
    except (OSError, ValueError):
        return False


# The compiler runs under this watchdog, in a process group of its own: when pagedpack's process
# dies (even by SIGKILL) the watchdog gets SIGTERM (PR_SET_PDEATHSIG) and kills the whole group,
# the compiler's own children (cc1plus, as, ld) included.
_WATCHDOG = ("import os, signal, subprocess, sys\n"
             "group = []\n"
             "def stop(*_):\n"
             "    if group: os.killpg(group[0], signal.SIGKILL)\n"
             "    os._exit(1)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "child = subprocess.Popen(sys.argv[1:], start_new_session=True)\n"
             "group.append(child.pid)\n"
             "sys.exit(child.wait())\n")


def _build(compiler: str, flags: list[str], library: Path) -> None:
    """Compile into a temporary file beside ``library`` (:func:`pagedpack.formats.files.atomic_write`: safe
    with concurrent builds, none left by a killed one), record its size and sha256, rename it into
    place. ``RuntimeError`` with the compiler's errors, and the free space when the disk is short."""
    print(f"pagedpack: building the native CPU kernels into {library.parent} "
          f"(first use only: about {_BUILD_SECONDS} s on two idle cores, minutes on a busy machine)",
          file=sys.stderr, flush=True)
    library.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(library) as tmp:
        command = [sys.executable, "-c", _WATCHDOG, compiler, *map(str, _SOURCES), "-o", tmp, *flags]
        watchdog = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=die_with_parent(signal.SIGTERM))
        try:
            _, stderr = watchdog.communicate()
        except BaseException:  # KeyboardInterrupt, ...: stop the compiler before going on
            watchdog.terminate()
            watchdog.wait()
            raise
        if watchdog.returncode:
            errors = stderr.strip().splitlines()[-8:]  # the cause (ld's, cc1plus') comes before collect2's last word
            free = shutil.disk_usage(library.parent).free
            short = f" (only {free >> 20} MiB free under {library.parent})" if free < _MIN_FREE else ""
            raise RuntimeError(f"{compiler} exited with {watchdog.returncode}{short}: " + " | ".join(errors)[-800:])
        record = {"size": os.path.getsize(tmp), "sha256": sha256_file(tmp)}
        with atomic_write(_record(library)) as record_tmp:
            Path(record_tmp).write_text(json.dumps(record))
