"""KV cache events (``kv_events_config``) as a router outside the engine sees them.

The subscriber here is written from vLLM's documented wire format, not from pagedpack's structs:
ZeroMQ multipart ``(topic, 8-byte big-endian seq, msgpack payload)`` on the PUB socket; a replay
ROUTER answering ``["", start_seq]`` with ``["", seq, payload]`` frames and the end marker
``seq == -1``; a payload decoded with plain ``msgspec.msgpack.decode`` into
``[ts, [event, ...], data_parallel_rank]``, each event a map tagged by ``"type"``. Block hashes
are checked against an independent sha256 chain built from the formula ``block_hash.py``
documents. The references: the pool's own ``BlockPool.cached_blocks()``, the prompts sent.
"""
import dataclasses
import hashlib
import json
import struct
import tempfile
import threading
import time

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pagedpack import LLM, EngineArgs
from pagedpack.host.child_process import free_port
from pagedpack.runtime.kv_event_publisher import KVEventsConfig, ZmqEventPublisher
from pagedpack.runtime.kv_events import AllBlocksCleared, KVEventBatch
from pagedpack.runtime.sampling import SamplingParams

from conftest import RemoteServer, run_cli

BLOCK_SIZE = 4
TOPIC = "kv@test"
# vLLM's KVEventsConfig defaults (vllm/config/kv_events.py)
VLLM_DEFAULTS = {"enable_kv_cache_events": False, "endpoint": "tcp://*:5557", "replay_endpoint": None,
                 "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000, "topic": ""}


def chain(token_ids: list[int], salt: str | None = None, parent: bytes | None = None) -> list[bytes]:
    """The documented block hashes of ``token_ids``' full blocks after ``parent`` (None: a sequence's
    start): sha256(parent || u64 len || int64 tokens || u64 #keys || (u64 len || UTF-8 key)...),
    little-endian; a sequence's first parent sha256(b"pagedpack prefix cache v1"); the salt a key of
    the sequence's first block only."""
    hashes, at_start = [], parent is None
    parent = hashlib.sha256(b"pagedpack prefix cache v1").digest() if at_start else parent
    for j in range(len(token_ids) // BLOCK_SIZE):
        block = token_ids[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]
        keys = [salt.encode()] if salt is not None and at_start and j == 0 else []
        data = parent + struct.pack("<Q", len(block)) + b"".join(struct.pack("<q", t) for t in block)
        data += struct.pack("<Q", len(keys)) + b"".join(struct.pack("<Q", len(k)) + k for k in keys)
        parent = hashlib.sha256(data).digest()
        hashes.append(parent)
    return hashes


class Subscriber:
    """A router's side: a SUB socket on ``endpoint`` (topic ``TOPIC``) and a DEALER on ``replay``."""

    def __init__(self, endpoint: str, replay: str):
        context = zmq.Context.instance()
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.live: dict[int, bytes] = {}

    def receive(self, until_seq: int, timeout_s: float = 10.0) -> None:
        """Take live batches until ``until_seq`` has come (or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while until_seq not in self.live and time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == TOPIC.encode() and len(seq) == 8
                self.live[int.from_bytes(seq, "big")] = payload

    def replay(self, start: int) -> dict[int, bytes]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while True:
            assert self.dealer.poll(10_000), "no answer from the replay socket"
            empty, seq, payload = self.dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert empty == b"" and payload == b""
                return got
            got[seq] = payload

    def settled(self, timeout_s: float = 10.0) -> dict[int, bytes]:
        """Every batch published so far: two replays in a row that agree (the publisher's thread sends
        a queued batch between answering two replays, so they agree only once its queue is empty)."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            batches = self.replay(0)
            if batches == last:
                return batches
            last = batches
        raise AssertionError("the replay kept growing")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


def decode(payload: bytes) -> list[dict]:
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    return events


def rebuild(batches: dict[int, bytes]) -> tuple[set[bytes], list[dict]]:
    """The cached hashes a router holds after ``batches`` in order, and every event."""
    assert sorted(batches) == list(range(len(batches))), "a gap in the sequence numbers"
    cached, history = set(), []
    for seq in sorted(batches):
        for event in decode(batches[seq]):
            history.append(event)
            if event["type"] == "BlockStored":
                assert event["medium"] == "GPU" and event["block_size"] == BLOCK_SIZE and event["lora_id"] is None
                assert not cached & set(event["block_hashes"])
                cached |= set(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                assert event["medium"] == "GPU" and set(event["block_hashes"]) <= cached
                cached -= set(event["block_hashes"])
            else:
                assert event == {"type": "AllBlocksCleared"}
                cached = set()
    return cached, history


@pytest.fixture(scope="module")
def endpoints():
    with tempfile.TemporaryDirectory(prefix="kv", dir="/tmp") as folder:  # ipc paths: about 100 bytes at most
        yield f"ipc://{folder}/pub", f"ipc://{folder}/replay"


@pytest.fixture(scope="module")
def llm(endpoints):
    config = {"enable_kv_cache_events": True, "endpoint": endpoints[0], "replay_endpoint": endpoints[1],
              "topic": TOPIC}
    llm = LLM("tiny", num_blocks=10, block_size=BLOCK_SIZE, max_num_seqs=4, kv_events_config=config,
              keep_source_model=True)
    yield llm
    llm.llm_engine.close()


PREFIX = [7, 8, 9, 10, 11, 12, 13, 14]
PROMPTS = [PREFIX + [1, 2, 3, 4, 5], PREFIX + [1, 2, 3, 4, 6], PREFIX + [30, 31, 32, 33], list(range(40, 53)),
           PREFIX + [1, 2, 3, 4, 5, 9], list(range(60, 71)), PREFIX + [90, 91]]
SALTED = {"prompt_token_ids": PREFIX + [1, 2], "cache_salt": "tenant-a"}


def test_a_subscriber_rebuilds_the_pool_s_cache_from_the_events(llm, endpoints):
    early = Subscriber(*endpoints)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:4], params)
    first = early.settled()  # all sent
    late = Subscriber(*endpoints)  # subscribes after the first batches were sent
    time.sleep(0.1)  # its subscription reaches the publisher (ZeroMQ's "slow joiner")
    llm.generate([*PROMPTS[4:], SALTED], params)
    pool = llm.llm_engine.scheduler.kv_cache_manager.pool
    batches = early.settled()
    cached, history = rebuild(batches)
    assert cached == set(pool.cached_blocks()) and cached
    assert pool.num_evictions > 0 and any(e["type"] == "BlockRemoved" for e in history)
    last = max(batches)
    for subscriber in (early, late):  # live batches in order, equal to the replayed ones; the late one replays
        subscriber.receive(last)
        seqs = sorted(subscriber.live)
        assert seqs == list(range(seqs[0], last + 1)) and all(subscriber.live[s] == batches[s] for s in seqs)
    assert min(late.live) >= len(first) and {**late.replay(0), **late.live} == batches

    # each BlockStored: its hashes are the chain of its parent and tokens; every prompt's full blocks
    # were stored with the prompt's own tokens, their parents included (the first with the salt)
    stored = {}
    for event in history:
        if event["type"] == "BlockStored":
            tokens = event["token_ids"]
            assert len(tokens) == BLOCK_SIZE * len(event["block_hashes"])
            salts = [k[0] for k in event["extra_keys"] if k is not None]
            assert event["block_hashes"] == chain(tokens, *salts[:1], parent=event["parent_block_hash"])
            for j, h in enumerate(event["block_hashes"]):
                stored[h] = (event["parent_block_hash"] if j == 0 else event["block_hashes"][j - 1],
                             tokens[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE])
    for prompt, salt in [(p, None) for p in PROMPTS] + [(SALTED["prompt_token_ids"], "tenant-a")]:
        for j, h in enumerate(chain(prompt, salt)):
            parent = chain(prompt, salt)[j - 1] if j else None
            assert stored[h] == (parent, prompt[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE])

    # a reset: one AllBlocksCleared, the router's copy empty as the pool is
    assert llm.reset_prefix_cache()
    batches = early.settled()
    cached, history = rebuild(batches)
    assert history[-1] == {"type": "AllBlocksCleared"} and cached == set(pool.cached_blocks()) == set()
    early.close()
    late.close()


def test_a_full_queue_drops_and_counts_batches_instead_of_blocking(endpoints, caplog):
    folder = endpoints[0].rsplit("/", 1)[0]
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"{folder}/pub2", replay_endpoint=f"{folder}/rep2",
                            max_queue_size=2, topic=TOPIC)
    publisher = ZmqEventPublisher(config)
    entered, release = threading.Event(), threading.Event()
    send = publisher._send

    def stalled(seq, payload):  # the publisher thread stuck on its socket
        entered.set()
        release.wait(10)
        send(seq, payload)

    publisher._send = stalled
    try:
        batch = KVEventBatch(ts=1.0, events=[AllBlocksCleared()])
        publisher.publish(batch)
        assert entered.wait(10)
        start = time.monotonic()
        for _ in range(10):
            publisher.publish(KVEventBatch(ts=2.0, events=[AllBlocksCleared()]))
        assert time.monotonic() - start < 1.0 and publisher.num_dropped_batches == 8  # 2 queued, 8 dropped
        release.set()
        subscriber = Subscriber(f"{folder}/pub2", f"{folder}/rep2")
        hostile = zmq.Context.instance().socket(zmq.DEALER)
        hostile.connect(f"{folder}/rep2")
        hostile.send_multipart([b"", b"x" * (1 << 20)])  # over REPLAY_FRAME_LIMIT: disconnected, never read
        subscriber.dealer.send_multipart([b"", b"not 8 bytes"])  # malformed: ignored, the next one answered
        subscriber.dealer.send_multipart([b"", b"", b"", b""])
        assert sorted(subscriber.settled()) == [0, 1, 2]
        publisher.publish(KVEventBatch(ts=3.0, events=[]))
        replayed = subscriber.settled()
        assert sorted(replayed) == [0, 1, 2, 11]  # the dropped ones' sequence numbers: a gap subscribers see
        assert [msgspec.msgpack.decode(replayed[s])[0] for s in (0, 1, 11)] == [1.0, 2.0, 3.0]
        assert caplog.text.count("WARNING") == 1 and publisher.num_malformed_requests == 2  # the 1 MiB one never read
        subscriber.close()
        hostile.close(linger=0)
    finally:
        release.set()
        publisher.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(batch)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"{folder}/pub3",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    taken = ZmqEventPublisher(config)  # the replay port is this one's until it shuts down
    with pytest.raises(ValueError, match="kv_events_config.replay_endpoint: expected an address this process can"):
        ZmqEventPublisher(dataclasses.replace(config, endpoint=f"{folder}/pub3b"))
    taken.shutdown()


def test_a_flood_of_replay_requests_does_not_make_live_batches_drop():
    """50 replays of 3,000 buffered batches wait while live batches come every 2 ms: each round of the
    publisher thread sends what is queued first (before, a whole replay went between two batches, and
    the 16-batch queue overflowed)."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://live",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", max_queue_size=16)
    publisher = ZmqEventPublisher(config)
    flood = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for i in range(3000):
            publisher._queue.put((i, KVEventBatch(ts=0.0, events=[AllBlocksCleared()])))
        while not publisher._queue.empty():
            time.sleep(0.01)
        flood.connect(config.replay_endpoint)
        for _ in range(50):
            flood.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.05)
        for _ in range(40):
            publisher.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
            time.sleep(0.002)
        assert publisher.num_dropped_batches == 0
    finally:
        flood.close(linger=0)
        publisher.shutdown()


def test_a_publisher_thread_past_the_shutdown_timeout_frees_its_addresses_when_it_ends(monkeypatch):
    monkeypatch.setattr(ZmqEventPublisher, "SHUTDOWN_TIMEOUT_S", 0.1)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://stuck",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = ZmqEventPublisher(config)
    entered, release = threading.Event(), threading.Event()
    send = publisher._send

    def stuck(seq, payload):
        entered.set()
        release.wait(10)
        send(seq, payload)

    publisher._send = stuck
    publisher.publish(KVEventBatch(ts=1.0, events=[]))
    assert entered.wait(10)
    publisher.shutdown()  # gives up waiting; the thread still sends its batch, then closes
    release.set()
    publisher._thread.join(10)
    ZmqEventPublisher(config).shutdown()  # the addresses are free (they stayed bound until the process ended)


def test_an_llm_binds_its_kv_event_sockets_before_the_build_and_frees_them_if_it_fails(monkeypatch, tmp_path):
    """A second engine on the same endpoint fails before loading the model; a failed build leaves
    the endpoint free for the next."""
    def build(builder):
        raise RuntimeError("the build")

    monkeypatch.setattr("pagedpack.llm.ProgramBuilder.build", build)
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    taken = ZmqEventPublisher(KVEventsConfig.parse(config))
    try:
        with pytest.raises(ValueError, match="kv_events_config.endpoint: expected an address this process can use"):
            LLM("tiny", kv_events_config={**config, "replay_endpoint": None})  # before the build
        with pytest.raises(ValueError, match="kv_events_config.replay_endpoint: expected an address this process"):
            LLM("tiny", kv_events_config={**config, "endpoint": f"ipc://{tmp_path}/pub2"})
    finally:
        taken.shutdown()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the build"):
            LLM("tiny", kv_events_config=config)
    (tmp_path / "file").write_text("kept")  # ZeroMQ would replace it with its socket
    with pytest.raises(ValueError, match=rf"kv_events_config.endpoint: .* \({tmp_path}/file is a file, not a socket\)"):
        ZmqEventPublisher(KVEventsConfig.parse({**config, "endpoint": f"ipc://{tmp_path}/file"}))
    assert (tmp_path / "file").read_text() == "kept"


def test_kv_events_config_takes_vllm_s_fields_and_names_a_bad_one(capsys):
    config = KVEventsConfig.parse("{}")
    assert {k: getattr(config, k) for k in VLLM_DEFAULTS} == VLLM_DEFAULTS and config.publisher == "null"
    assert KVEventsConfig.parse({"enable_kv_cache_events": True}).publisher == "zmq"  # vLLM's default then
    for bad, named in (({"endpoints": "x"}, "kv_events_config.endpoints"),
                       ({"buffer_steps": "10"}, "kv_events_config.buffer_steps: expected an int"),
                       ({"enable_kv_cache_events": 1}, "kv_events_config.enable_kv_cache_events: expected a bool"),
                       ({"publisher": "kafka"}, "kv_events_config.publisher: expected 'null' or 'zmq'"),
                       ({"max_queue_size": 0}, "kv_events_config.max_queue_size: expected an int from 1 to"),
                       ({"buffer_steps": 10**20},  # an OverflowError from the deque
                        "kv_events_config.buffer_steps: expected an int from 0 to 2147483647, got 10{20}"),
                       ({"hwm": 2**31}, "kv_events_config.hwm: expected an int from 0 to 2147483647, got 2147483648"),
                       ({"topic": "kv\ud800"}, r"kv_events_config.topic: expected text UTF-8 can encode"),
                       ({"endpoint": "tcp://*:99999"}, r"kv_events_config.endpoint: expected a port from 0 to 65535"),
                       ({"replay_endpoint": "tcp://127.0.0.1:-5"}, "kv_events_config.replay_endpoint: expected a port"),
                       ({"replay_endpoint": "localhost:5558"}, "kv_events_config.replay_endpoint: expected a ZeroMQ"),
                       ("[1]", "kv_events_config: expected a JSON object"), ("{", "kv_events_config: expected a JSON")):
        with pytest.raises(ValueError, match=named):
            EngineArgs(model="tiny", kv_events_config=bad)
    code, _, err = run_cli(capsys, "serve", "tiny", "--kv-events-config", '{"endpoints": 1}')  # before loading
    assert code == 2 and "kv_events_config.endpoints: expected one of the fields" in err, err


def test_a_live_server_serves_the_metrics_the_gateway_reads_and_publishes_events(llm, endpoints, tmp_path):
    """``pagedpack serve --metrics-namespace vllm --kv-events-config ...``: /metrics carries the Gateway
    API inference extension's model-server-protocol metrics; its events reach a subscriber."""
    exported = llm.export(tmp_path / "tiny.pt2")
    folder = endpoints[0].rsplit("/", 1)[0]
    config = {"enable_kv_cache_events": True, "endpoint": f"{folder}/pub4", "replay_endpoint": f"{folder}/replay4",
              "topic": TOPIC}
    with RemoteServer(exported, "--served-model-name", "tiny", "--metrics-namespace", "vllm", "--num-blocks", "32",
                      "--block-size", str(BLOCK_SIZE), "--kv-events-config", json.dumps(config),
                      log_path=tmp_path / "server.log") as server:
        body = {"model": "tiny", "prompt": PREFIX + [1, 2], "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
        subscriber = Subscriber(config["endpoint"], config["replay_endpoint"])
        cached, _ = rebuild(subscriber.settled())
        subscriber.close()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge" and families[name].samples[0].labels == {"model_name": "tiny"}
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == str(BLOCK_SIZE) and info.labels["num_gpu_blocks"] == "32"
    assert families["vllm:kv_events_dropped_batches"].samples[0].value == 0
    assert set(chain(PREFIX + [1, 2])) <= cached  # the prompt's full blocks, as a router sees them
