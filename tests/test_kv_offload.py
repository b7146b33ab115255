"""The OffloadingConnector's second KV tier (runtime/kv_connector/offload_tier.py, offloading_connector.py):
prefix blocks evicted from a pool too small for the workload come back from the tier with the
unmodified model's tokens; corrupt, truncated and misnamed block files are misses (recomputed); a
writer killed mid-save leaves a folder the next process reads; the tiers' LRU bound and events."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedpack import LLM, SamplingParams
from pagedpack.engine_args import EngineArgs
from pagedpack.models.tiny import default_model
from pagedpack.runtime.kv_connector.offload_tier import DiskTier, HostTier
from pagedpack.runtime.kv_connector.tier_folder import folder_holder
from pagedpack.runtime.scheduler import SchedulerOutput
from pagedpack.serve.metrics import ServerMetrics

from conftest import greedy_alone, random_prompts, run_cli

BLOCK = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def workload():
    """6 prompts over 3 shared 32-token prefixes: 24+ blocks of prefixes for a pool of 24 blocks."""
    prefixes, suffixes = random_prompts([32, 32, 32], seed=1), random_prompts([3] * 6, seed=2)
    prompts = [prefixes[i % 3] + suffixes[i] for i in range(6)]
    return prompts, greedy_alone(default_model()[0], prompts, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tier")
    llm = LLM("tiny", block_size=BLOCK, num_blocks=24, max_num_seqs=2, max_num_batched_tokens=64,
              kv_offload_size=1 << 20, kv_offload_dir=str(folder))
    yield llm
    llm.llm_engine.close()


def tier_of(llm) -> DiskTier:
    return llm.llm_engine.scheduler.connector.tier


def run(llm, prompts, reset=True):
    """Tokens of ``prompts``, with the local prefix cache emptied first (``reset``: what it held must come
    from the tier or be recomputed), and the tokens the tier supplied."""
    engine = llm.llm_engine
    assert not reset or engine.reset_prefix_cache()
    before = engine.scheduler.connector_prefix_cache_stats.hits
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tier_of(llm).flush()
    return [o.outputs[0].token_ids for o in outs], engine.scheduler.connector_prefix_cache_stats.hits - before


def test_prefixes_beyond_the_pool_come_back_from_the_tier(llm, workload):
    prompts, reference = workload
    got, _ = run(llm, prompts)
    assert got == reference
    assert tier_of(llm).stats.saves > 0  # the pool evicted prefix blocks into the tier
    got, from_tier = run(llm, prompts, reset=False)
    assert got == reference and from_tier >= 32  # a whole prefix's worth of tokens evicted and loaded back
    stats = llm.get_stats()
    assert stats.kv_blocks_used == 0 and stats.external_prefix_cache_hits >= from_tier
    text = ServerMetrics(llm._loop, model_name="m").exposition().decode()
    tier = tier_of(llm).stats
    assert f'pagedpack:kv_offload_loads_total{{medium="DISK",model_name="m"}} {float(tier.loads)}' in text
    assert f'pagedpack:kv_offload_bytes_used{{medium="DISK",model_name="m"}} {float(tier.bytes_used)}' in text
    assert f'pagedpack:external_prefix_cache_hits_total{{model_name="m"}} {float(stats.external_prefix_cache_hits)}' \
        in text


def test_corrupt_truncated_and_misnamed_files_are_misses(llm, workload):
    prompts, reference = workload
    run(llm, prompts)
    tier = tier_of(llm)
    folder = tier.directory
    names = sorted(n for n in os.listdir(folder) if n.endswith(".kvblock"))
    assert len(names) >= 4
    flipped, truncated, moved, target = (os.path.join(folder, n) for n in names[:4])
    with open(flipped, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    os.replace(moved, target)  # a file under another block's name
    corrupt = tier.stats.corrupt
    got, from_tier = run(llm, prompts)
    assert got == reference and from_tier > 0
    # the misnamed file and the flipped and truncated ones, if asked for (the moved one is simply gone)
    assert tier.stats.corrupt > corrupt
    assert not any(n.startswith(".tmp-") for n in os.listdir(folder))


def test_watermark_saves_ahead_of_eviction(llm):
    connector = llm.llm_engine.scheduler.connector
    pool = llm.llm_engine.scheduler.kv_cache_manager.pool
    run(llm, random_prompts([30, 30], seed=9))  # leaves cached blocks nobody owns, never evicted
    assert pool.num_free_blocks - pool.num_cached_free_blocks < 0.9 * pool.num_blocks
    assert not connector.build_connector_meta(SchedulerOutput([], [], 0)).saves  # no eviction, no watermark
    connector.options.kv_offload_watermark = 0.9
    try:  # below the watermark: the least recently used ones the tier lacks are copied out
        meta = connector.build_connector_meta(SchedulerOutput([], [], 0))
    finally:
        connector.options.kv_offload_watermark = 0.0
    lru = [(h, b) for h, b in pool.lru_cached_free_blocks(pool.num_blocks) if not connector.tier.contains(h)]
    assert meta.saves and meta.saves == lru[:len(meta.saves)]


WRITER = textwrap.dedent("""
    import hashlib, sys, torch
    from pagedpack.runtime.kv_connector.offload_tier import DiskTier
    tier = DiskTier(1 << 30, sys.argv[1], model="writer")
    tier.bind_layout([torch.zeros(4, 4, 2, 1024)])
    i = 0
    while True:
        h = hashlib.sha256(str(i).encode()).digest()
        tier.put([h], torch.tensor(list(h) * (tier.block_bytes // 32), dtype=torch.uint8)[None])
        i += 1
        if i == 8:
            tier.flush()
            print("ready", flush=True)
""")


def test_a_writer_killed_mid_save_leaves_a_readable_tier(tmp_path):
    folder = str(tmp_path / "tier")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, folder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tier = DiskTier(1 << 30, folder, model="writer")
    try:
        tier.bind_layout([torch.zeros(4, 4, 2, 1024)])
        assert not any(n.startswith(".tmp-") for n in os.listdir(folder))  # a half-written file removed
        good = 0
        for i in range(len(os.listdir(folder)) + 64):
            h = hashlib.sha256(str(i).encode()).digest()
            payload = tier.get(h)
            if payload is not None:
                assert payload.tolist() == list(h) * (tier.block_bytes // 32)
                good += 1
        assert good >= 8 and tier.stats.corrupt == 0
    finally:
        tier.close()


def test_tiers_evict_least_recently_used_and_say_their_medium(tmp_path):
    caches = [torch.zeros(8, 4, 1, 2)]
    payloads = torch.arange(3 * 32, dtype=torch.uint8).reshape(3, 32)
    hashes = [bytes([i]) * 32 for i in range(3)]
    host = HostTier(64)  # two blocks of 32 bytes
    host.bind_layout(caches)
    host.put(hashes[:2], payloads[:2])
    assert host.get(hashes[0]).tolist() == payloads[0].tolist()  # hashes[0] now the most recent
    host.put(hashes[2:], payloads[2:])
    assert host.get(hashes[1]) is None and host.get(hashes[2]).tolist() == payloads[2].tolist()
    events = host.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved"]
    assert {e.medium for e in events} == {"CPU"} and events[-1].block_hashes == [hashes[1]]
    disk = DiskTier(10_000, str(tmp_path))
    try:
        disk.bind_layout(caches)
        disk.put(hashes, payloads)
        disk.flush()
        assert {e.medium for e in disk.take_events()} == {"DISK"}
        assert sorted(os.listdir(tmp_path)) == sorted([h.hex() + ".kvblock" for h in hashes] + ["tier.json",
                                                                                              "tier.lock"])
    finally:
        disk.close()


def test_options_errors_name_the_option(tmp_path):
    (tmp_path / "file").write_text("")
    for kwargs, name in [({"kv_offload_size": "1MiB", "kv_offload_watermark": 1.0}, "kv_offload_watermark"),
                         ({"kv_offload_dir": str(tmp_path)}, "kv_offload_dir"),
                         ({"kv_offload_size": "1MiB", "kv_offload_dir": str(tmp_path / "file")}, "kv_offload_dir"),
                         ({"kv_offload_size": 0}, "kv_offload_size"),
                         ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                                  "kv_connector_extra_config": {"kv_offload_size": 8, "size": 1}}},
                          "kv_transfer_config.kv_connector_extra_config.size")]:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            EngineArgs(model="tiny", **kwargs)


def test_a_tier_beyond_the_machine_s_memory_or_disk_is_refused_before_the_model_loads(tmp_path, capsys,
                                                                                      monkeypatch):
    """From an adversarial trial: --kv-offload-size 1e99 failed once the model had loaded, naming no flag.
    The machine's figures are pinned (10**6 bytes of memory available, 5000 bytes of free disk) so that the
    limits are exact: a disk tier may also take the room of its own blocks already in its folder."""
    flag = r"^kv_offload_size \(--kv-offload-size\): "
    code, _, err = run_cli(capsys, "serve", "--model", "tiny", "--kv-offload-size", "1e99")  # the real machine
    assert code == 2 and re.search(flag[1:] + r"expected at most the memory this machine has available for a "
                                              r"host tier \(\d+ bytes\), got 1.000e\+99 bytes$", err, re.M), err
    monkeypatch.setattr("pagedpack.runtime.kv_connector.offloading_connector.available_memory", lambda: 10**6)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 5000, 5000))
    (tmp_path / ("ab" * 32 + ".kvblock")).write_bytes(b"x" * 1000)  # a block of an earlier process
    (tmp_path / "notes.txt").write_bytes(b"x" * 700)  # not the tier's
    new = tmp_path / "new" / "tier"
    folder = re.escape(str(tmp_path))
    for kwargs, expected in [
            ({"kv_offload_size": 10**6 + 1}, r"expected at most the memory this machine has available for a "
                                             r"host tier \(1000000 bytes\), got 1000001 bytes$"),
            ({"kv_offload_size": 6001, "kv_offload_dir": tmp_path},
             rf"expected at most the free disk space of {folder} and the tier's blocks there \(6000 bytes\), "
             r"got 6001 bytes$"),
            ({"kv_offload_size": "1e99", "kv_offload_dir": tmp_path},
             r"expected at most .* \(6000 bytes\), got 1.000e\+99 bytes$"),
            ({"kv_offload_size": 5001, "kv_offload_dir": new},
             rf"expected at most the free disk space of {folder}, where {re.escape(str(new))} would be made "
             r"\(5000 bytes\), got 5001 bytes$"),
            *[({"kv_offload_size": bad}, rf"expected a positive number of bytes .*, got {re.escape(repr(bad))}$")
              for bad in ("inf", "nan", "-1", "1e-3", "lots", float("inf"), -5)]]:
        with pytest.raises(ValueError, match=flag + expected):
            EngineArgs(model="tiny", **kwargs)
    for kwargs in ({"kv_offload_size": 10**6}, {"kv_offload_size": 6000, "kv_offload_dir": tmp_path},
                   {"kv_offload_size": 5000, "kv_offload_dir": new}):
        EngineArgs(model="tiny", **kwargs)  # at the limit: taken


# From an adversarial trial of the disk tier: files replaced while serving, and the writer's temporary
# name predicted.
@pytest.fixture
def disk_llm(tmp_path):
    llm = LLM("tiny", kv_offload_size=20 * 4299, kv_offload_dir=str(tmp_path), block_size=4, num_blocks=24,
              max_num_seqs=2, max_num_batched_tokens=64)
    yield llm, llm.llm_engine.scheduler.connector.tier
    llm.llm_engine.close()


def _bounded(fn, seconds: float):
    """``fn()``'s value, asserting it returned within ``seconds`` (a hang fails the test, not the run)."""
    import threading

    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert "value" in box, f"did not return within {seconds} s (or raised)"
    return box["value"]


def _shared_prefix_prompts(seed: int = 1):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(32)] for _ in range(3)]
    return [{"prompt_token_ids": prefixes[i % 3] + [7, i, 9]} for i in range(6)]


def _greedy_tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0),
                                                          use_tqdm=False)]


@pytest.mark.parametrize("replacement", ["directory", "fifo"])
def test_block_files_replaced_while_serving_are_misses(disk_llm, replacement):
    """A block file replaced by a directory failed the step; by a FIFO, blocked the stepping thread."""
    llm, tier = disk_llm
    reference = _greedy_tokens(llm, _shared_prefix_prompts())
    tier.flush()
    assert tier._index
    for block_hash in list(tier._index):
        path = tier._path(block_hash)
        os.unlink(path)
        os.mkdir(path) if replacement == "directory" else os.mkfifo(path)
    llm.llm_engine.reset_prefix_cache()
    assert _bounded(lambda: _greedy_tokens(llm, _shared_prefix_prompts()), 60) == reference


def test_the_writer_survives_a_victim_it_cannot_remove(disk_llm):
    """An LRU victim that is a directory killed the writer thread; every later save then stayed in memory."""
    llm, tier = disk_llm
    _greedy_tokens(llm, _shared_prefix_prompts())
    tier.flush()
    victim = tier._path(next(iter(tier._index)))
    os.unlink(victim)
    os.mkdir(victim)
    rng = random.Random(0)
    for _ in range(4):
        _greedy_tokens(llm, [{"prompt_token_ids": [rng.randrange(256) for _ in range(40)]} for _ in range(6)])
    _bounded(tier.flush, 30)
    assert tier._writer.is_alive()


def test_the_writer_writes_nothing_outside_its_folder(tmp_path):
    """A symlink planted under the temporary name the writer used (predictable from a prompt's block hash,
    the pid and the thread) made it overwrite the file the link names."""
    folder, outside = tmp_path / "tier", tmp_path / "outside.txt"
    outside.write_text("important data\n")
    tier = DiskTier(1 << 20, str(folder))
    tier.bind_layout([torch.zeros(4, 4, 2, 16)])
    block_hash = bytes(range(32))
    os.symlink(outside, folder / f".tmp-{block_hash.hex()}-{os.getpid()}-{tier._writer.ident}")
    tier.put([block_hash], torch.full((1, tier.block_bytes), 65, dtype=torch.uint8))
    tier.flush()
    tier.close()
    assert outside.read_text() == "important data\n"
    assert not (folder / f"{block_hash.hex()}.kvblock").is_symlink()


def test_a_folder_keeps_its_blocks_for_the_same_model_only(tmp_path):
    """From an adversarial trial: a folder another model filled (same layout, other weights) gave that
    model's blocks, and wrong tokens. ``tier.json`` names the model; another's, or an unknown one's
    (no checkpoint stamp), blocks are removed at start. References: the unmodified models one prompt at
    a time."""
    from pagedpack.models.tiny import tiny_model
    from pagedpack.models.tokenizer import byte_level_tokenizer

    folder = str(tmp_path / "tier")
    kw = dict(tokenizer=byte_level_tokenizer(), block_size=4, num_blocks=24, max_num_seqs=2,
              max_num_batched_tokens=64, kv_offload_size=1 << 20, kv_offload_dir=folder)
    prompts = _shared_prefix_prompts()
    for seed in (0, 1):  # model 1 starts on the folder model 0 filled
        module = tiny_model(seed=seed)
        expected = greedy_alone(module, [p["prompt_token_ids"] for p in prompts], 6)
        llm = LLM(module, **kw)
        got = _greedy_tokens(llm, prompts) + _greedy_tokens(llm, prompts)
        llm.llm_engine.scheduler.connector.tier.flush()
        llm.llm_engine.close()
        assert got == expected + expected, seed
    blocks = [f for f in os.listdir(folder) if f.endswith(".kvblock")]
    assert blocks
    layout = [torch.zeros(4, 4, 2, 16)]
    for model, kept in (("a", False), ("a", True), ("b", False), (None, False)):
        tier = DiskTier(1 << 20, folder, model=model)
        tier.bind_layout(layout)
        assert bool(tier._index) == kept, (model, kept)
        tier.put([bytes(32)], torch.zeros((1, tier.block_bytes), dtype=torch.uint8))
        tier.flush()
        tier.close()


class _FullDisk:
    """A file whose first ``write`` stores half its bytes and then fails as a full disk does."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_write_the_disk_has_no_room_for_leaves_no_temporary_file(tmp_path, monkeypatch):
    """From an adversarial trial: a failed write (ENOSPC) left ``.tmp-*`` files until a restart (the
    manifest's did). Every write through a temporary file removes it when it fails; the block is not
    kept (a miss), the writer goes on, and once there is room again blocks are written."""
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: (
        _FullDisk(real_fdopen(fd, mode, *a, **k)) if "w" in mode else real_fdopen(fd, mode, *a, **k)))
    with pytest.raises(OSError, match="No space left on device"):  # the manifest, at start
        DiskTier(1 << 20, str(tmp_path), model="m")
    assert sorted(os.listdir(tmp_path)) == ["tier.lock"]
    assert folder_holder(str(tmp_path)) is None  # the failed start let the folder's lock go
    monkeypatch.undo()
    tier = DiskTier(1 << 20, str(tmp_path), model="m")
    try:
        tier.bind_layout([torch.zeros(4, 4, 2, 16)])
        full, later = bytes(range(32)), bytes(range(1, 33))
        monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: (
            _FullDisk(real_fdopen(fd, mode, *a, **k)) if "w" in mode else real_fdopen(fd, mode, *a, **k)))
        tier.put([full], torch.full((1, tier.block_bytes), 7, dtype=torch.uint8))
        tier.flush()
        assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path)), os.listdir(tmp_path)
        assert not tier.contains(full) and tier.get(full) is None and tier.stats.saves == 0
        monkeypatch.undo()
        tier.put([later], torch.full((1, tier.block_bytes), 9, dtype=torch.uint8))
        tier.flush()
        assert tier._writer.is_alive() and tier.get(later).tolist() == [9] * tier.block_bytes
        assert sorted(os.listdir(tmp_path)) == sorted([later.hex() + ".kvblock", "tier.json", "tier.lock"])
    finally:
        tier.close()


HOLDER = textwrap.dedent("""
    import sys, torch
    from pagedpack.runtime.kv_connector.offload_tier import DiskTier
    tier = DiskTier(1 << 20, sys.argv[1], model="model-a")
    tier.bind_layout([torch.zeros(4, 4, 2, 16)])
    tier.put([bytes(32)], torch.ones((1, tier.block_bytes), dtype=torch.uint8))
    tier.flush()
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_a_folder_another_live_process_holds_is_refused_and_a_dead_one_s_is_not(tmp_path, capsys):
    """From an adversarial trial: two processes of different models on one --kv-offload-dir each took the
    folder (the second removed the first's blocks and temporary files under it, and could read blocks the
    first wrote later). The folder's lock refuses the second before its model loads, naming the holder;
    once the holder is killed the lock is gone with it."""
    folder = str(tmp_path / "tier")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        held = rf"expected a folder no other live process uses, got '{re.escape(folder)}', which process " \
               rf"{proc.pid} \(model 'model-a'\) holds \(tier.lock\)$"
        with pytest.raises(ValueError, match=r"^kv_offload_dir \(--kv-offload-dir\): " + held):
            EngineArgs(model="tiny", kv_offload_size="1MiB", kv_offload_dir=folder)
        with pytest.raises(ValueError, match=r"^kv_transfer_config.kv_connector_extra_config.kv_offload_dir: " + held):
            EngineArgs(model="tiny", kv_transfer_config={"kv_connector": "OffloadingConnector",
                                                          "kv_connector_extra_config": {"kv_offload_size": 2**20,
                                                                                        "kv_offload_dir": folder}})
        with pytest.raises(ValueError, match="^kv_offload_dir: " + held):  # the tier itself (started meanwhile)
            DiskTier(1 << 20, folder, model="model-b")
        assert os.path.exists(os.path.join(folder, bytes(32).hex() + ".kvblock"))  # the holder's block is left
    finally:
        proc.kill()
        proc.wait()
    EngineArgs(model="tiny", kv_offload_size="1MiB", kv_offload_dir=folder)  # a dead holder's lock is gone
    code, _, err = run_cli(capsys, "serve", "--model", "tiny", "--data-parallel-size", "2", "--kv-offload-size",
                           "1MiB", "--kv-offload-dir", folder)  # replicas would share it
    assert code == 2 and "--kv-offload-dir: a folder serves one live process (its lock); expected none with " \
                         "--data-parallel-size 2" in err
    tier = DiskTier(1 << 20, folder, model="model-b")
    try:
        assert not tier._index  # model a's block removed: this folder is model b's now
    finally:
        tier.close()

