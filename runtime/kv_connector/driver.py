"""Where the engine calls a KV connector's worker half around a step (the order
:mod:`pagedpack.runtime.kv_connector.base` documents), and how an engine makes its two halves."""
from __future__ import annotations

import hashlib

from pagedpack.runtime.kv_connector.base import KVConnectorBase_V1, KVConnectorRole
from pagedpack.runtime.kv_connector.config import KVTransferConfig
from pagedpack.runtime.kv_connector.factory import KVConnectorFactory
from pagedpack.runtime.scheduler import KVConnectorOutput, SchedulerOutput


def make_connectors(config: KVTransferConfig | None, runner, kv_cache_manager, *, workers=None,
                    num_state_slots: int = 0, model_stamp=None) -> tuple[KVConnectorBase_V1 | None,
                                                                         KVConnectorBase_V1 | None]:
    """``(scheduler half, worker half)`` of ``config``'s connector, or ``(None, None)`` without one. The
    halves of one engine run in one process: both get the same ``shared`` dict (a connector may keep
    state both see there; ``shared["model_fingerprint"]``: a sha256 hex of ``model_stamp``, what tells
    the model's checkpoint apart (:func:`pagedpack.models.aliases.checkpoint_stamp`), None without one),
    the worker half the runner's caches. ``ValueError`` naming
    ``kv_transfer_config`` for an engine a connector cannot serve (tensor-parallel ranks in other
    processes, recurrent layers whose state no block holds)."""
    if config is None:
        return None, None
    if workers is not None:
        raise ValueError("kv_transfer_config: a KV connector moves rank 0's blocks only; expected "
                         "tensor_parallel_size=1")
    if num_state_slots:
        raise ValueError("kv_transfer_config: a model with recurrent layers keeps state no KV block holds; "
                         "expected a model of attention layers only")
    shared: dict = {"model_fingerprint": None if model_stamp is None else
                    hashlib.sha256(repr(model_stamp).encode()).hexdigest()}
    common = dict(block_size=kv_cache_manager.block_size, shared=shared)
    scheduler_half = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER,
                                                         kv_cache_manager=kv_cache_manager, **common)
    worker_half = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, **common)
    worker_half.register_kv_caches(runner.layer_kv_caches())
    return scheduler_half, worker_half


class KVConnectorDriver:
    """Calls ``connector`` (a worker half) around the steps of ``runner``."""

    def __init__(self, connector: KVConnectorBase_V1, runner) -> None:
        self.connector, self.runner = connector, runner

    def before_step(self, output: SchedulerOutput) -> None:
        """Bind the step's metadata and load what it names (before the step's copies and graph)."""
        self.connector.bind_connector_metadata(output.kv_connector_metadata)
        self.connector.start_load_kv(None)
        for name in self.runner.layer_kv_caches():
            self.connector.wait_for_layer_load(name)

    def after_step(self) -> None:
        """The graph ran: offer every layer to save, then release the metadata."""
        if self.runner.program.functional:  # the step returned new caches
            self.connector.register_kv_caches(self.runner.layer_kv_caches())
        for name, kv_layer in self.runner.layer_kv_caches().items():
            self.connector.save_kv_layer(name, kv_layer, None)
        self.connector.wait_for_save()
        self.connector.clear_connector_metadata()

    def finish_step(self, output: SchedulerOutput) -> KVConnectorOutput:
        """The worker half's report: finished saves and loads, failed loads."""
        sending, recving = self.connector.get_finished(output.finished_req_ids)
        return KVConnectorOutput(set(sending or ()), set(recving or ()),
                                 set(self.connector.get_block_ids_with_load_errors()))

    def shutdown(self) -> None:
        self.connector.shutdown()
