"""Joining and leaving the default ``torch.distributed`` process group of tensor-parallel ranks
(gloo), shared by rank 0 (:mod:`pagedpack.runtime.tensor_parallel`) and the workers
(:mod:`pagedpack.runtime.tp_worker`)."""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

TIMEOUT_S = 60.0  # a collective no rank answers fails after this
JOIN_TIMEOUT_S = 60.0  # the workers' start (imports) until they join the group


def init_group(rank: int, world_size: int, address: str, port: int, timeout_s: float, exited=lambda: None) -> None:
    """Join the gloo group at ``address:port`` (rank 0 hosts its store there): the rendezvous waits
    up to :data:`JOIN_TIMEOUT_S` (rank 0 gives up as soon as ``exited()``, polled, describes a worker
    that ended), collectives ``timeout_s``."""
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
    joined = [f"pagedpack/joined/{r}" for r in range(1, world_size)]
    if rank:
        store.set(joined[rank - 1], "1")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not rank and not store.check(joined):
        ended = exited()
        if ended:
            raise RuntimeError(f"{ended} before it joined the group")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not join the group within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
