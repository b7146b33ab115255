"""The KV connector interface (runtime/kv_connector): its config and registry, and the scheduler and
engine driving a connector end to end: loads of blocks a connector holds, a failed load recomputed,
blocks kept while a finished request is saved, asynchronous loads. The connector here is the test's
own (a dict of saved blocks by hash), and the tokens are checked against the unmodified model run one
prompt at a time."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack import LLM, SamplingParams
from pagedpack.engine_args import EngineArgs
from pagedpack.models.tiny import default_model
from pagedpack.runtime.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from pagedpack.runtime.kv_connector.config import KVTransferConfig
from pagedpack.runtime.kv_connector.factory import KVConnectorFactory
from pagedpack.runtime.request import Request
from pagedpack.runtime.scheduler import KVConnectorOutput, SchedulerOutput

from conftest import greedy_alone, random_prompts
from test_scheduler import check_pool, make_scheduler, solo_stream

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


class DictMetadata(KVConnectorMetadata):
    def __init__(self, loads, saves, finished):
        self.loads, self.saves, self.finished = loads, saves, finished


class DictConnector(KVConnectorBase_V1):
    """Saves every block a step completes into ``shared["store"]`` (hash -> per layer (K, V)) and loads
    what it holds. ``shared["mode"]``: ``"sync"``; ``"async"`` (loads finish in the next step's
    ``get_finished``); ``"fail"`` (loads write noise and are reported failed). ``shared["delay_free"]``:
    finished requests' blocks are kept until the next ``get_finished``."""

    def __init__(self, config, role, *, block_size, shared, kv_cache_manager=None):
        super().__init__(config, role, block_size=block_size)
        self.shared, self.kv = shared, kv_cache_manager
        shared.setdefault("store", {})
        shared.setdefault("mode", "sync")
        shared.setdefault("delay_free", False)
        self._loads, self._finished, self._errors, self._async, self._caches = [], [], set(), [], {}

    # scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hashes = self.kv.block_hashes(request)
        n = 0
        for block_hash in hashes[num_computed_tokens // self.block_size:]:
            if block_hash not in self.shared["store"]:
                break
            n += 1
        return n * self.block_size, self.shared["mode"] == "async" and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        first = (request.num_computed_tokens - num_external_tokens) // self.block_size
        for j in range(first, first + num_external_tokens // self.block_size):
            self._loads.append((request.request_id, blocks[j], request.block_hashes[j]))

    def build_connector_meta(self, scheduler_output):
        saves = []
        for s in scheduler_output.scheduled:
            r = s.request
            hashes = self.kv.block_hashes(r)
            for j in range(r.num_computed_tokens // self.block_size,
                           min(r.num_computed_tokens + s.num_new_tokens, r.num_tokens) // self.block_size):
                saves.append((r.block_ids[j], hashes[j]))
        meta = DictMetadata(self._loads, saves, self._finished)
        self._loads, self._finished = [], []
        return meta

    def request_finished(self, request, block_ids):
        if self.shared["delay_free"]:
            self._finished.append(request.request_id)
        return self.shared["delay_free"], {"saved_blocks": len(block_ids)}

    # worker half
    def register_kv_caches(self, kv_caches):
        self._caches = kv_caches

    def start_load_kv(self, forward_context=None, **kwargs):
        meta = self._get_connector_metadata()
        self._async_done = {request_id for request_id, _, _ in self._async}
        for request_id, block_id, block_hash in self._async:
            self._load(block_id, block_hash)
        self._async = []
        for load in meta.loads:
            if self.shared["mode"] == "async":
                self._async.append(load)
            else:
                self._load(load[1], load[2])
        self._sending = set(meta.finished)

    def _load(self, block_id, block_hash):
        for name, (k, v) in self._caches.items():
            if self.shared["mode"] == "fail":
                k[block_id].normal_()
                v[block_id].normal_()
                self._errors.add(block_id)
            else:
                k[block_id], v[block_id] = self.shared["store"][block_hash][name]

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        k, v = kv_layer
        for block_id, block_hash in self._get_connector_metadata().saves:
            self.shared.setdefault("pending", {}).setdefault(block_hash, {})[layer_name] = (
                k[block_id].clone(), v[block_id].clone())

    def wait_for_save(self):
        pending = self.shared.pop("pending", {})
        for block_hash, layers in pending.items():
            if len(layers) == len(self._caches):
                self.shared["store"].setdefault(block_hash, layers)

    def get_finished(self, finished_req_ids):
        sending, self._sending = getattr(self, "_sending", set()), set()
        done, self._async_done = getattr(self, "_async_done", set()), set()
        return sending, done

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors


KVConnectorFactory.register_connector("DictConnector", __name__, "DictConnector")
CONFIG = {"kv_connector": "DictConnector", "kv_role": "kv_both"}


@pytest.fixture(scope="module")
def llm():
    llm = LLM("tiny", block_size=BLOCK, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False, kv_transfer_config=CONFIG)
    yield llm
    llm.llm_engine.close()


@pytest.fixture(scope="module")
def prompts_and_reference():
    prompts = random_prompts([13, 9, 16, 22], seed=5)
    return prompts, greedy_alone(default_model()[0], prompts, GREEDY.max_tokens)


def shared(llm) -> dict:
    return llm.llm_engine.kv_connector.connector.shared


def run(llm, prompts, mode, delay_free=False):
    state = shared(llm)
    state["mode"], state["delay_free"] = mode, delay_free
    scheduler = llm.llm_engine.scheduler
    before = scheduler.connector_prefix_cache_stats.hits
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # finished requests' blocks are kept while "saved" (freed by a later step's get_finished)
    assert bool(scheduler.kv_cache_manager.num_used_blocks) == bool(scheduler.finished_sending) == delay_free
    assert not scheduler.waiting_for_remote_kvs
    return [o.outputs[0].token_ids for o in outs], scheduler.connector_prefix_cache_stats.hits - before


def test_config_errors_name_the_field():
    for text, field in [('{"kv_connector": "DictConnector", "kv_role": "both"}', "kv_role"),
                        ('{"kv_connector": "DictConnector", "kv_port": 70000}', "kv_port"),
                        ('{"kv_connector": "DictConnector", "kv_rank": 0}', "kv_rank"),
                        ('{"kv_connector": "DictConnector", "kv_connector_extra_config": []}',
                         "kv_connector_extra_config"),
                        ('{"kv_role": "kv_both"}', "kv_connector")]:
        with pytest.raises(ValueError, match=rf"kv_transfer_config\.{field}:"):
            KVTransferConfig.parse(text)
    with pytest.raises(ValueError, match=r"kv_transfer_config: expected a JSON object"):
        KVTransferConfig.parse("[1")
    with pytest.raises(ValueError, match=r"kv_transfer_config\.kv_connector: expected one of"):
        EngineArgs(model="tiny", kv_transfer_config={"kv_connector": "NoSuchConnector"})
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("DictConnector", __name__, "DictConnector")
    config = KVTransferConfig.parse(CONFIG)
    assert config.is_kv_producer and config.is_kv_consumer and config.kv_ip == "127.0.0.1"
    made = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, block_size=4, shared={})
    assert isinstance(made, DictConnector) and made.role is KVConnectorRole.WORKER


def test_loads_from_the_connector_give_the_models_tokens(llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    first, hits = run(llm, prompts, "sync")
    assert first == reference
    again, hits = run(llm, prompts, "sync")  # prefix caching is off: every full block comes from the connector
    assert again == reference
    assert hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)  # what admission can load: the prompts


def test_a_failed_load_is_recomputed(llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    run(llm, prompts, "sync")
    got, hits = run(llm, prompts, "fail")  # noise in every loaded block, reported failed
    assert hits > 0 and got == reference


def test_asynchronous_loads_and_delayed_frees(llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    run(llm, prompts, "sync")
    got, hits = run(llm, prompts, "async", delay_free=True)
    assert hits > 0 and got == reference
    state = shared(llm)
    state["delay_free"] = False
    got, _ = run(llm, prompts[:1], "sync")  # its first step's get_finished frees the kept blocks
    assert got == reference[:1]
    assert torch.is_tensor(next(iter(state["store"].values()))["layer.0"][0])


# --- the scheduler's side, over the echo model: random arrivals, evictions into a tier, failed loads ---


class EchoTier(KVConnectorBase_V1):
    """Over the echo model's cache: saves each evicted block's tokens by hash (the tier), loads them back;
    ``failures`` says, load by load, which ones write garbage and are reported failed."""

    def __init__(self, kv, model, failures):
        super().__init__(KVTransferConfig(kv_connector="EchoTier"), KVConnectorRole.SCHEDULER, block_size=kv.block_size)
        self.kv, self.model, self.failures = kv, model, list(failures)
        self.store, self._loads = {}, []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = 0
        for block_hash in self.kv.block_hashes(request)[num_computed_tokens // self.block_size:]:
            if block_hash not in self.store:
                break
            n += 1
        return n * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        first = (request.num_computed_tokens - num_external_tokens) // self.block_size
        self._loads += [(request.block_hashes[j], blocks[j])
                        for j in range(first, first + num_external_tokens // self.block_size)]

    def build_connector_meta(self, scheduler_output):
        meta = DictMetadata(self._loads, scheduler_output.evicted_blocks, [])
        self._loads = []
        return meta

    def run_worker(self, meta) -> set[int]:
        """Saves (before anything overwrites the blocks), then loads; returns the failed loads' blocks."""
        bs, cache, failed = self.block_size, self.model.cache, set()
        for block_hash, block_id in meta.saves:
            self.store.setdefault(block_hash, cache[block_id * bs:(block_id + 1) * bs])
        for block_hash, block_id in meta.loads:
            fail = self.failures.pop(0) if self.failures else False
            cache[block_id * bs:(block_id + 1) * bs] = [-1] * bs if fail else self.store[block_hash]
            if fail:
                failed.add(block_id)
        return failed

    def start_load_kv(self, forward_context=None, **kwargs):  # run_worker does the worker's work here
        raise AssertionError("not driven by an engine")

    wait_for_layer_load = save_kv_layer = wait_for_save = start_load_kv


@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 3), num_blocks=st.integers(6, 10), max_num_batched_tokens=st.integers(2, 16),
       prefixes=st.lists(st.lists(st.integers(1, 3), min_size=4, max_size=9), min_size=2, max_size=3),
       specs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 2), st.lists(st.integers(1, 3), max_size=2),
                                st.integers(1, 3)), min_size=1, max_size=10),
       failures=st.lists(st.booleans(), max_size=12))
def test_tier_hits_and_failed_loads_keep_every_request_its_own(block_size, num_blocks, max_num_batched_tokens,
                                                              prefixes, specs, failures):
    """Requests over shared prefixes that a tight pool cannot keep, with evicted blocks kept by a connector
    and loaded back, some loads failing, in random arrival orders: the pool's invariants hold every step,
    every request reads back exactly its own tokens (the echo model, run after the rollback as the engine
    discards a rolled-back request's step) and produces its solo stream (the stop rules alone)."""
    scheduler, model = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=14)
    tier = EchoTier(scheduler.kv_cache_manager, model, failures)
    scheduler.connector = tier
    pending = sorted(enumerate(specs), key=lambda item: item[1][0])
    requests = []
    for step_index in range(10_000):
        while pending and pending[0][1][0] <= step_index:
            i, (_, which, suffix, max_tokens) = pending.pop(0)
            prompt = prefixes[which % len(prefixes)] + suffix
            r = Request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
            if scheduler.kv_cache_manager.num_blocks_for(len(prompt) + max_tokens) <= num_blocks:
                scheduler.add_request(r)
                requests.append(r)
        if not pending and not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        failed = tier.run_worker(out.kv_connector_metadata)
        rolled_back = scheduler.update_from_connector_output(out, KVConnectorOutput(invalid_block_ids=failed))
        kept = SchedulerOutput([s for s in out.scheduled if s.request.request_id not in rolled_back], [], 0,
                               out.blocks_to_copy)
        sampled = model(kept)
        check_pool(scheduler.kv_cache_manager, scheduler.running, out.blocks_to_copy)
        scheduler.update_from_output(out, sampled, rolled_back=rolled_back)
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == num_blocks
    for r in requests:
        assert (r.output_token_ids, r.finish_reason) == solo_stream(r.prompt_token_ids, r.sampling_params, None, 14)


def test_a_burst_of_pulled_prompts_filling_the_pool_is_answered():
    """From an adversarial trial: requests whose asynchronous load (a P2pTcpConnector pull) is done hold
    blocks for their loaded tokens only; 12 of them filled a 64-block pool, none found the block its last
    prompt token needs, and nothing ran to be preempted: every request waited forever. The scheduler now
    frees a waiting holder's blocks (it computes again), and each answer is the one-process answer."""
    import random
    import threading

    producer = LLM("tiny", num_blocks=256, kv_transfer_config={"kv_connector": "P2pTcpConnector",
                                                               "kv_role": "kv_producer", "kv_port": 0})
    consumer = LLM("tiny", num_blocks=64, kv_transfer_config={"kv_connector": "P2pTcpConnector",
                                                              "kv_role": "kv_consumer"})
    try:
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(129)]} for _ in range(12)]  # 8 blocks + 1
        prefill = SamplingParams(max_tokens=1, temperature=0.0,
                                 extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        outs = producer.generate(prompts, prefill, use_tqdm=False)
        assert all(o.kv_transfer_params for o in outs)
        decode = [SamplingParams(max_tokens=4, temperature=0.0, extra_args={"kv_transfer_params": o.kv_transfer_params})
                  for o in outs]
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("out", consumer.generate(prompts, decode,
                                                                                         use_tqdm=False)), daemon=True)
        worker.start()
        worker.join(90)
        assert "out" in box, "the consumer did not answer within 90 s"
        expected = producer.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in box["out"]] == [o.outputs[0].token_ids for o in expected]
        assert consumer.llm_engine.scheduler.kv_cache_manager.num_used_blocks == 0
    finally:
        producer.llm_engine.close()
        consumer.llm_engine.close()


def test_kv_transfer_params_with_n_above_1_are_refused_by_the_python_api():
    """From an adversarial trial: n > 1 with kv_transfer_params was taken (the engine's first sequence has
    n=1 and the others as forks: the check read n=1). One sequence's KV moves at a time."""
    llm = LLM("tiny", num_blocks=16, kv_transfer_config={"kv_connector": "P2pTcpConnector", "kv_role": "kv_both",
                                                          "kv_port": 0})
    try:
        for n in (2, 3):
            params = SamplingParams(n=n, max_tokens=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            with pytest.raises(ValueError, match=rf"^kv_transfer_params: .* expected n=1 .*, got n={n}$"):
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        one = SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], one, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("extra", [{"timeout_s": -1}, {"remote_hosts": "127.0.0.1"}, {"bogus": 1}])
def test_p2p_options_are_checked_before_the_model_is_built(extra):
    """From an adversarial trial: these were refused only once the model was built (10-15 s later)."""
    with pytest.raises(ValueError, match="kv_connector_extra_config"):
        EngineArgs(model="tiny", kv_transfer_config={"kv_connector": "P2pTcpConnector", "kv_role": "kv_consumer",
                                                      "kv_connector_extra_config": extra})


def test_a_kv_port_another_process_holds_is_refused_before_the_model_is_built():
    """From an adversarial trial: a producer's kv_port in use was reported only once the model was built."""
    import socket

    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        with pytest.raises(ValueError, match=rf"^kv_transfer_config.kv_port: expected a port this producer can "
                                             rf"listen on, got 127.0.0.1:{port}, which cannot be bound"):
            EngineArgs(model="tiny", kv_transfer_config={"kv_connector": "P2pTcpConnector", "kv_role": "kv_both",
                                                          "kv_port": port})
        EngineArgs(model="tiny", kv_transfer_config={"kv_connector": "P2pTcpConnector", "kv_role": "kv_consumer",
                                                      "kv_port": port})  # a consumer listens on nothing
    finally:
        holder.close()
    EngineArgs(model="tiny", kv_transfer_config={"kv_connector": "P2pTcpConnector", "kv_role": "kv_producer",
                                                  "kv_port": port})  # free again: taken (bound and let go)


def test_a_listener_a_request_names_cannot_give_other_requests_its_kv():
    """From an adversarial trial: a client that reached the decode server directly named a listener of its
    own in kv_transfer_params; the blocks it served (well-formed, checksummed, noise) entered the prefix
    cache, and the next client's request with the same prompt got them (wrong tokens). Pulled blocks now
    serve their own request only. Reference: an engine without a connector, prefix caching off."""
    import random

    from pagedpack.runtime.kv_connector.tcp_transfer import BlockLayout, KVBlockServer, request_block_hashes

    llm = LLM("tiny", num_blocks=64, kv_transfer_config={"kv_connector": "P2pTcpConnector",
                                                          "kv_role": "kv_consumer"})
    fake = KVBlockServer("127.0.0.1", 0)
    try:
        caches = [c for pair in llm.llm_engine.runner.layer_kv_caches().values() for c in pair]
        layout, block = BlockLayout.of(caches), llm.llm_engine.scheduler.kv_cache_manager.block_size
        prompt = [random.Random(5).randrange(256) for _ in range(5 * block)]
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        honest = LLM("tiny", num_blocks=64, enable_prefix_caching=False)
        reference = honest.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        honest.llm_engine.close()
        fake.expect("evil", 5 * layout.block_bytes)
        noise = torch.randn(5, layout.block_bytes // 4, generator=torch.Generator().manual_seed(0)) * 50
        fake.hold("evil", noise.view(torch.uint8).reshape(5, -1), request_block_hashes(prompt, block, ()),
                  len(prompt), layout)
        attack = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": fake.port,
            "remote_request_id": "evil", "remote_num_tokens": len(prompt)}})
        llm.generate([{"prompt_token_ids": prompt}], attack, use_tqdm=False)
        victim = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert victim == reference
    finally:
        fake.close()
        llm.llm_engine.close()
