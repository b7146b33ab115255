"""Tensor-parallel worker ranks as Ray actors (``distributed_executor_backend="ray"``, vLLM's name).

Ray is imported here only (``pip install 'pagedpack[ray]'``). This process joins the Ray cluster as
vLLM does: the one it is connected to already, else ``ray.init()`` (the cluster ``RAY_ADDRESS`` or
``ray start`` on this machine runs, else a local one it starts). Ranks 1 .. N-1 get one bundle each
of a placement group (``PACK``: on as few nodes as fit), of ``min(1, cluster CPUs / N)`` CPUs,
and one :class:`~pagedpack.runtime.tp_worker.RankActor` each, running this interpreter
(``runtime_env`` ``py_executable``: every node needs pagedpack at the same path, as vLLM's actors
need its environment). The actors connect back to rank 0's command channel and process group on
this node's address as Ray knows it (:func:`ray.util.get_node_ip_address`; gloo must reach it).
"""
from __future__ import annotations

import sys

PLACEMENT_TIMEOUT_S = 60.0  # a cluster without room for the bundles fails after this


class RayRank:
    """One actor serving ``rank``; the interface :class:`pagedpack.runtime.tensor_parallel.TensorParallelWorkers`
    uses of a worker rank (``name``, :meth:`exited`, :meth:`stop`)."""

    def __init__(self, actor, run, rank: int):
        self.actor, self._run, self.name = actor, run, f"pagedpack-tp-rank{rank}"
        self._label = f"{self.name} (Ray actor {actor._actor_id.hex()})"

    def exited(self, timeout_s: float = 0.0) -> str | None:
        """Why the actor's run ended (within ``timeout_s`` seconds), None while it runs."""
        import ray

        done, _ = ray.wait([self._run], timeout=timeout_s)
        if not done:
            return None
        try:
            ray.get(done[0])
        except Exception as err:  # its death (RayActorError), or what it raised
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return f"{self._label} died: {type(err).__name__}: {first[:200]}"
        return f"{self._label} stopped"

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for its run to return (after the stop command), then kill it."""
        import ray

        ray.wait([self._run], timeout=timeout_s)
        ray.kill(self.actor)


class RayRanks:
    """Ranks 1 .. ``tp_size - 1`` as actors (:attr:`ranks`, :class:`RayRank`) in a placement group
    of their own, each running ``RankActor.run(address, port, token, rank)``; :meth:`close`
    removes the group. ``RuntimeError`` naming ``distributed_executor_backend`` if the cluster has
    no room for the bundles within :data:`PLACEMENT_TIMEOUT_S`."""

    def __init__(self, tp_size: int, port: int, token: bytes, address: str):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedpack.runtime.tp_worker import RankActor

        cpus = min(1.0, ray.cluster_resources().get("CPU", 1.0) / tp_size)
        self.group = placement_group([{"CPU": cpus}] * (tp_size - 1), strategy="PACK")
        self._remove = remove_placement_group
        if not ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
            self.close()
            raise RuntimeError(f"distributed_executor_backend: the Ray cluster has no room for {tp_size - 1} bundles "
                               f"of {cpus:g} CPUs (its resources: {ray.cluster_resources()})")
        actor_class = ray.remote(RankActor)
        self.ranks = []
        for rank in range(1, tp_size):
            actor = actor_class.options(
                num_cpus=cpus, runtime_env={"py_executable": sys.executable},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank - 1),
            ).remote()
            self.ranks.append(RayRank(actor, actor.run.remote(address, port, token.hex(), rank), rank))

    def close(self) -> None:
        self._remove(self.group)


def node_address() -> str:
    """This node's address in the Ray cluster (joined here if this process is not yet: :mod:`ray_ranks`)."""
    import ray

    if not ray.is_initialized():
        ray.init()
    return ray.util.get_node_ip_address()
