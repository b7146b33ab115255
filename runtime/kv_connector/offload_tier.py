"""The second KV tier of the ``OffloadingConnector``: whole KV blocks by their content hash, LRU-bounded.

A block's *payload* is the bytes of its K and V in every cache of the pool, cache by cache in
:attr:`ModelRunner.kv_caches` order (``uint8 [block_bytes]``); its key is pagedpack's block hash (the
salted sha256 chain of :mod:`pagedpack.runtime.block_hash`), which names the tokens it holds.

Two media (vLLM's names in the KV events' ``medium``):

* :class:`HostTier` (``"CPU"``): a preallocated ``uint8 [num_slots, block_bytes]`` host tensor (on the CPU
  target its pages become resident as slots are first written, as the pool's do).
* :class:`DiskTier` (``"DISK"``): one file per block in a folder, named ``<hash hex>.kvblock`` (from the
  hash only), written by a background thread to a temporary file, ``fsync``-ed and renamed into place
  (``os.replace``: a reader sees a whole file or none). A file is a header and the payload::

      magic b"PPKV" | version u32 | block hash 32 B | payload length u64 | sha256(payload) 32 B
      | layout length u32 | layout (UTF-8: "dtype:shape" of each cache's block, ";"-joined) | payload

  (little-endian). A file whose header, layout, length or checksum does not match is a *miss* (counted
  in ``corrupt``; the block is recomputed): never an error, never a wrong block. Nothing is unpickled.
  A folder is reused across processes of one model, one live process at a time (its lock:
  :mod:`pagedpack.runtime.kv_connector.tier_folder`): ``tier.json`` names the model whose blocks it holds
  (``{"format": 1, "model": <fingerprint>}``); a process of another model, or of one without a
  fingerprint, removes the blocks first (a block's hash names tokens, not weights). Its ``*.kvblock``
  files are indexed at start (oldest first in the LRU), leftover temporary files (a process killed
  mid-write) removed; a write that fails (a full disk) leaves none.

Both are bounded by ``capacity`` bytes (a disk block costs its file's size) and evict least recently
used blocks first; :meth:`OffloadTier.take_events` gives ``BlockStored`` / ``BlockRemoved`` with their
medium. Thread-safe (the stepping thread, the scheduler, the disk writer).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pagedpack.runtime.kv_connector.tier_folder import (
    TEMP_PREFIX,
    lock_folder,
    read_regular_file,
    remove_file,
    write_atomically,
)
from pagedpack.runtime.kv_events import BlockRemoved, BlockStored

MEDIUM_CPU, MEDIUM_DISK = "CPU", "DISK"
MAGIC, VERSION = b"PPKV", 1
HEADER = struct.Struct("<4sI32sQ32sI")
FILE_NAME = re.compile(r"^([0-9a-f]{64})\.kvblock$")
MAX_LAYOUT_BYTES = 1 << 16
MANIFEST, MAX_MANIFEST_BYTES = "tier.json", 4096


@dataclass
class OffloadStats:
    """Counters of a tier: blocks ``saves`` (stored), ``loads`` (read back into the pool), ``misses`` (a
    block the tier was asked for and could not give: gone, or ``corrupt``), seconds spent in saves and
    loads, and ``bytes_used`` now."""

    saves: int = 0
    loads: int = 0
    misses: int = 0
    corrupt: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    bytes_used: int = 0


def block_layout(caches: list[torch.Tensor]) -> str:
    """The layout of one block's payload: ``"dtype:d1xd2x..."`` of each cache's block, ``;``-joined."""
    return ";".join(f"{str(c.dtype).removeprefix('torch.')}:{'x'.join(map(str, c.shape[1:]))}" for c in caches)


def gather_blocks(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The payloads of ``block_ids``: ``uint8 [len(block_ids), block_bytes]`` in host memory (a copy; from a
    device pool, one device-to-host copy per cache)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    return torch.cat([c.index_select(0, index.to(c.device)).reshape(len(block_ids), -1).view(torch.uint8).cpu()
                      for c in caches if c.numel()], dim=1)


def scatter_block(caches: list[torch.Tensor], block_id: int, payload: torch.Tensor) -> None:
    """Write one block's ``payload`` (host ``uint8 [block_bytes]``) into ``block_id`` of every cache."""
    offset = 0
    for c in caches:
        if not c.numel():
            continue
        nbytes = c[0].numel() * c.element_size()
        c[block_id] = payload[offset:offset + nbytes].view(c.dtype).view(c.shape[1:]).to(c.device)
        offset += nbytes


class OffloadTier:
    """What both tiers share: the LRU index, the capacity, the counters, the events."""

    medium = ""

    def __init__(self, capacity: int, *, block_size: int = 0) -> None:
        self.capacity, self.block_size = capacity, block_size  # block_size: tokens, for the events
        self.stats = OffloadStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes it costs; front = evicted first
        self._events: list = []
        self.block_bytes = 0
        self.layout = ""

    def bind_layout(self, caches: list[torch.Tensor]) -> None:
        """The pool's caches fix the payload's size and layout (at the worker's register_kv_caches)."""
        self.layout = block_layout(caches)
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in caches if c.numel())

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def take_events(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _stored(self, block_hash: bytes, cost: int) -> list[bytes]:
        """Index ``block_hash`` (most recently used), evicting LRU blocks to fit; returns the evicted."""
        evicted = []
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return evicted
            while self._index and self.stats.bytes_used + cost > self.capacity:
                old, old_cost = self._index.popitem(last=False)
                self.stats.bytes_used -= old_cost
                evicted.append(old)
            self._index[block_hash] = cost
            self.stats.bytes_used += cost
            self.stats.saves += 1
            self._events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[],
                                            block_size=self.block_size, lora_id=None, medium=self.medium,
                                            lora_name=None))
            if evicted:
                self._events.append(BlockRemoved(block_hashes=evicted, medium=self.medium))
        return evicted

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            cost = self._index.pop(block_hash, None)
            if cost is not None:
                self.stats.bytes_used -= cost
                self._events.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium))

    def _touch(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash not in self._index:
                return False
            self._index.move_to_end(block_hash)
            return True


class HostTier(OffloadTier):
    """Blocks in a host tensor of ``capacity // block_bytes`` slots (module docstring)."""

    medium = MEDIUM_CPU

    def __init__(self, capacity: int, *, block_size: int = 0) -> None:
        super().__init__(capacity, block_size=block_size)
        self._slots: dict[bytes, int] = {}
        self._free: list[int] = []
        self._pool: torch.Tensor | None = None

    def bind_layout(self, caches: list[torch.Tensor]) -> None:
        super().bind_layout(caches)
        num_slots = self.capacity // self.block_bytes
        self._pool = torch.from_numpy(np.zeros((num_slots, self.block_bytes), dtype=np.uint8))  # calloc: lazy pages
        self._free = list(range(num_slots - 1, -1, -1))

    def put(self, block_hashes: list[bytes], payloads: torch.Tensor) -> None:
        """Store ``payloads[i]`` under ``block_hashes[i]`` (a block already held is only touched)."""
        start = time.perf_counter()
        for block_hash, payload in zip(block_hashes, payloads):
            if self._touch(block_hash) or self._pool is None or not len(self._pool):
                continue
            for old in self._stored(block_hash, self.block_bytes):
                self._free.append(self._slots.pop(old))
            slot = self._free.pop()
            self._slots[block_hash] = slot
            self._pool[slot].copy_(payload)
        self.stats.save_seconds += time.perf_counter() - start

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The payload of ``block_hash`` (a view of its slot, valid until the next put), or None (a miss)."""
        slot = self._slots.get(block_hash) if self._touch(block_hash) else None
        if slot is None:
            self.stats.misses += 1
            return None
        self.stats.loads += 1
        return self._pool[slot]

    def close(self) -> None:
        pass


class DiskTier(OffloadTier):
    """Blocks in files of ``directory`` (module docstring); writes on a background thread."""

    medium = MEDIUM_DISK

    def __init__(self, capacity: int, directory: str, *, block_size: int = 0, model: str | None = None) -> None:
        """``model``: the fingerprint of the model whose blocks these are (None: unknown, nothing
        kept from an earlier process). :class:`~pagedpack.runtime.kv_connector.tier_folder.FolderInUse`
        (a ``ValueError`` naming the holder) if another live tier holds the folder; ``OSError`` if the
        folder cannot be made, locked or named."""
        super().__init__(capacity, block_size=block_size)
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._lock_fd: int | None = lock_folder(directory, model)  # before anything there is read or removed
        try:
            self._claim(model)
            self._scan()
        except BaseException:
            self._unlock()
            raise
        self._pending: dict[bytes, torch.Tensor] = {}  # queued for the writer, readable meanwhile
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pagedpack-kv-offload", daemon=True)
        self._writer.start()

    @staticmethod
    def _name(block_hash: bytes) -> str:
        return block_hash.hex() + ".kvblock"

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, self._name(block_hash))

    def _claim(self, model: str | None) -> None:
        """Remove the folder's blocks unless its manifest names ``model``; then name it."""
        manifest = {"format": VERSION, "model": model}
        held = read_regular_file(os.path.join(self.directory, MANIFEST), MAX_MANIFEST_BYTES)
        try:
            held = None if held is None else json.loads(held)
        except ValueError:
            held = None
        if model is None or held != manifest:
            for entry in os.scandir(self.directory):
                if FILE_NAME.match(entry.name):
                    remove_file(entry.path)
            write_atomically(self.directory, MANIFEST, json.dumps(manifest).encode(), tag="manifest")

    def _scan(self) -> None:
        """Index the folder's block files, oldest first; remove temporary files a killed writer left."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith(TEMP_PREFIX) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                continue
            match = FILE_NAME.match(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                found.append((info.st_mtime, bytes.fromhex(match.group(1)), info.st_size))
        for _, block_hash, size in sorted(found):
            for old in self._stored(block_hash, size):
                self._unlink(old)
        self.take_events()  # what was already there is not news
        self.stats.saves = 0

    def put(self, block_hashes: list[bytes], payloads: torch.Tensor) -> None:
        """Queue ``payloads[i]`` (a copy the caller gives up) for writing under ``block_hashes[i]``;
        it counts as held (and is read from memory) until written."""
        for block_hash, payload in zip(block_hashes, payloads):
            with self._lock:
                if block_hash in self._pending or block_hash in self._index:
                    continue
                self._pending[block_hash] = payload
            self._queue.put(block_hash)

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            if block_hash is None:
                return
            with self._lock:
                payload = self._pending.get(block_hash)
            start = time.perf_counter()
            try:
                size = self._write(block_hash, payload)
            except OSError:  # a full disk, a removed folder: the block is simply not kept
                size = None
            with self._lock:
                self._pending.pop(block_hash, None)
            if size is not None:
                for old in self._stored(block_hash, size):
                    self._unlink(old)
            self.stats.save_seconds += time.perf_counter() - start

    def _write(self, block_hash: bytes, payload: torch.Tensor) -> int:
        """Write the block's file (its bytes: the return value); ``OSError``, leaving no file, if it fails."""
        data = payload.numpy().tobytes()
        layout = self.layout.encode()
        header = HEADER.pack(MAGIC, VERSION, block_hash, len(data), hashlib.sha256(data).digest(), len(layout))
        write_atomically(self.directory, self._name(block_hash), header + layout + data, tag=block_hash.hex())
        return len(header) + len(layout) + len(data)

    def _unlink(self, block_hash: bytes) -> None:
        remove_file(self._path(block_hash))

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The payload of ``block_hash`` read and checked (module docstring), or None: a miss (counted;
        a corrupt file is also removed)."""
        with self._lock:
            pending = self._pending.get(block_hash)
        payload = pending if pending is not None else self._read(block_hash)
        if payload is None:
            self.stats.misses += 1
            return None
        self._touch(block_hash)
        self.stats.loads += 1
        return payload

    def _read(self, block_hash: bytes) -> torch.Tensor | None:
        try:  # a regular file only: a symlink, a directory or a FIFO put in its place is a miss, never a hang
            fd = os.open(self._path(block_hash), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return self._corrupt(block_hash)
                head = f.read(HEADER.size)
                if len(head) != HEADER.size:
                    return self._corrupt(block_hash)
                magic, version, stored_hash, length, checksum, layout_len = HEADER.unpack(head)
                if (magic, version, stored_hash) != (MAGIC, VERSION, block_hash) or layout_len > MAX_LAYOUT_BYTES \
                        or length != self.block_bytes:
                    return self._corrupt(block_hash)
                if f.read(layout_len) != self.layout.encode():
                    return self._corrupt(block_hash)
                data = f.read(length + 1)
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except OSError:
            return self._corrupt(block_hash)
        if len(data) != length or hashlib.sha256(data).digest() != checksum:
            return self._corrupt(block_hash)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _corrupt(self, block_hash: bytes) -> None:
        self.stats.corrupt += 1
        self._forget(block_hash)
        self._unlink(block_hash)
        return None

    def flush(self) -> None:
        """Wait until every queued block is written (tests; shutdown)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.001)

    def close(self) -> None:
        """Finish the queued writes, stop the writer and let the folder go (its lock)."""
        self._queue.put(None)
        self._writer.join()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
