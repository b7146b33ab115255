"""Handing the heap memory a finished phase freed back to the operating system; the machine's memory."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


# Below this many weight bytes a build's leftovers (the float64 checks hold about twice the fp32
# weights) are left to the interpreter's own collections: a full collection costs 0.2-0.5 s in a
# process holding many objects (a test worker), more than a tiny model's few MB are worth.
SMALL_MODEL_BYTES = 32 << 20


def release_memory(weight_bytes: int | None = None) -> bool:
    """Free what a finished phase left behind and give it back to the OS.

    The rewrite's checks run float64 copies of the model (twice its fp32 size) as
    ``torch.fx.GraphModule``s, which sit in reference cycles (module <-> graph <-> nodes): they are
    freed only by a full ``gc.collect()``, which may not come for a long while. Their tensors, a
    few MB each, come from glibc's heap, which keeps freed memory mapped until ``malloc_trim``.
    Without both, SmolLM2-135M's process stays about 1 GB larger for its whole life. Returns
    False where there is no glibc (the collection still ran).

    ``weight_bytes``: the weights of the model just built, when known; under ``SMALL_MODEL_BYTES``
    nothing is collected or trimmed (returns False)."""
    if weight_bytes is not None and weight_bytes < SMALL_MODEL_BYTES:
        return False
    gc.collect()
    return trim_heap()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``); False where there
    is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def physical_memory() -> int | None:
    """This machine's RAM in bytes (``sysconf``), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory() -> int | None:
    """Bytes of memory this machine can still give without swapping (Linux's ``MemAvailable``; elsewhere
    :func:`physical_memory`), or None where the OS does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory()
