"""``OffloadingConnector`` (vLLM's name): a second KV tier for the prefix cache, behind the connector
interface (:mod:`pagedpack.runtime.kv_connector.base`); the tier itself is
:mod:`pagedpack.runtime.kv_connector.offload_tier`.

What goes in: a cached block the pool hands out for other contents (an eviction: LRU prefix blocks,
and the blocks of a preempted request once they age out), copied out of the pool before the step that
reuses it; and, with a watermark, up to :data:`MAX_WATERMARK_SAVES` least recently used cached blocks
per step while fewer than ``watermark x num_blocks`` blocks are free and uncached, so that the
eviction finds them saved already. What comes back: on admission, the blocks past the local prefix
cache that the tier holds, in order (``get_num_new_matched_tokens``), loaded into the blocks allocated
for them before the step (``start_load_kv``). A block the tier cannot give back (gone, corrupt file)
is reported by ``get_block_ids_with_load_errors`` and recomputed.

Preemption thus swaps out lazily: a preempted request's full blocks stay cached in the pool and reach
the tier only if evicted; coming back it takes them from the pool, the tier, or recomputes, in that
order (docs/kv-offload.md has the measurements behind loading rather than recomputing).

Options (``kv_connector_extra_config``; ``--kv-offload-*``): ``kv_offload_size`` (bytes, > 0, at most the
memory the machine has available for a host tier, the folder's free disk space and the tier's blocks in
it for a disk tier), ``kv_offload_dir`` (None: host memory), ``kv_offload_watermark`` (0 <= w < 1).
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, fields

from pagedpack.runtime.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from pagedpack.runtime.kv_connector.offload_tier import FILE_NAME, DiskTier, HostTier, gather_blocks, scatter_block
from pagedpack.runtime.kv_connector.tier_folder import folder_holder
from pagedpack.runtime.memory import available_memory

MAX_WATERMARK_SAVES = 16  # blocks per step: bounds the stepping thread's copy-out time


def _extra_config_name(key: str) -> str:
    """How an option is named in errors when it comes in ``--kv-transfer-config``."""
    return f"kv_transfer_config.kv_connector_extra_config.{key}"


@dataclass
class OffloadingConfig:
    """The ``OffloadingConnector``'s options (module docstring)."""

    kv_offload_size: int = 0
    kv_offload_dir: str | None = None
    kv_offload_watermark: float = 0.0

    @classmethod
    def parse(cls, extra: dict, name=_extra_config_name) -> OffloadingConfig:
        """From ``kv_connector_extra_config``; ``ValueError`` naming ``name(key)``, what was expected and what
        came: a key unknown, a value of the wrong type or range."""
        known = [f.name for f in fields(cls)]
        for key in extra:
            if key not in known:
                raise ValueError(f"{name(key)}: expected one of {known}, got {key!r:.80}")
        size, directory = extra.get("kv_offload_size", 0), extra.get("kv_offload_dir")
        watermark = extra.get("kv_offload_watermark", 0.0)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name('kv_offload_size')}: expected a size in bytes > 0, got {size!r:.80}")
        if directory is not None and not (isinstance(directory, str) and directory):
            raise ValueError(f"{name('kv_offload_dir')}: expected a folder's path or null, got {directory!r:.80}")
        if directory is not None and os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"{name('kv_offload_dir')}: expected a folder, got {directory!r:.80}, which is not one")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"{name('kv_offload_watermark')}: expected a fraction in [0, 1), got {watermark!r:.80}")
        return cls(size, directory, float(watermark))

    def check_medium(self, name=_extra_config_name) -> None:
        """Before the model is loaded: ``ValueError`` naming ``name("kv_offload_size")`` if the size is beyond
        what the tier's medium has room for now (:func:`tier_room`), ``name("kv_offload_dir")`` if another
        live process holds the folder (its lock, :mod:`~pagedpack.runtime.kv_connector.tier_folder`)."""
        holder = None if self.kv_offload_dir is None else folder_holder(self.kv_offload_dir)
        if holder is not None:
            raise ValueError(f"{name('kv_offload_dir')}: expected a folder no other live process uses, got "
                             f"{self.kv_offload_dir!r}, {holder}")
        room, what = tier_room(self.kv_offload_dir)
        if room is not None and self.kv_offload_size > room:
            size = self.kv_offload_size
            raise ValueError(f"{name('kv_offload_size')}: expected at most {what} ({room} bytes), got "
                             f"{size if size < 10**18 else format(size, '.3e')} bytes")


def tier_room(directory: str | None) -> tuple[int | None, str]:
    """``(bytes, what they are)``: the most a tier in ``directory`` (None: host memory) can hold, its folder's
    free disk space and the tier's block files already in it (the nearest existing folder above it if it is
    not there yet), or the memory the machine has available; None where the OS does not say."""
    if directory is None:
        return available_memory(), "the memory this machine has available for a host tier"
    folder = os.path.abspath(directory)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if folder != os.path.abspath(directory):
        return free, f"the free disk space of {folder}, where {directory} would be made"
    held = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(folder)
               if FILE_NAME.match(e.name) and e.is_file(follow_symlinks=False))
    return free + held, f"the free disk space of {folder} and the tier's blocks there"


class OffloadingMetadata(KVConnectorMetadata):
    """One step's work: ``saves`` (``(hash, block_id)``: copy out before the step) and ``loads``
    (``(hash, block_id)``: fill before the step)."""

    def __init__(self, saves: list[tuple[bytes, int]], loads: list[tuple[bytes, int]]) -> None:
        self.saves, self.loads = saves, loads


class OffloadingConnector(KVConnectorBase_V1):
    """The connector (module docstring). Both halves of one engine share the tier (``shared["tier"]``)."""

    def __init__(self, config, role: KVConnectorRole, *, block_size: int, shared: dict, kv_cache_manager=None):
        super().__init__(config, role, block_size=block_size)
        self.options = OffloadingConfig.parse(config.kv_connector_extra_config)
        if "tier" not in shared:
            size, directory = self.options.kv_offload_size, self.options.kv_offload_dir
            if directory is None:
                shared["tier"] = HostTier(size, block_size=block_size)
            else:  # the folder's blocks are kept if an earlier process of this model wrote them
                shared["tier"] = DiskTier(size, directory, block_size=block_size, model=shared.get("model_fingerprint"))
        self.tier = shared["tier"]
        self.kv = kv_cache_manager
        self._loads: list[tuple[bytes, int]] = []
        self._caches: list = []
        self._load_errors: set[int] = set()

    def describe(self) -> str:
        where = f" in {self.tier.directory}" if self.tier.medium == "DISK" else ""
        return (f"{super().describe()}: a {self.tier.medium} tier of {self.tier.capacity / 2**30:.2f} GiB{where}, "
                f"watermark {self.options.kv_offload_watermark}")

    @classmethod
    def check_config(cls, config) -> None:
        """The options (:meth:`OffloadingConfig.parse`), the tier's medium (:meth:`OffloadingConfig.check_medium`)."""
        OffloadingConfig.parse(config.kv_connector_extra_config).check_medium()

    # --- scheduler half --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        hashes = self.kv.block_hashes(request)
        found = 0
        for block_hash in hashes[num_computed_tokens // self.block_size:]:
            if not self.tier.contains(block_hash):
                break
            found += 1
        return found * self.block_size, False

    def update_state_after_alloc(self, request, blocks: list[int], num_external_tokens: int) -> None:
        first = (request.num_computed_tokens - num_external_tokens) // self.block_size
        for j in range(first, first + num_external_tokens // self.block_size):
            self._loads.append((request.block_hashes[j], blocks[j]))

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        saves = [(h, b) for h, b in scheduler_output.evicted_blocks if not self.tier.contains(h)]
        watermark = self.options.kv_offload_watermark
        pool = self.kv.pool
        if watermark and pool.num_free_blocks - pool.num_cached_free_blocks < watermark * pool.num_blocks:
            candidates = pool.lru_cached_free_blocks(MAX_WATERMARK_SAVES * 4)
            saves += [(h, b) for h, b in candidates if not self.tier.contains(h)][:MAX_WATERMARK_SAVES]
        meta = OffloadingMetadata(saves, self._loads)
        self._loads = []
        return meta

    def take_events(self):
        return self.tier.take_events()

    def get_kv_connector_stats(self) -> dict:
        """The tier's :class:`~pagedpack.runtime.kv_connector.offload_tier.OffloadStats` as a dict, and its
        ``medium`` (``"CPU"`` / ``"DISK"``) and ``capacity`` (bytes)."""
        return {**vars(self.tier.stats), "medium": self.tier.medium, "capacity": self.tier.capacity}

    # --- worker half -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._caches = [c for pair in kv_caches.values() for c in pair]
        if not self.tier.block_bytes:
            self.tier.bind_layout(self._caches)

    def start_load_kv(self, forward_context=None, **kwargs) -> None:
        """Copy out the blocks to save (before anything reuses them), then load (the whole step's, not per
        layer: the graph needs every layer)."""
        meta = self._get_connector_metadata()
        if meta.saves:
            start = time.perf_counter()
            payloads = gather_blocks(self._caches, [b for _, b in meta.saves])
            self.tier.stats.save_seconds += time.perf_counter() - start
            self.tier.put([h for h, _ in meta.saves], payloads)
        if meta.loads:
            start = time.perf_counter()
            for block_hash, block_id in meta.loads:
                payload = self.tier.get(block_hash)
                if payload is None:
                    self._load_errors.add(block_id)
                else:
                    scatter_block(self._caches, block_id, payload)
            self.tier.stats.load_seconds += time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: :meth:`start_load_kv` loaded every layer."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """Nothing: the blocks this connector saves were copied out before the step."""

    def wait_for_save(self) -> None:
        """Nothing: the disk writes run on the tier's thread from copies, overlapping the next steps."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER:
            self.tier.close()
