"""The KV block transport of prefill/decode disaggregation (``runtime/kv_connector/tcp_transfer.py``), on its
own with tensors: blocks arrive bit for bit; a bad or dying peer (truncated frame, oversized header, wrong
magic, a field of the wrong type, a checksum that does not match, a stall, other tokens, another layout)
fails that transfer with an error naming what, and the producer lets the request go and serves on."""
import contextlib
import hashlib
import socket
import struct
import threading
import time

import pytest
import torch

from pagedpack.runtime.block_hash import first_block_keys
from pagedpack.runtime.kv_connector import tcp_transfer as tt
from pagedpack.runtime.kv_connector.tcp_transfer import (
    BlockLayout,
    KVBlockServer,
    KVTransferError,
    pull_blocks,
    read_blocks,
    request_block_hashes,
    write_blocks,
)

BLOCK_SIZE = 4
TOKENS = list(range(100, 110))  # 10 tokens: 2 full blocks and a partial one


def pool(seed: int, num_blocks: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, BLOCK_SIZE, 2, 3, generator=g),
            torch.randn(num_blocks, BLOCK_SIZE, 2, 3, generator=g),
            torch.randn(num_blocks, BLOCK_SIZE, 1, 5, generator=g).to(torch.bfloat16),
            torch.randint(-128, 127, (num_blocks, BLOCK_SIZE, 1, 7), generator=g, dtype=torch.int8)]


@pytest.fixture
def producer():
    caches = pool(0)
    server = KVBlockServer("127.0.0.1", 0, timeout_s=2.0)
    yield server, caches
    server.close()


def hold(server, caches, request_id, block_ids, tokens=TOKENS, salt=None):
    data = read_blocks(caches, block_ids)
    assert request_id in server._held or server.expect(request_id, data.numel())
    hashes = request_block_hashes(tokens, BLOCK_SIZE, first_block_keys(salt))
    server.hold(request_id, data, hashes, len(tokens), BlockLayout.of(caches))


def pull(server, request_id="r", tokens=TOKENS, first_block=0, num_blocks=None, layout=None, port=None,
         timeout_s=2.0, transfer_timeout_s=5.0):
    hashes = request_block_hashes(tokens, BLOCK_SIZE, ())
    return pull_blocks("127.0.0.1", port or server.port, request_id, layout=layout or BlockLayout.of(pool(1)),
                       num_tokens=len(tokens), first_block=first_block, block_hashes=hashes, timeout_s=timeout_s,
                       transfer_timeout_s=transfer_timeout_s,
                       num_blocks=len(hashes) - first_block if num_blocks is None else num_blocks)


def released(server, request_id, within_s=2.0):
    """Whether ``server`` lets ``request_id`` go within ``within_s``."""
    deadline = time.monotonic() + within_s
    while request_id in server._held and time.monotonic() < deadline:
        time.sleep(0.01)
    return request_id not in server._held


@pytest.mark.parametrize("first_block", [0, 2, 3])  # 3: no block (the consumer holds the prompt already)
def test_blocks_arrive_bit_for_bit_and_the_producer_lets_them_go(producer, first_block):
    server, caches = producer
    src = [5, 1, 6]
    hold(server, caches, "r", src)
    got = pull(server, first_block=first_block)
    assert released(server, "r") and server.num_held == 0
    consumer = pool(1)
    dst = [0, 7, 2][first_block:]
    write_blocks(consumer, dst, got.data)
    for mine, theirs, before in zip(consumer, caches, pool(1)):
        assert torch.equal(mine[dst], theirs[src[first_block:]])
        assert torch.equal(mine[3], before[3])  # other blocks untouched
    assert released(server, "r") and server.num_held == 0
    assert server.stats.requests == (first_block < 3) and server.stats.blocks == 3 - first_block  # none: no transfer
    assert server.stats.bytes == (3 - first_block) * BlockLayout.of(caches).block_bytes
    with pytest.raises(KVTransferError, match="no held KV blocks for 'r'"):  # one pull per hold
        pull(server)


def test_the_consumer_refuses_other_tokens_and_another_layout(producer):
    server, caches = producer
    hold(server, caches, "a", [1, 2, 3])
    with pytest.raises(KVTransferError, match=r"kv_blocks.block_hashes: .* from block 2 on"):
        pull(server, "a", tokens=TOKENS[:9] + [7])
    hold(server, caches, "b", [1, 2, 3])
    with pytest.raises(KVTransferError, match=r"kv_blocks.caches: expected"):
        pull(server, "b", layout=BlockLayout.of(pool(1)[:3]))
    hold(server, caches, "c", [1, 2, 3], salt="salt")
    with pytest.raises(KVTransferError, match=r"block_hashes: .* from block 0 on"):  # another cache_salt
        pull(server, "c")
    hold(server, caches, "d", [1, 2, 3])
    with pytest.raises(KVTransferError, match=r"pull.num_blocks: blocks 1 .. 3 asked, the request has 3"):
        pull(server, "d", first_block=1, num_blocks=3)
    assert all(released(server, r) for r in "abcd")
    assert server.stats.failures == 4 and server.stats.requests == 0


def test_held_blocks_nobody_pulls_are_let_go_after_the_hold_timeout_and_the_bytes_are_capped():
    server = KVBlockServer("127.0.0.1", 0, hold_timeout_s=0.2, max_held_bytes=1000)
    try:
        assert server.expect("r", 600) and not server.expect("s", 401) and server.held_bytes == 600
        assert server.num_held == 1 and released(server, "r") and server.held_bytes == 0
        assert server.expect("s", 1000)
    finally:
        server.close()


def test_a_pull_that_comes_before_the_blocks_are_staged_waits_for_them(producer):
    server, caches = producer
    assert server.expect("early", 3 * BlockLayout.of(caches).block_bytes)
    threading.Timer(0.2, hold, (server, caches, "early", [1, 2, 3])).start()
    assert torch.equal(pull(server, "early").data, read_blocks(caches, [1, 2, 3]))
    assert server.expect("never", 10)
    threading.Timer(0.2, server.drop, ("never",)).start()
    with pytest.raises(KVTransferError, match="no held KV blocks for 'never'"):
        pull(server, "never")


class FakeProducer:
    """A peer that answers one pull with ``reply(header)`` bytes (then closes; ``drip_s``: one byte each
    ``drip_s`` seconds)."""

    def __init__(self, reply, *, stall: bool = False, drip_s: float = 0.0):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply, self.stall, self.drip_s, self.acks = reply, stall, drip_s, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        conn, _ = self.sock.accept()
        with conn:
            tt._recv_header(conn, time.monotonic() + 2, tt.Pull)
            answer, step = self.reply(_good_frame()), 1 if self.drip_s else None
            try:  # OSError: the consumer gave up (closed) first; KVTransferError included
                for i in range(0, len(answer), step or max(1, len(answer))):
                    conn.sendall(answer[i:i + (step or len(answer))])
                    time.sleep(self.drip_s)
                if not self.stall:
                    conn.shutdown(socket.SHUT_WR)  # what it sent is all it sends
                self.acks.append(tt._recv_header(conn, time.monotonic() + 2, tt.Ack))
            except OSError:
                pass
            time.sleep(0.1)


def _good_frame(**changes) -> tuple[tt.KVBlocks, bytes]:
    caches, hashes = pool(0), request_block_hashes(TOKENS, BLOCK_SIZE, ())
    data = read_blocks(caches, [1, 2, 3])
    header = tt.KVBlocks("r", len(TOKENS), 0, hashes, [(d, list(s)) for d, s in BlockLayout.of(caches).caches],
                         [hashlib.sha256(row).digest() for row in data.numpy()], data.numel())
    for name, value in changes.items():
        setattr(header, name, value)
    return header, data.numpy().tobytes()


def _frame(header, payload=b"") -> bytes:
    encoded = header if isinstance(header, bytes) else tt._encoder.encode(header)
    return struct.pack(">4sI", b"PPKV", len(encoded)) + encoded + payload


@pytest.mark.parametrize("reply, error", [
    (lambda g: _frame(*g)[:-7], "closed the connection after"),  # the producer dies mid-payload
    (lambda g: _frame(*g)[:5], "closed the connection after 5 of 8 bytes"),  # a truncated frame prefix
    (lambda g: struct.pack(">4sI", b"PPKV", 2**31), r"frame.header_bytes: expected at most \d+, got 2147483648"),
    (lambda g: b"HTTP/1.1 200 OK\r\n\r\n", "frame: expected the magic b'PPKV'"),
    (lambda g: _frame(g[0], bytes([g[1][0] ^ 1]) + g[1][1:]), r"kv_blocks.block_sha256\[0\]: the bytes of block 0"),
    (lambda g: _frame(_good_frame(payload_bytes=10**12)[0]), r"kv_blocks.payload_bytes: expected \d+ .*, got 10{12}"),
    (lambda g: _frame(_good_frame(num_tokens=11)[0]), "kv_blocks.num_tokens: expected 10, got 11"),
    (lambda g: _frame(b"\x81\xa4type\xa9kv_blocks"), r"frame.header: Object missing required field `request_id`"),
    (lambda g: _frame(tt._encoder.encode({**tt.msgspec.structs.asdict(g[0]), "type": "kv_blocks",
                                          "num_tokens": "10"})), r"Expected `int`, got `str` - at `\$.num_tokens`"),
    (lambda g: _frame(tt.Error("request_id: nope")), "the KV producer at .*: request_id: nope"),
    (lambda g: _frame(tt.Ack("r", True)), "frame.header.type: expected 'kv_blocks' or 'error', got 'ack'"),
])
def test_a_bad_producer_fails_the_pull_with_an_error_naming_what(reply, error):
    fake = FakeProducer(reply)
    with pytest.raises(KVTransferError, match=error):
        pull(None, port=fake.port)


def test_a_stalled_producer_fails_the_pull_at_its_deadline():
    fake = FakeProducer(lambda g: _frame(*g)[:100], stall=True)  # sends part of the frame, then waits
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="before the deadline"):
        pull(None, port=fake.port, timeout_s=0.3)
    assert time.monotonic() - start < 2


def test_a_producer_that_never_answers_or_drips_fails_the_pull_by_the_whole_transfer_deadline():
    """From an adversarial trial: a listener that accepts and never answers held a pull thread per phase
    (connect, header, payload) for ``timeout_s`` each; one that sends a byte at a time never tripped a
    per-read deadline. The whole pull now ends by ``transfer_timeout_s``."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody ever reads or answers
    drip = FakeProducer(lambda g: _frame(*g), drip_s=0.02)  # a byte each 20 ms: each read gets one in time
    try:
        for port, error in ((silent.getsockname()[1], "sent 0 of 8 bytes before the deadline"),
                            (drip.port, "bytes before the deadline")):
            start = time.monotonic()
            with pytest.raises(KVTransferError, match=error):
                pull(None, port=port, timeout_s=1.0, transfer_timeout_s=0.4)
            assert 0.35 < time.monotonic() - start < 1.0, port
    finally:
        silent.close()


def test_a_consumer_that_dies_or_lies_fails_its_pull_only(producer):
    server, caches = producer
    hold(server, caches, "dies", [1, 2, 3])
    with socket.create_connection(("127.0.0.1", server.port)) as conn:  # reads the header, dies mid-payload
        conn.sendall(_frame(tt.Pull("dies", 0, 3)))
        conn.recv(100)
    for garbage in (struct.pack(">4sI", b"PPKV", 2**30), b"GET / HTTP/1.1\r\n\r\n", _frame(tt.Pull("x", -1, 1))):
        with socket.create_connection(("127.0.0.1", server.port)) as conn:
            conn.sendall(garbage)
            conn.settimeout(2)
            with pytest.raises(ConnectionResetError) if garbage[:4] == b"GET " else contextlib.nullcontext():
                assert conn.recv(100) == b""  # closed (reset when what it sent is left unread)
    assert released(server, "dies")
    hold(server, caches, "next", [4, 5, 6])
    got = pull(server, "next")
    assert torch.equal(got.data, read_blocks(caches, [4, 5, 6]))
    assert released(server, "next")  # after its count
    assert server.stats.requests == 1 and server.stats.failures == 4
