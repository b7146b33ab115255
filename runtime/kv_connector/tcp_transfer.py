"""KV blocks from one engine's pool to another's over TCP: the transport of prefill/decode
disaggregation on one machine (``P2pTcpConnector``, :mod:`pagedpack.runtime.kv_connector.p2p_tcp_connector`).

The producer (the engine that prefilled) runs a :class:`KVBlockServer`: it holds a copy of a finished
request's blocks (:func:`read_blocks`, on the thread that steps the engine, so the pool's blocks are free
again at once) until a consumer pulled them, the pull failed, or ``hold_timeout_s`` passed. The consumer
(the engine that decodes) calls :func:`pull_blocks`, which returns the blocks' bytes, checked, in a staging
tensor; :func:`write_blocks` copies them into its own blocks (on the thread that steps the engine). One
pull per held request: whatever its outcome, the producer lets the blocks go (a consumer whose pull
failed recomputes the tokens itself).

Wire format, both ways: a frame is the 4 bytes ``PPKV``, the header's length (uint32, big-endian), the
header (a msgpack map tagged by ``"type"``, decoded by ``msgspec`` into the structs below: a wrong type,
a missing or unknown field is refused naming it; never pickle) and, for ``kv_blocks`` only, its
``payload_bytes`` of raw block bytes. The consumer sends ``pull {request_id, first_block, num_blocks}``; the
producer answers ``kv_blocks`` (or ``error {message}``): the request's ``num_tokens``, the hash of each
of its blocks (:func:`request_block_hashes`: the consumer compares them with its own prompt's, so KV
never lands under other tokens), each cache's dtype and one block's shape, and per block sent the
sha256 of its bytes; the payload is the blocks ``first_block ..`` in order, each the bytes of its K
and V in every cache in the pool's order. The consumer answers ``ack {request_id, ok, error}``.

Every connect, read and write has a deadline (:class:`Deadlines`: ``timeout_s`` each, and the whole
transfer ``transfer_timeout_s``, on both sides: a peer that accepts and never answers, stops sending, or
sends a byte at a time, is dropped when one passes); a header is at most :data:`MAX_HEADER_BYTES`; a
payload must be exactly what the consumer expects. Errors are :class:`KVTransferError` naming the field,
what was expected and what came; a bad peer fails its own transfer only.
"""
from __future__ import annotations

import hashlib
import logging
import math
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Union

import msgspec
import torch

from pagedpack.runtime.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens

log = logging.getLogger("pagedpack.kv_transfer")

MAGIC = b"PPKV"
_PREFIX = struct.Struct(">4sI")  # magic, header length
MAX_HEADER_BYTES = 4 * 2**20  # a 100k-token prompt's hashes at block_size 16: ~0.4 MB
MAX_BLOCKS = 2**20
MAX_ID_CHARS = 512
_SHA256 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class KVTransferError(ConnectionError):
    """A transfer that failed: the peer went away, timed out, or sent something other than what was expected
    (the message names the field, what was expected and what came)."""


class Pull(msgspec.Struct, tag="pull", tag_field="type", forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    first_block: _Count
    num_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)]


class KVBlocks(msgspec.Struct, tag="kv_blocks", tag_field="type", forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    num_tokens: _Count
    first_block: _Count
    block_hashes: Annotated[list[_SHA256], msgspec.Meta(max_length=MAX_BLOCKS)]
    caches: Annotated[list[tuple[str, list[_Count]]], msgspec.Meta(max_length=4096)]
    block_sha256: Annotated[list[_SHA256], msgspec.Meta(max_length=MAX_BLOCKS)]
    payload_bytes: _Count


class Ack(msgspec.Struct, tag="ack", tag_field="type", forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=4096)] = ""


class Error(msgspec.Struct, tag="error", tag_field="type", forbid_unknown_fields=True):
    message: Annotated[str, msgspec.Meta(max_length=4096)]


_Frame = Union[Pull, KVBlocks, Ack, Error]
_decoder = msgspec.msgpack.Decoder(_Frame)
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class BlockLayout:
    """One KV block over all caches of a pool: per cache its dtype's name (``"float32"``) and the shape of
    one block (``[block_size, num_kv_heads, head_size]``), in the pool's order."""

    caches: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor]) -> "BlockLayout":
        """The layout of caches shaped ``[num_blocks, *block shape]``."""
        return cls(tuple((str(c.dtype).removeprefix("torch."), tuple(c.shape[1:])) for c in kv_caches))

    @property
    def cache_bytes(self) -> list[int]:
        """Bytes of one block in each cache."""
        return [math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
                for dtype, shape in self.caches]

    @property
    def block_bytes(self) -> int:
        return sum(self.cache_bytes)


def request_block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...]) -> list[bytes]:
    """One hash per block of ``token_ids``: the prefix cache's chain (:mod:`pagedpack.runtime.block_hash`,
    ``extra_keys`` its first block's) for the full blocks, then, for a partial last block, the same hash
    over its tokens."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, extra_keys)
    tail = token_ids[len(hashes) * block_size:]
    if tail:
        extra = extra_keys if not hashes else ()
        hashes.append(hash_block_tokens(hashes[-1] if hashes else ROOT_HASH, tail, extra))
    return hashes


@dataclass(frozen=True)
class Deadlines:
    """The time limits of one transfer: each connect, read and write within ``timeout_s`` seconds, and
    all of it by ``end`` (``time.monotonic()`` seconds)."""

    timeout_s: float
    end: float

    @classmethod
    def start(cls, timeout_s: float, transfer_timeout_s: float) -> "Deadlines":
        """The limits of a transfer starting now that may last ``transfer_timeout_s`` seconds."""
        return cls(timeout_s, time.monotonic() + transfer_timeout_s)

    def next(self) -> float:
        """The deadline (monotonic seconds) of the next connect, read or write."""
        return min(time.monotonic() + self.timeout_s, self.end)

    def left(self) -> float:
        """Seconds until :meth:`next`'s deadline (at least 1 ms: a socket timeout of 0 would not block)."""
        return max(1e-3, self.next() - time.monotonic())


@dataclass
class TransferStats:
    """Counters of one side's transfers (thread-safe :meth:`add`): requests, blocks and bytes moved, the
    seconds they took (from the pull's connection to the last byte checked), and transfers that failed."""

    requests: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, blocks: int = 0, nbytes: int = 0, seconds: float = 0.0, failed: bool = False) -> None:
        with self._lock:
            if failed:
                self.failures += 1
            else:
                self.requests += 1
                self.blocks += blocks
                self.bytes += nbytes
                self.seconds += seconds


@dataclass
class _Held:
    nbytes: int  # reserved by expect(), the staged data's size
    deadline: float
    data: torch.Tensor | None = None  # uint8 [num_blocks, block_bytes] once staged
    block_hashes: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    layout: BlockLayout | None = None
    pulling: bool = False


class KVBlockServer:
    """The producer's end: listens on ``host:port`` (0: a free port, :attr:`port`) in a thread of its own and
    answers each pull of a held request with its staged blocks. A request is first expected (:meth:`expect`:
    its bytes reserved, before its ``kv_transfer_params`` go out), then held (:meth:`hold`: its blocks' bytes,
    copied out of the pool; a pull arriving in between waits for them); it is let go after one pull, whatever
    its outcome, or ``hold_timeout_s`` after it was expected. ``max_held_bytes``: the most bytes expected and held
    at once; ``timeout_s`` / ``transfer_timeout_s``: each connection's :class:`Deadlines` (seconds per read and
    per write / for the whole pull); ``max_connections``: pulls served at once (a connection past them is
    closed). ``OSError`` if the address cannot be bound."""

    def __init__(self, host: str, port: int, *, hold_timeout_s: float = 120.0, timeout_s: float = 2.0,
                 transfer_timeout_s: float = 5.0, max_held_bytes: int = 2**30, max_connections: int = 16):
        self.hold_timeout_s, self.max_held_bytes = hold_timeout_s, max_held_bytes
        self.timeout_s, self.transfer_timeout_s = timeout_s, transfer_timeout_s
        self.stats = TransferStats()
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a hold staged, a request let go
        self._slots = threading.BoundedSemaphore(max_connections)
        self._server = socket.create_server((host, port), backlog=max_connections)
        self.port = self._server.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedpack-kv-server", daemon=True)
        self._thread.start()

    def expect(self, request_id: str, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``request_id``'s blocks; False (nothing reserved) past ``max_held_bytes``."""
        with self._lock:
            if sum(h.nbytes for h in self._held.values()) + nbytes > self.max_held_bytes:
                return False
            self._held[request_id] = _Held(nbytes, time.monotonic() + self.hold_timeout_s)
            return True

    def hold(self, request_id: str, data: torch.Tensor, block_hashes: list[bytes], num_tokens: int,
             layout: BlockLayout) -> None:
        """Stage the blocks of an expected ``request_id`` for its pull: ``data`` uint8 ``[num_blocks,
        layout.block_bytes]`` (:func:`read_blocks`), the K/V of its first ``num_tokens`` tokens, whose
        :func:`request_block_hashes` are ``block_hashes``. Nothing if it is no longer expected (let go)."""
        with self._lock:
            held = self._held.get(request_id)
            if held is not None:
                held.data, held.block_hashes, held.num_tokens = data, list(block_hashes), num_tokens
                held.layout = layout
                self._changed.notify_all()

    def drop(self, request_id: str) -> None:
        """Let ``request_id`` go (its blocks will not be staged)."""
        with self._lock:
            self._held.pop(request_id, None)
            self._changed.notify_all()

    @property
    def num_held(self) -> int:
        """Requests expected or held, not yet pulled."""
        with self._lock:
            return len(self._held)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    def close(self) -> None:
        """Stop listening and let every request go; pulls under way end at their next read or write."""
        self._stopped.set()
        self._server.close()
        self._thread.join(timeout=5)
        with self._lock:
            self._held.clear()
            self._changed.notify_all()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            while not self._stopped.is_set():
                self._expire()
                try:
                    ready = selector.select(0.25)
                    conn = self._server.accept()[0] if ready else None
                except OSError:  # closed
                    return
                if conn is None:
                    continue
                if not self._slots.acquire(blocking=False):
                    conn.close()
                    continue
                threading.Thread(target=self._answer, args=(conn,), name="pagedpack-kv-send", daemon=True).start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, h in self._held.items() if not h.pulling and h.deadline < now]:
                log.warning("request %r: no consumer pulled its KV blocks within %.0f s; letting them go",
                            request_id, self.hold_timeout_s)
                del self._held[request_id]

    def _answer(self, conn: socket.socket) -> None:
        request_id, start = None, time.monotonic()
        limits = Deadlines.start(self.timeout_s, self.transfer_timeout_s)
        try:
            with conn:
                pull = _recv_header(conn, limits.next(), Pull)
                held = self._take(pull.request_id, limits.next())
                if held is None:
                    _send(conn, Error(f"request_id: no held KV blocks for {pull.request_id!r} (never held, pulled "
                                      "already, or let go after the hold timeout)"), deadline=limits.next())
                    return
                request_id, total = pull.request_id, len(held.data)
                if pull.first_block + pull.num_blocks > total:
                    problem = (f"pull.num_blocks: blocks {pull.first_block} .. {pull.first_block + pull.num_blocks - 1}"
                               f" asked, the request has {total}")
                    _send(conn, Error(problem), deadline=limits.next())
                    raise KVTransferError(problem)
                data = held.data[pull.first_block:pull.first_block + pull.num_blocks]
                header = KVBlocks(request_id, held.num_tokens, pull.first_block, held.block_hashes,
                                  [(d, list(s)) for d, s in held.layout.caches],
                                  [hashlib.sha256(row).digest() for row in data.numpy()], data.numel())
                _send(conn, header, data.numpy(), deadline=limits.next())
                ack = _recv_header(conn, limits.next(), Ack)
                if not ack.ok:
                    raise KVTransferError(f"the consumer refused the blocks of {request_id!r}: {ack.error}")
                if len(data):  # a pull of no block only lets the copy go: not a transfer (the consumer counts none)
                    self.stats.add(blocks=len(data), nbytes=data.numel(), seconds=time.monotonic() - start)
        except (OSError, KVTransferError) as err:
            self.stats.add(failed=True)
            log.warning("KV pull%s failed: %s", f" of {request_id!r}" if request_id else "", err)
        finally:
            self._slots.release()
            if request_id is not None:
                self.drop(request_id)

    def _take(self, request_id: str, deadline: float) -> _Held | None:
        """``request_id``'s staged blocks, marked as being pulled (one pull each), waiting until ``deadline``
        for an expected request to be staged; None if none are (or will be) held for it."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held.pulling:
                return None
            held.pulling = True  # not expired while it waits
            while held.data is None and self._held.get(request_id) is held and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            if held.data is None or self._held.get(request_id) is not held:
                self._held.pop(request_id, None)
                return None
            return held


@dataclass(frozen=True)
class PulledBlocks:
    """What :func:`pull_blocks` got: ``data`` uint8 ``[num_blocks, layout.block_bytes]`` (blocks ``first_block ..``
    of the request, each checked against its sha256), ``seconds`` it took."""

    data: torch.Tensor
    seconds: float


def pull_blocks(host: str, port: int, request_id: str, *, layout: BlockLayout, block_hashes: list[bytes],
                num_tokens: int, first_block: int, num_blocks: int, timeout_s: float = 2.0,
                transfer_timeout_s: float = 5.0) -> PulledBlocks:
    """Pull the blocks ``first_block .. first_block + num_blocks - 1`` of ``request_id`` from the producer at
    ``host:port``: the request must hold ``num_tokens`` tokens whose :func:`request_block_hashes` are
    ``block_hashes``, in caches of ``layout``. The connect and each read and write take at most ``timeout_s``
    seconds, the whole pull ``transfer_timeout_s`` (:class:`Deadlines`). ``KVTransferError`` naming what
    differed or which deadline passed (the producer is told, and lets the blocks go either way)."""
    start = time.monotonic()
    limits = Deadlines.start(timeout_s, transfer_timeout_s)
    try:
        conn = socket.create_connection((host, port), timeout=limits.left())
    except OSError as err:
        raise KVTransferError(f"cannot reach the KV producer at {host}:{port}: {err}") from err
    try:
        with conn:
            data = _pull(conn, f"{host}:{port}", request_id, layout=layout, block_hashes=block_hashes,
                         num_tokens=num_tokens, first_block=first_block, num_blocks=num_blocks, limits=limits)
    except KVTransferError:
        raise
    except OSError as err:  # reset, broken pipe
        raise KVTransferError(f"the connection to the KV producer at {host}:{port} failed: {err}") from err
    return PulledBlocks(data, time.monotonic() - start)


def _pull(conn: socket.socket, peer: str, request_id: str, *, layout: BlockLayout, block_hashes: list[bytes],
          num_tokens: int, first_block: int, num_blocks: int, limits: Deadlines) -> torch.Tensor:
    def refuse(error: str):
        _send(conn, Ack(request_id, False, error[:4096]), deadline=limits.next())
        raise KVTransferError(error)

    _send(conn, Pull(request_id, first_block, num_blocks), deadline=limits.next())
    header = _recv_header(conn, limits.next(), KVBlocks, Error)
    if isinstance(header, Error):
        raise KVTransferError(f"the KV producer at {peer}: {header.message}")
    try:
        _check_blocks(header, request_id=request_id, layout=layout, block_hashes=block_hashes,
                      num_tokens=num_tokens, first_block=first_block, num_blocks=num_blocks)
    except KVTransferError as err:
        refuse(str(err))
    data = torch.empty((num_blocks, layout.block_bytes), dtype=torch.uint8)
    if data.numel():  # (a memoryview of no bytes cannot be cast)
        _recv_into(conn, memoryview(data.numpy()).cast("B"), limits.next())
    for i, (row, digest) in enumerate(zip(data.numpy(), header.block_sha256)):
        if hashlib.sha256(row).digest() != digest:
            refuse(f"kv_blocks.block_sha256[{i}]: the bytes of block {first_block + i} do not match their sha256")
    _send(conn, Ack(request_id, True), deadline=limits.next())
    return data


def _check_blocks(header: KVBlocks, *, request_id: str, layout: BlockLayout, block_hashes: list[bytes],
                  num_tokens: int, first_block: int, num_blocks: int) -> None:
    """``KVTransferError`` naming the first field of ``header`` that is not what this consumer expects."""
    expected = {"request_id": request_id, "num_tokens": num_tokens, "first_block": first_block,
                "caches": [(d, list(s)) for d, s in layout.caches]}
    for name, value in expected.items():
        got = getattr(header, name)
        if got != value:
            raise KVTransferError(f"kv_blocks.{name}: expected {_brief(value)}, got {_brief(got)}")
    if header.block_hashes != block_hashes:
        first = next((i for i, (a, b) in enumerate(zip(header.block_hashes, block_hashes)) if a != b),
                     min(len(header.block_hashes), len(block_hashes)))
        raise KVTransferError(f"kv_blocks.block_hashes: the producer's request holds other tokens than this "
                              f"one's from block {first} on ({len(header.block_hashes)} blocks, expected "
                              f"{len(block_hashes)})")
    if len(header.block_sha256) != num_blocks:
        raise KVTransferError(f"kv_blocks.block_sha256: expected {num_blocks} digests, got {len(header.block_sha256)}")
    if header.payload_bytes != num_blocks * layout.block_bytes:
        raise KVTransferError(f"kv_blocks.payload_bytes: expected {num_blocks * layout.block_bytes} "
                              f"({num_blocks} blocks of {layout.block_bytes} bytes), got {header.payload_bytes}")


def write_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Copy ``data`` (uint8 ``[len(block_ids), block_bytes]``, as :func:`pull_blocks` returns it) into the
    blocks ``block_ids`` of ``kv_caches`` (whose :class:`BlockLayout` it has)."""
    ids, offset = torch.tensor(list(block_ids), dtype=torch.long), 0
    for cache, size in zip(kv_caches, BlockLayout.of(kv_caches).cache_bytes):
        if not size:
            continue
        part = data[:, offset:offset + size].contiguous().view(cache.dtype).view(len(ids), *cache.shape[1:])
        cache.index_copy_(0, ids, part)
        offset += size


def read_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """uint8 ``[len(block_ids), block_bytes]``: a copy of each block's bytes in every cache, in order (the
    :class:`BlockLayout` of ``kv_caches``)."""
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    sizes = BlockLayout.of(kv_caches).cache_bytes
    parts = [c.index_select(0, ids).contiguous().view(torch.uint8).reshape(len(ids), size)
             for c, size in zip(kv_caches, sizes) if size]
    return torch.cat(parts, dim=1) if parts else torch.empty((len(ids), 0), dtype=torch.uint8)


def _send(conn: socket.socket, header: msgspec.Struct, payload=None, *, deadline: float) -> None:
    encoded = _encoder.encode(header)
    conn.settimeout(max(1e-3, deadline - time.monotonic()))
    try:
        conn.sendall(_PREFIX.pack(MAGIC, len(encoded)) + encoded)
        if payload is not None and payload.size:
            conn.sendall(memoryview(payload).cast("B"))
    except TimeoutError as err:
        raise KVTransferError("sending to the peer timed out (it stopped reading)") from err


def _recv_header(conn: socket.socket, deadline: float, *expected: type) -> msgspec.Struct:
    """The next frame's header, one of the ``expected`` structs."""
    prefix = bytearray(_PREFIX.size)
    _recv_into(conn, memoryview(prefix), deadline)
    magic, length = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise KVTransferError(f"frame: expected the magic {MAGIC!r}, got {bytes(magic)!r} (not a pagedpack KV peer)")
    if length > MAX_HEADER_BYTES:
        raise KVTransferError(f"frame.header_bytes: expected at most {MAX_HEADER_BYTES}, got {length}")
    body = bytearray(length)
    _recv_into(conn, memoryview(body), deadline)
    try:
        header = _decoder.decode(body)
    except msgspec.DecodeError as err:  # ValidationError included: it names the field ("at `$.num_tokens`")
        raise KVTransferError(f"frame.header: {err}") from None
    if not isinstance(header, expected):
        names = " or ".join(repr(t.__struct_config__.tag) for t in expected)
        raise KVTransferError(f"frame.header.type: expected {names}, got {header.__struct_config__.tag!r}")
    return header


def _recv_into(conn: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``conn`` by ``deadline`` (monotonic seconds); ``KVTransferError`` if the peer closes
    or the deadline passes first."""
    got, size = 0, len(view)
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTransferError(f"the peer sent {got} of {size} bytes before the deadline")
        conn.settimeout(left)
        try:
            n = conn.recv_into(view[got:], min(size - got, 1 << 22))
        except TimeoutError:
            raise KVTransferError(f"the peer sent {got} of {size} bytes before the deadline") from None
        if not n:
            raise KVTransferError(f"the peer closed the connection after {got} of {size} bytes")
        got += n


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
