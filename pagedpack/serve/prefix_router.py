"""Ray Serve request routers for the engine replicas (Ray's custom request router API,
``ray.serve.request_router.RequestRouter``; configured by ``RequestRouterConfig``).

:class:`PrefixAwareRouter` sends a request to the replica that holds the longest cached prefix of
its prompt: the prompt's chained block hashes (:func:`~pagedpack.runtime.block_hash.extend_block_hashes`,
computed by the ingress and passed as the call's ``block_hashes`` keyword: a list of 32-byte
digests, possibly empty) against each replica's cached block hashes. A replica reports those in
its routing stats (the deployment's ``record_routing_stats``, every
``request_routing_stats_period_s``: ``{"block_hashes": [digest, ...], ...}``); as a report is
seconds old, the router also counts the blocks of the requests it sent to a replica in the last
``routed_ttl_s`` seconds (that replica computes them; a report newer than that speaks for itself).
A prefix is matched from the first block up to the first block a replica lacks. Ties and requests
with no hit go to the least loaded of them (Ray's own step after ``choose_replicas``: the lowest
queue length among the first rank's replicas); the other replicas are the next rank, for when
those are full.

:class:`RoundRobinRouter` ignores prefixes (each request to the next replica), for comparison.
"""
from __future__ import annotations

import itertools
import random
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

ROUTED_TTL_S = 10.0


def matched_blocks(block_hashes: list[bytes], cached) -> int:
    """How many of ``block_hashes``, from the first, are in ``cached`` (a set or dict of digests)."""
    n = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        n += 1
    return n


class PrefixAwareRouter(RequestRouter):
    """The replica with the longest cached prefix of the request's ``block_hashes`` first; ties and
    no hit: the least loaded. ``request_router_kwargs``: ``routed_ttl_s`` (float, seconds)."""

    def initialize_state(self, routed_ttl_s: float = ROUTED_TTL_S, **kwargs):
        if kwargs:
            raise ValueError(f"request_router_kwargs: unknown {sorted(kwargs)}; expected only routed_ttl_s")
        self.routed_ttl_s = float(routed_ttl_s)
        self._routed: dict[ReplicaID, dict[bytes, float]] = {}  # replica -> block hash -> when routed
        self._reported: dict[ReplicaID, tuple[list, set]] = {}  # replica -> (its last report's list, as a set)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        block_hashes = _block_hashes(pending_request)
        if not block_hashes or len(candidate_replicas) < 2:
            return [_shuffled(candidate_replicas)]
        now = time.monotonic()
        matched = {}
        for replica in candidate_replicas:
            reported = self._reported_set(replica)
            routed = self._routed.get(replica.replica_id, {})
            recent = {h for h, at in routed.items() if now - at < self.routed_ttl_s}
            matched[replica.replica_id] = matched_blocks(block_hashes, reported | recent)
        best = max(matched.values())
        if best == 0:
            return [_shuffled(candidate_replicas)]
        first = _shuffled([r for r in candidate_replicas if matched[r.replica_id] == best])
        rest = [r for r in candidate_replicas if matched[r.replica_id] != best]
        return [first, rest] if rest else [first]

    def _reported_set(self, replica: RunningReplica) -> set:
        """The block hashes ``replica`` last reported, as a set (made once per report)."""
        reported = (replica.routing_stats or {}).get("block_hashes") or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] is not reported:
            cached = self._reported[replica.replica_id] = (reported, set(reported))
        return cached[1]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        block_hashes = _block_hashes(pending_request)
        if block_hashes:
            now = time.monotonic()
            routed = self._routed.setdefault(replica_id, {})
            for block_hash in block_hashes:
                routed[block_hash] = now
            for block_hash in [h for h, at in routed.items() if now - at >= self.routed_ttl_s]:
                del routed[block_hash]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._routed.pop(replica_id, None)
        self._reported.pop(replica_id, None)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica (by replica id order), whatever its prompt."""

    def initialize_state(self, **kwargs):
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        return [[ordered[next(self._turn) % len(ordered)]]]


def _shuffled(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """``replicas`` in random order: Ray takes the first of equally loaded ones, which would send
    every no-hit request of a light load to the same replica."""
    return random.sample(replicas, len(replicas))


def _block_hashes(pending_request: PendingRequest | None) -> list[bytes]:
    if pending_request is None:
        return []
    return pending_request.kwargs.get("block_hashes") or []
