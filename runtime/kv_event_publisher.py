"""Publishing KV cache events over ZeroMQ, as vLLM's ``ZmqEventPublisher`` does.

``--kv-events-config`` / ``EngineArgs.kv_events_config`` is vLLM's ``KVEventsConfig``
(``vllm/config/kv_events.py``: the same field names, defaults and meaning). With
``enable_kv_cache_events`` and publisher ``"zmq"`` (its default then) the engine hands one
:class:`~pagedpack.runtime.kv_events.KVEventBatch` per step that changed the prefix cache to a
:class:`ZmqEventPublisher`:

- a PUB socket on ``endpoint`` sends each batch as the multipart message ``(topic, seq, payload)``:
  ``topic`` UTF-8, ``seq`` an 8-byte big-endian unsigned sequence number from 0, ``payload`` the
  batch in msgpack. As in vLLM the socket binds when the endpoint has a wildcard (``*``, ``::``) or
  is ``ipc://`` / ``inproc://``, and connects to it otherwise; ``hwm`` is its high-water mark;
- a ROUTER socket on ``replay_endpoint`` (if given; it binds) answers a request (a DEALER's
  ``["", start_seq]``, or a REQ's ``[start_seq]``; 8 bytes big-endian) with each buffered
  ``["", seq, payload]`` from ``start_seq`` on, then the end marker ``["", -1 (8 bytes, signed),
  ""]``; the last ``buffer_steps`` batches are buffered. Replays go side by side with the live
  batches, a chunk at a time (:data:`MAX_REPLAYS` at once, :data:`REPLAY_CHUNK` batches per round):
  a flood of requests slows the replays, not the live events. A request frame over
  :data:`REPLAY_FRAME_LIMIT` bytes disconnects its peer.

A background thread owns the sockets, so a step never waits on them. Unlike vLLM's publisher,
whose ``publish`` blocks while its queue is full, a batch that finds the queue full
(``max_queue_size`` batches) is dropped and counted (:attr:`ZmqEventPublisher.num_dropped_batches`,
``kv_events_dropped_batches_total`` in ``/metrics``): a slow subscriber never stalls a step. Its
sequence number is taken all the same, so subscribers see the gap, and a replay cannot fill it:
their copy of the cache is stale until they rebuild it (e.g. after an ``AllBlocksCleared``).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import socket
import stat
import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

import msgspec

from pagedpack.inputs import parse_config
from pagedpack.runtime.kv_events import EventBatch

log = logging.getLogger("pagedpack.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's)
ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
MAX_REPLAYS = 8  # replays in progress at once
REPLAY_CHUNK = 64  # buffered batches each replay sends per round of the publisher thread
REPLAY_FRAME_LIMIT = 64  # bytes of a replay request's frame (8 are used): a peer sending more is disconnected
MAX_SIZE = 2**31 - 1  # ZeroMQ's high-water mark is a C int; a deque's length a ssize_t


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: ``enable_kv_cache_events`` (False), ``publisher`` (``"null"`` or
    ``"zmq"``; default ``"zmq"`` when events are on, else ``"null"``), ``endpoint``
    (``"tcp://*:5557"``), ``replay_endpoint`` (None: no replay), ``buffer_steps`` (batches kept for
    replay, 10,000), ``hwm`` (the PUB socket's high-water mark, 100,000), ``max_queue_size``
    (batches waiting for the publisher thread, 100,000; at least 1: pagedpack's queue is bounded)
    and ``topic`` (``""``). ``ValueError`` naming ``kv_events_config.<field>`` for a field unknown
    or of the wrong type, or a size past :data:`MAX_SIZE`."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        checks = {"enable_kv_cache_events": (bool, "a bool"), "endpoint": (str, "a string"),
                  "replay_endpoint": ((str, type(None)), "a string or null"), "topic": (str, "a string")}
        for name, (kind, expected) in checks.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(f"kv_events_config.{name}: expected {expected}, got {value!r:.80}")
        for name, low in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE:
                raise ValueError(f"kv_events_config.{name}: expected an int from {low} to {MAX_SIZE}, "
                                 f"got {value!r:.80}")
        for name in ("endpoint", "replay_endpoint", "topic"):  # sent as UTF-8
            try:
                (getattr(self, name) or "").encode()
            except UnicodeEncodeError:
                raise ValueError(f"kv_events_config.{name}: expected text UTF-8 can encode (no lone surrogates), "
                                 f"got {getattr(self, name)!r:.80}") from None
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(ZMQ_TRANSPORTS):
                raise ValueError(f"kv_events_config.{name}: expected a ZeroMQ address starting with "
                                 f"{' or '.join(ZMQ_TRANSPORTS)}, got {value!r:.80}")
            port = value.rpartition(":")[2] if value is not None and value.startswith("tcp://") else "*"
            if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):  # ZeroMQ wraps it
                raise ValueError(f"kv_events_config.{name}: expected a port from 0 to 65535 or * after the last "
                                 f"':', got {value!r:.80}")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher: expected 'null' or 'zmq', got {self.publisher!r:.80}")

    @classmethod
    def parse(cls, value) -> "KVEventsConfig | None":
        """A config from JSON text (the command line's), a dict, or a config; None passes."""
        return parse_config(cls, value, "kv_events_config")


class NullEventPublisher:
    """Publishes nothing (events off, or publisher ``"null"``)."""

    num_dropped_batches = 0

    def publish(self, batch: EventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """PUB + replay ROUTER sockets, served by a background thread (the module docstring); counts
    :attr:`num_dropped_batches` and :attr:`num_malformed_requests` (replay requests ignored).
    ``RuntimeError`` from :meth:`publish` once shut down; ``ValueError`` naming the field at
    construction for an endpoint that cannot be bound or connected (a port in use; an ``ipc://`` path
    in use or not a socket: :func:`_bind`)."""

    SHUTDOWN_TIMEOUT_S = 1.0
    POLL_S = 0.1

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.data_parallel_rank = data_parallel_rank
        self.num_dropped_batches = self.num_malformed_requests = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._replays: list[list] = []  # [identity, the batches it asked for, how many were sent] of each replay
        # a context of its own: terminating it waits until its sockets are closed, so their endpoints are free
        self._context = context = zmq.Context()
        self._pub = context.socket(zmq.PUB)
        self._replay = None
        field = "endpoint"
        try:
            self._pub.set_hwm(config.hwm)
            endpoint = config.endpoint
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                _bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                field = "replay_endpoint"
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_FRAME_LIMIT)
                _bind(self._replay, config.replay_endpoint)
        except (zmq.ZMQError, OSError) as err:  # OSError: _bind's check
            self._close_sockets()
            raise ValueError(f"kv_events_config.{field}: expected an address this process can use, got "
                             f"{getattr(config, field)!r} ({err})") from err
        self._running = True
        # the sockets are used by this thread alone from here on (a thread start is a full memory barrier)
        self._thread = threading.Thread(target=self._serve, name="pagedpack-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` (stamped with the data-parallel rank) under the next sequence number;
        drops and counts it if the queue is full. Never blocks."""
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped_batches += 1

    def shutdown(self) -> None:
        """Stop the thread once it has sent what is queued (waiting up to ``SHUTDOWN_TIMEOUT_S``); it
        closes the sockets as it ends."""
        if not self._running:
            return
        self._running = False
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the KV event publisher thread did not stop within %.1f s (%d batches unsent); its "
                        "sockets close when it does", self.SHUTDOWN_TIMEOUT_S, self._queue.qsize())

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _serve(self) -> None:
        try:
            self._publish_until_shut_down()
        finally:
            self._close_sockets()

    def _publish_until_shut_down(self) -> None:
        """Live batches first: each round sends all that are queued, then at most
        :data:`REPLAY_CHUNK` buffered batches to each replay in progress (a flood of replay requests
        slows the replays, not the live events). Replays still going at shutdown end unfinished (no
        end marker)."""
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None:
                self._continue_replays()
            try:
                item = self._queue.get(timeout=0 if self._replays else self.POLL_S)
            except queue.Empty:
                continue
            while item is not None:
                seq, batch = item
                try:
                    self._send(seq, encoder.encode(batch))
                except Exception:  # noqa: BLE001 -- one batch lost (its seq leaves a gap); the thread goes on
                    log.exception("publishing KV event batch %d failed", seq)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _continue_replays(self) -> None:
        """Take new replay requests (up to :data:`MAX_REPLAYS` in progress; more wait in the socket)
        and send each replay's next chunk, or its end marker."""
        while len(self._replays) < MAX_REPLAYS and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:  # a request is [identity, "", start_seq]
                self.num_malformed_requests += 1  # a warning for the first only: a flood of them is no log flood
                log.log(logging.WARNING if self.num_malformed_requests == 1 else logging.DEBUG,
                        "ignoring a malformed KV event replay request of %d frames (more are logged at debug level)",
                        len(frames))
                continue
            start = int.from_bytes(frames[2], "big")
            self._replays.append([frames[0], [item for item in self._buffer if item[0] >= start], 0])
        for replay in list(self._replays):
            identity, batches, at = replay
            try:
                for seq, payload in batches[at:at + REPLAY_CHUNK]:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                replay[2] = at + REPLAY_CHUNK
                if replay[2] >= len(batches):
                    self._replay.send_multipart((identity, b"", END_SEQ, b""))
                    self._replays.remove(replay)
            except Exception:  # noqa: BLE001 -- that replay is cut short; publishing goes on
                log.exception("answering a KV event replay request failed")
                self._replays.remove(replay)


def _bind(sock, endpoint: str) -> None:
    """``sock.bind(endpoint)``, but ``FileExistsError`` for an ``ipc://`` path that is a file other
    than a socket, or a socket something listens on: ZeroMQ would replace either (a stale socket it may)."""
    path = endpoint.removeprefix("ipc://")
    if path != endpoint and not path.startswith("@") and os.path.lexists(path):  # "@": Linux's abstract names
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} is a file, not a socket")
        with socket.socket(socket.AF_UNIX) as probe:
            probe.setblocking(False)  # a listener with a full backlog: EAGAIN, not a wait
            if probe.connect_ex(path) not in (errno.ECONNREFUSED, errno.ENOENT):
                raise FileExistsError(f"{path} is a socket in use")
    sock.bind(endpoint)


def make_publisher(config: KVEventsConfig | None) -> NullEventPublisher | ZmqEventPublisher:
    """The publisher ``config`` asks for (vLLM's ``EventPublisherFactory.create``)."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config)



@contextlib.contextmanager
def publisher_for(config: KVEventsConfig | None):
    """:func:`make_publisher`'s publisher, shut down if the block raises (its sockets free again)."""
    publisher = make_publisher(config)
    try:
        yield publisher
    except BaseException:
        publisher.shutdown()
        raise
