"""The disk tier's folder (:class:`pagedpack.runtime.kv_connector.offload_tier.DiskTier`): one live tier
per folder, and files written whole or not at all.

* **One owner.** A tier takes an exclusive advisory lock on the folder's ``tier.lock``
  (``fcntl.flock``, :func:`lock_folder`) before it reads, cleans or writes anything there, and holds it
  for its life: a second process (or a second tier of this one) refuses the folder naming the holder,
  whose pid and model the file names. The kernel lets the lock go when its holder ends, however it ends
  (killed included), so a lock a dead process left never blocks. :func:`folder_holder` asks without
  keeping the lock (the check before the model is loaded).
* **Whole files.** :func:`write_atomically` writes through a temporary ``.tmp-*`` file of its own
  (``mkstemp``: ``O_EXCL``, never a name planted in advance), ``fsync``-ed and renamed into place
  (``os.replace``: a reader sees a whole file or none); on any failure (a full disk: ``ENOSPC``) the
  temporary file is removed before the error goes on. A process killed mid-write leaves one, removed by
  the next tier that locks the folder.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import tempfile

LOCK_FILE, MAX_LOCK_BYTES = "tier.lock", 4096
TEMP_PREFIX = ".tmp-"


class FolderInUse(ValueError):
    """Another live tier holds the folder's lock (the message names the folder and the holder)."""


def lock_folder(directory: str, model: str | None) -> int:
    """Take ``directory``'s lock for this process's tier of ``model`` (a fingerprint, or None) and name
    them in ``tier.lock``; returns the descriptor that holds it until closed. :class:`FolderInUse` if
    another tier holds it; ``OSError`` if ``tier.lock`` cannot be opened or is not a regular file."""
    fd = os.open(os.path.join(directory, LOCK_FILE),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{LOCK_FILE} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "model": model}).encode(), 0)
    except BlockingIOError:
        os.close(fd)
        raise FolderInUse(f"kv_offload_dir: expected a folder no other live process uses, got {directory!r}, "
                          f"{_held_by(directory)}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def folder_holder(directory: str) -> str | None:
    """Why ``directory`` cannot be locked now (``"which process 1234 (model ...) holds"``), or None if it
    can (no folder, no lock file, or a lock nobody holds); the lock is taken and let go at once."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"whose {LOCK_FILE} cannot be opened ({err.strerror})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _held_by(directory)
    finally:
        os.close(fd)  # lets the lock go if it was taken
    return None


def _held_by(directory: str) -> str:
    """The holder ``tier.lock`` names (written by whoever holds it: untrusted, shown bounded)."""
    text = read_regular_file(os.path.join(directory, LOCK_FILE), MAX_LOCK_BYTES)
    try:
        holder = json.loads(text) if text else None
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return f"whose {LOCK_FILE} another tier holds"
    return f"which process {holder.get('pid')!r:.20} (model {holder.get('model')!r:.80}) holds ({LOCK_FILE})"


def write_atomically(directory: str, name: str, data: bytes, *, tag: str) -> None:
    """Write ``data`` as ``directory/name`` (module docstring); the temporary file is named
    ``.tmp-<tag>-<random>``. ``OSError`` as the write raised it, the temporary file removed."""
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{tag}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        remove_file(tmp)
        raise


def remove_file(path: str) -> None:
    """Remove a file of the folder; whatever is there (gone, a directory, no permission) is left."""
    try:
        os.unlink(path)
    except OSError:
        pass


def read_regular_file(path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` if it is a regular file (not a symlink, a directory or a FIFO,
    which would block), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None
