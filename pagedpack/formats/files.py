"""Writing files atomically, checking names and JSON read from files, and hashing.

Every file pagedpack writes (exports, compile-cache records, the native library, plots, alias
records) goes through :func:`atomic_write`: the bytes go to a temporary file in the destination's
folder, are flushed to disk (``fsync``) and renamed over the destination, so a crash, a kill or
a full disk leaves the old file or the new one, never a partial one. Temporary files are named
``.<name>.<pid>-<random>.tmp``; those of processes that are gone are removed by the next write to the
same destination.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import shutil

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]+\.tmp$")
_CHUNK = 1 << 20


def check_file_name(name, what: str) -> str:
    """``name`` if it is a plain file name (a non-empty str with no path separator, not ``.`` or
    ``..``, no NUL); ``ValueError`` naming ``what`` otherwise. For names read from a file's
    metadata before they are joined to a folder."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or os.path.isabs(name) or (os.altsep and os.altsep in name)):
        raise ValueError(f"{what}: expected a plain file name (no folder, no '..'), got {name!r:.120}")
    return name


def parse_json(data: str | bytes):
    """``json.loads(data)`` for text read from a file: whatever it does not parse (not JSON, not UTF-8,
    nested deeper than Python's recursion limit, a ``\\ud800`` escape that decodes to a lone surrogate,
    which no response or log line can encode later) a ``ValueError`` saying why."""
    try:
        value = json.loads(data)
        json.dumps(value, ensure_ascii=False).encode()
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except UnicodeEncodeError:
        raise ValueError("JSON holding a string that is not UTF-8 text (a lone surrogate escape)") from None
    return value


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; once the block ends without an exception, the file
    written there is fsynced and renamed to ``path`` (and the folder fsynced). On an exception the
    temporary file is removed and ``path`` is left as it was. An ``OSError`` (a full disk, no
    permission) is raised again as an ``OSError`` that names ``path``."""
    tmp = temp_path(path)
    try:
        yield tmp
        publish(tmp, path)
    except OSError as err:
        raise OSError(err.errno, f"cannot write {os.fspath(path)!r}: {err.strerror or err}") from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def temp_path(path: str | os.PathLike) -> str:
    """A fresh temporary name beside ``path`` (``.<name>.<pid>-<random>.tmp``), for a file or a
    staging folder; what killed writers left beside ``path`` is removed first."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    _remove_stale_temps(folder, name)
    return os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def publish(tmp: str, path: str | os.PathLike) -> None:
    """fsync the finished file ``tmp`` and rename it to ``path`` (same folder), then fsync the folder."""
    with open(tmp, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(os.fspath(path))))


class RecordingWriter(io.RawIOBase):
    """A binary file wrapper for writers implemented in C++ (``torch.export.save``): the first
    ``OSError`` of a write is recorded in ``error`` and later writes are dropped, so the failure
    never unwinds through C++ (which ends the process with ``terminate``). Check ``error`` after."""

    def __init__(self, file):
        super().__init__()
        self._file, self.error = file, None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.error is None:
            try:
                self._file.write(data)
            except OSError as err:
                self.error = err
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        if self.error is None:
            try:
                self._file.flush()
            except OSError as err:
                self.error = err


def sha256_of(file, end: int | None = None) -> str:
    """sha256 (hex) of an open binary ``file`` from its start up to byte ``end`` (None: its end)."""
    digest = hashlib.sha256()
    file.seek(0)
    left = end
    while left is None or left > 0:
        block = file.read(_CHUNK if left is None else min(_CHUNK, left))
        if not block:
            break
        digest.update(block)
        if left is not None:
            left -= len(block)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 (hex) of the file at ``path``."""
    with open(path, "rb") as file:
        return sha256_of(file)


def _remove_stale_temps(folder: str, name: str) -> None:
    """Remove ``.<name>.<pid>-*.tmp`` files and folders in ``folder`` whose process is gone (killed mid-write)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            match = _TEMP.match(entry.name)
            if match and match["name"] == name and not pid_alive(int(match["pid"])):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def pid_alive(pid: int) -> bool:
    """A process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
