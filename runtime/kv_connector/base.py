"""The KV connector interface, in vLLM v1's shape (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

A connector moves KV blocks between the engine's own pool and something outside it (an offload tier,
another engine). Like vLLM's, one class has two roles, made as two instances:

* ``SCHEDULER`` (in :class:`pagedpack.runtime.scheduler.Scheduler`): how many tokens past the local
  prefix cache the outside can supply (:meth:`get_num_new_matched_tokens`), what to load into the
  blocks just allocated for them (:meth:`update_state_after_alloc`), the step's instructions to the
  worker (:meth:`build_connector_meta`), whether a finished request's blocks must stay until the worker
  has saved them (:meth:`request_finished`), the KV events of the outside tier (:meth:`take_events`).
* ``WORKER`` (driven by :class:`pagedpack.runtime.engine.LLMEngine` around
  :meth:`pagedpack.runtime.model_runner.ModelRunner.execute`): loads and saves the blocks.

Where pagedpack differs from vLLM: a step is ONE compiled graph, so per-layer hooks cannot interleave
with the layers inside it. The engine calls, for each step that has connector metadata::

    bind_connector_metadata(meta)
    start_load_kv()                       # before the graph (and before the step's block copies)
    wait_for_layer_load(name)             # for every layer name, in order, still before the graph
    get_block_ids_with_load_errors()      # blocks whose load failed: their tokens are recomputed
    <the graph runs>
    save_kv_layer(name, kv_layer, None)   # for every layer, after the graph (attn_metadata: None)
    wait_for_save()                       # may return before the bytes are durable: a connector
                                          # may finish its writes on a thread of its own, overlapping
                                          # the next step, if it copied what it needs out of the pool
    clear_connector_metadata()
    get_finished(finished_req_ids)        # then, every step, metadata or not

A connector must read a block of the pool only on the stepping thread, between the calls above: the
next step may reuse the block for other contents. Layer names are ``"layer.<i>"``, ``i`` the index of
the cache pair in :attr:`ModelRunner.kv_caches` (K of pair ``i`` is ``kv_caches[2 * i]``, V
``kv_caches[2 * i + 1]``); :meth:`register_kv_caches` maps each name to ``(K, V)``, each
``[num_blocks, block_size, num_kv_heads, head_size]`` in the cache's dtype.

Load failures (vLLM's ``get_block_ids_with_load_errors``): a block the worker could not fill (missing,
corrupt) is reported by id; the scheduler then forgets the block's hash and rolls each request holding
it back to the block's first token, dropping what that request sampled in the step, so those tokens are
computed again: a failed load costs time, never a wrong token.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedpack.runtime.kv_connector.config import KVTransferConfig
    from pagedpack.runtime.kv_events import KVCacheEvent
    from pagedpack.runtime.request import Request


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is (vLLM's names)."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 -- a connector subclasses it with its own fields
    """What the scheduler side tells the worker side for one step (a connector's own subclass)."""


class KVConnectorBase_V1(ABC):  # noqa: N801 -- vLLM's name
    """A KV connector (module docstring). ``config``: the engine's :class:`KVTransferConfig`;
    ``role``: which half this instance is; ``block_size``: tokens per KV block of the engine's pool.

    ``cache_loaded_blocks`` (pagedpack's): whether blocks an asynchronous load filled enter the prefix
    cache, for other requests to read; False for a connector whose source the request names (a client
    could name a source of its own and give other requests its KV)."""

    cache_loaded_blocks = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, *, block_size: int, **kwargs: Any) -> None:
        self._kv_transfer_config = config
        self._role = role
        self.block_size = block_size
        self._connector_metadata: KVConnectorMetadata | None = None

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """``ValueError`` naming ``kv_transfer_config.kv_connector_extra_config.<key>`` for options this
        connector does not take (called before the engine is built)."""

    def describe(self) -> str:
        """One line for a server's start-up log: the connector, its role, where it keeps or moves KV."""
        return f"{type(self).__name__} ({self._kv_transfer_config.kv_role})"

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # --- worker side ------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The scheduler's metadata for the step about to run."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The step ran: drop its metadata."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata; ``RuntimeError`` outside a step."""
        if self._connector_metadata is None:
            raise RuntimeError("KV connector: no metadata bound (called outside a step)")
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The pool's caches by layer name (module docstring), once at start and again whenever the
        runner replaces them (a functional program returns new ones each step)."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start loading the blocks the bound metadata names into the pool (before the graph)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer ``layer_name``'s blocks are loaded (before the graph)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: tuple[torch.Tensor, torch.Tensor], attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Start saving layer ``layer_name``'s blocks the metadata names (after the graph).
        ``kv_layer``: its ``(K, V)`` caches; ``attn_metadata``: None (one graph per step)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Every save of the step has read what it needs from the pool (the pool may be reused)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)``: requests whose delayed blocks
        (:meth:`request_finished` returned True) may now be freed, and requests whose asynchronous load
        (``get_num_new_matched_tokens`` returned ``load_kv_async=True``) is complete.
        ``finished_req_ids``: the requests that finished since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Ids of the pool blocks whose load failed since the last call (their tokens are recomputed)."""
        return set()

    def shutdown(self) -> None:
        """Stop background work and release what the connector holds."""

    # --- scheduler side ---------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(num_external_tokens, load_kv_async)``: how many tokens past ``num_computed_tokens`` (those the
        local prefix cache holds, a whole number of blocks) the connector can load, a whole number of
        blocks, leaving at least the request's last token to compute (the scheduler clamps it so); and
        whether they load asynchronously (the request then waits, holding its blocks, until
        :meth:`get_finished` names it in ``finished_recving``). None: not known yet, ask again next step.
        Side-effect free: it may be asked several times for one request."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: list[int], num_external_tokens: int) -> None:
        """The request was given ``blocks`` (its whole block table, in order) and the first
        ``num_computed_tokens + num_external_tokens`` tokens count as computed: remember to load the
        external ones (0: nothing to load)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The worker's instructions for the step ``scheduler_output`` describes
        (:class:`pagedpack.runtime.scheduler.SchedulerOutput`); resets what it collected."""

    def update_connector_output(self, connector_output: Any) -> None:
        """The worker side's report of a step (unused by pagedpack's engine; as vLLM's)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished holding ``block_ids``. Returns ``(delay_free, kv_transfer_params)``: with
        ``delay_free`` the blocks stay allocated until :meth:`get_finished` names the request in
        ``finished_sending``; the params go back to the client (vLLM's ``kv_transfer_params``)."""
        return False, None

    def check_kv_transfer_params(self, request: Request) -> None:
        """``ValueError`` naming ``kv_transfer_params.<field>`` if this connector cannot take the
        ``kv_transfer_params`` ``request`` came with (``SamplingParams.extra_args``, from a client): called when
        the request is made, in any thread, so that it is refused before it is queued. Default: any."""

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The connector's transfer counters for the server's metrics (vLLM's name), or None."""
        return None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of the connector's own tier since the last call (``medium`` its name)."""
        return ()
