"""The command channel between rank 0 and a tensor-parallel worker rank: one TCP connection per
worker, the same for worker processes and Ray actors (a pipe does not reach an actor).

Rank 0 listens (:class:`RankListener`); a worker connects and sends a hello of
:data:`TOKEN_BYTES` random bytes rank 0 made for this engine (it reaches the worker in its
environment or its actor's arguments, never on the wire first) and its rank as a little-endian
int64. Rank 0 closes a connection whose hello is wrong. Then every message is a frame: its length
(little-endian uint64) and its bytes. Rank 0 sends the worker's configuration (one JSON frame) and
then commands (int64 bytes); the worker sends :data:`READY` once its program is built and nothing
else except, when it fails, its error text (UTF-8). Nothing is pickled; a frame longer than the
reader's limit is refused.
"""
from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import struct
import time

TOKEN_BYTES = 32
TOKEN_ENV = "PAGEDPACK_TP_TOKEN"  # a worker process's token, hex
START, STEP, COPY, COMMIT, STOP = range(5)  # the commands: a message's first int64
READY = b"ready"  # a worker's frame once its program is built
_HELLO = struct.Struct("<q")
_LENGTH = struct.Struct("<Q")
HELLO_TIMEOUT_S = 5.0  # a connection that does not say who it is within this is closed
MAX_PENDING = 64  # connections whose hello is still coming
_HELLO_BYTES = TOKEN_BYTES + _HELLO.size


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int) -> bytes | None:
    """The next frame's bytes; None when the peer closed the connection between frames.
    ``ConnectionError`` for a frame over ``limit`` bytes or one cut off."""
    head = _recv_exactly(sock, _LENGTH.size, eof_ok=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise ConnectionError(f"a frame of {length} bytes, expected at most {limit}")
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int, eof_ok: bool = False) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            if eof_ok and not got:
                return None
            raise ConnectionError(f"the connection closed after {got} of {size} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def connect(address: str, port: int, token: bytes, rank: int, timeout_s: float) -> socket.socket:
    """A worker's connection to rank 0, hello sent (blocking from then on)."""
    sock = socket.create_connection((address, port), timeout=timeout_s)
    sock.settimeout(None)
    sock.sendall(token + _HELLO.pack(rank))
    return sock


class RankListener:
    """Rank 0's end: a listening socket on ``host`` (a free port, :attr:`port`) that takes one
    connection per worker rank 1 .. ``world_size - 1`` presenting :attr:`token`."""

    def __init__(self, host: str, world_size: int):
        self.token, self.world_size = new_token(), world_size
        self._server = socket.create_server((host, 0), backlog=MAX_PENDING)  # strangers leave the workers room
        self.port = self._server.getsockname()[1]

    def accept_all(self, deadline_s: float, gone) -> dict[int, socket.socket]:
        """Each worker rank's connection by rank, once all have said hello. ``gone()``: polled
        meanwhile, a truthy description of a worker that ended (``RuntimeError`` with it);
        ``TimeoutError`` after ``deadline_s`` seconds. Hellos are read side by side, each within
        :data:`HELLO_TIMEOUT_S` (at most :data:`MAX_PENDING` at once, the oldest closed first): a
        connection that sends nothing, or a byte at a time, delays no other."""
        conns: dict[int, socket.socket] = {}
        pending: dict[socket.socket, tuple[bytes, float]] = {}  # hello bytes so far, its deadline
        deadline = time.monotonic() + deadline_s
        self._server.setblocking(False)
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._server, selectors.EVENT_READ)
                while len(conns) < self.world_size - 1:
                    ended = gone()
                    if ended:
                        raise RuntimeError(ended)
                    now = time.monotonic()
                    if now > deadline:
                        raise TimeoutError(f"the workers did not connect within {deadline_s:.0f} s")
                    for conn in [c for c, (_, until) in pending.items() if now > until]:
                        _drop(selector, pending, conn)
                    for key, _ in selector.select(0.2):
                        if key.fileobj is self._server:
                            self._accept(selector, pending, now)
                        elif key.fileobj in pending and (rank := self._hello(selector, pending, key.fileobj,
                                                                             conns)) is not None:
                            conns[rank] = key.fileobj
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        finally:
            for conn in pending:
                conn.close()
            self.close()
        for conn in conns.values():
            conn.setblocking(True)
        return conns

    def close(self) -> None:
        """Stop listening (once every worker connected, or when starting them failed)."""
        self._server.close()

    def _accept(self, selector, pending: dict, now: float) -> None:
        try:
            conn, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(pending) >= MAX_PENDING:
            _drop(selector, pending, next(iter(pending)))
        conn.setblocking(False)
        pending[conn] = (b"", now + HELLO_TIMEOUT_S)
        selector.register(conn, selectors.EVENT_READ)

    def _hello(self, selector, pending: dict, conn: socket.socket, taken: dict) -> int | None:
        """The rank a connection's hello names once it is whole and right (the connection leaves
        ``pending``), else None. A wrong token, a rank out of range or ``taken``, or an early close
        closes it."""
        got, until = pending[conn]
        try:
            chunk = conn.recv(_HELLO_BYTES - len(got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        got += chunk
        if chunk and len(got) < _HELLO_BYTES:
            pending[conn] = (got, until)
            return None
        _drop(selector, pending, conn, close=False)
        rank = _HELLO.unpack(got[TOKEN_BYTES:])[0] if len(got) == _HELLO_BYTES else None
        if rank is None or not hmac.compare_digest(got[:TOKEN_BYTES], self.token) or not 0 < rank < self.world_size \
                or rank in taken:
            conn.close()
            return None
        return rank


def _drop(selector, pending: dict, conn: socket.socket, close: bool = True) -> None:
    selector.unregister(conn)
    del pending[conn]
    if close:
        conn.close()
