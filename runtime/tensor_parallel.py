"""The ranks of a tensor-parallel ``LLM(..., tensor_parallel_size=N)`` on ``torch.distributed``.

Rank 0 is the ``LLM``'s own process: scheduler, sampler and detokenizer run there once, beside its
shard of the step. Ranks 1 .. N-1 are workers, each building its own shard from the same source
(capture, rewrite, :mod:`pagedpack.passes.tensor_parallel`, lowering; or its file of a
tensor-parallel export) and KV caches of its own heads, then following rank 0. They run
:mod:`pagedpack.runtime.tp_worker`, started by ``distributed_executor_backend``: ``"mp"`` (default)
as processes of this one (``python -m pagedpack.runtime.tp_worker``: the user's script is not
imported again, so it needs no ``if __name__ == "__main__":`` guard), ``"ray"`` as Ray actors in a
placement group (:mod:`pagedpack.runtime.ray_ranks`). The all-reduces inside the step graphs join
the ranks on the default process group (``gloo`` on the CPU, as vLLM's CPU workers).

Commands travel outside the process group, on a TCP connection from rank 0 to each worker
(:mod:`pagedpack.runtime.rank_channel`: a per-engine token, length-prefixed frames): first the
worker's configuration as JSON (its ``EngineArgs``: :meth:`~pagedpack.engine_args.EngineArgs.to_json`;
a model given as an ``nn.Module`` is saved with ``save_pretrained`` to a temporary folder the
workers load, removed at :meth:`TensorParallelWorkers.close`), then per step one message of int64s,
a header ``[command, T, B, max_blocks, R]`` and the step's metadata
(:data:`pagedpack.step.contract.METADATA_INPUTS`, concatenated); block copies, the commit of the KV
pages at a server's start and the stop travel the same way. Nothing is pickled. A worker says
when its program is built, and rank 0 waits for that before the first step (up to
:data:`BUILD_TIMEOUT_S`: a slow build is not a collective's timeout). A worker waits for its next
command without a deadline, so an idle engine stays up; only the collectives time out.

Under a launcher (``distributed_executor_backend="external_launcher"``, vLLM's name: ``torchrun``
starts every rank, each running the same script): no workers and no commands. Each rank joins the
launcher's group (:func:`join_launched_group`), builds its shard and runs a whole engine of its own
on the same requests; the schedulers decide alike and the step's all-reduces keep them in step, so
each rank's sampler sees the same logits and every rank returns the same outputs.

Faults: a worker that fails sends its error text on its channel and ends, and rank 0 raises an
error naming the rank and the error. A worker that dies (a process, a Ray actor) closes its
channel, which rank 0 sees before its next command, or breaks the step's collective (gloo's
closed connection); one that hangs makes the step's all-reduce time out after ``timeout_s``.
Either way rank 0's step raises :class:`~pagedpack.runtime.engine_loop.EngineDeadError` naming the
rank, the engine loop fails every request with it and takes no more (a server's ``/health`` turns
503, also for a worker that dies while idle: :meth:`TensorParallelWorkers.check`). Workers die with
rank 0: a process by ``PR_SET_PDEATHSIG``, an actor with its owner (Ray), both at the channel's end.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedpack.host.child_process import die_with_parent, free_port
from pagedpack.runtime.engine_loop import EngineDeadError
from pagedpack.runtime.process_group import JOIN_TIMEOUT_S, TIMEOUT_S, init_group, leave_group
from pagedpack.runtime.rank_channel import (
    COMMIT,
    COPY,
    READY,
    START,
    STEP,
    STOP,
    TOKEN_ENV,
    RankListener,
    recv_frame,
    send_frame,
)
from pagedpack.step.metadata import StepMetadata

_REPORT_LIMIT = 1 << 12  # bytes of a worker's error text
BUILD_TIMEOUT_S = 600.0  # a worker's build (load, capture, lowering) past rank 0's own
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def join_launched_group(tp_size: int) -> int:
    """This process's rank among the ``tp_size`` a launcher started, in the default process group:
    the caller's if it made one (gloo), else one joined from the launcher's environment (gloo,
    collectives time out after :data:`TIMEOUT_S`; left at exit). ``ValueError`` naming
    ``distributed_executor_backend`` if no launcher started this process, or its world is not ``tp_size``."""
    if not dist.is_initialized():
        missing = [name for name in _LAUNCHER_ENV if name not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend: 'external_launcher' runs ranks a launcher started "
                             f"(torchrun), expected {', '.join(_LAUNCHER_ENV)} in the environment, got no "
                             f"{', '.join(missing)}")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        atexit.register(leave_group)
    if "gloo" not in str(dist.get_backend()):
        raise ValueError(f"distributed_executor_backend: the step's all-reduces run on gloo (CPU), got a process "
                         f"group on {dist.get_backend()!r}")
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tensor_parallel_size: the launcher started {dist.get_world_size()} ranks, got "
                         f"tensor_parallel_size={tp_size}")
    return dist.get_rank()


def group_name() -> str:
    """The name the step graphs' all-reduces give the default process group."""
    return dist.group.WORLD.group_name


class TensorParallelRanks:
    """This process's place among the tensor-parallel ranks of ``args``, on the runtime's side: its
    ``rank`` (0, or under ``external_launcher`` the launcher's, its group joined here) and, on rank 0
    of ``"mp"`` or ``"ray"``, the ``workers`` it starts (None until :meth:`join`, and without tensor
    parallelism). The program builder builds this rank's program and calls :meth:`join` when it
    needs the group; each worker builds its own (:mod:`pagedpack.runtime.tp_worker`)."""

    def __init__(self, args):
        self.args, self.workers = args, None
        launched = args.tensor_parallel_size > 1 and args.distributed_executor_backend == "external_launcher"
        self.rank = join_launched_group(args.tensor_parallel_size) if launched else 0

    def join(self) -> str:
        """The process group's name (:func:`group_name`); rank 0 of ``"mp"`` / ``"ray"`` first starts
        the other ranks (:class:`TensorParallelWorkers`), which join it."""
        if self.rank == 0 and self.args.distributed_executor_backend != "external_launcher" and self.workers is None:
            self.workers = TensorParallelWorkers(self.args)
        return group_name()


class ProcessRank:
    """Worker rank ``rank`` as a process of this one: ``python -m pagedpack.runtime.tp_worker``, in
    a session of its own (Ctrl-C is rank 0's to handle), ending with this process
    (``PR_SET_PDEATHSIG``) and with the command channel."""

    def __init__(self, rank: int, port: int, token: bytes, address: str):
        self.name = f"pagedpack-tp-rank{rank}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedpack.runtime.tp_worker", address, str(port), str(rank)],
            env={**os.environ, TOKEN_ENV: token.hex()}, start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM))

    def exited(self, timeout_s: float = 0.0) -> str | None:
        """How the process ended (waiting up to ``timeout_s`` seconds), None while it runs."""
        try:
            code = self.process.wait(timeout_s) if timeout_s else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        return None if code is None else f"{self.name} (pid {self.process.pid}) exited with code {code}"

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for it to end (after the stop command), else terminate it."""
        for end in (None, self.process.terminate, self.process.kill):
            if end is not None:
                end()
            try:
                self.process.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                pass


class TensorParallelWorkers:
    """Rank 0's end of the worker ranks 1 .. ``tp_size - 1``: started by ``args.distributed_executor_backend``
    (:class:`ProcessRank`; Ray actors, :mod:`pagedpack.runtime.ray_ranks`), each connected on the
    command channel (:mod:`pagedpack.runtime.rank_channel`), given its configuration (the
    ``EngineArgs`` as JSON; a model given as an ``nn.Module`` is saved for them first:
    :func:`_worker_model`) and joined in the default process group (``gloo``, on a free TCP port)
    before the caller builds rank 0's own shard; :meth:`start` then gives them the pool size.
    ``EngineDeadError`` (a ``RuntimeError``) if a worker fails or does not join within
    :data:`JOIN_TIMEOUT_S`; ``ValueError`` naming the argument that cannot reach them."""

    def __init__(self, args, *, timeout_s: float | None = None):
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: this process already has a torch.distributed process group; "
                               "an LLM with tensor_parallel_size > 1 starts and owns its own")
        self.tp_size, self.timeout_s = args.tensor_parallel_size, TIMEOUT_S if timeout_s is None else timeout_s
        ray = args.distributed_executor_backend == "ray"
        self._held = held = _Held()
        self._finalizer = weakref.finalize(self, _shutdown, held)
        atexit.register(self._finalizer)
        model = held.saved = _worker_model(args.model) if isinstance(args.model, torch.nn.Module) else None
        # what only rank 0 uses stays here: a tokenizer instance (it detokenizes), the KV events (its scheduler's)
        tokenizer = args.tokenizer if isinstance(args.tokenizer, (str, os.PathLike)) else None
        config = args.to_json(model=_absolute(model or args.model), tokenizer=_absolute(tokenizer),
                              kv_events_config=None)
        if ray:
            from pagedpack.runtime.ray_ranks import RayRanks, node_address

            address = node_address()
        else:
            address = "127.0.0.1"
        listener = RankListener(address, self.tp_size)
        try:
            if ray:
                held.launcher = RayRanks(self.tp_size, listener.port, listener.token, address)
                held.ranks = held.launcher.ranks
            else:
                held.ranks = [ProcessRank(r, listener.port, listener.token, address) for r in range(1, self.tp_size)]
            conns = listener.accept_all(JOIN_TIMEOUT_S, self._exited)
            held.conns = [conns[rank] for rank in range(1, self.tp_size)]
            port = free_port()
            message = json.dumps({"engine_args": config, "master_addr": address, "master_port": port,
                                  "timeout_s": self.timeout_s}).encode()
            for conn in held.conns:
                send_frame(conn, message)
            init_group(0, self.tp_size, address, port, self.timeout_s, self._exited)
        except Exception as err:
            raise self.failure(err) from err
        finally:
            listener.close()

    @property
    def ranks(self) -> list:
        """The worker ranks 1 .. N-1 (:class:`ProcessRank`, :class:`~pagedpack.runtime.ray_ranks.RayRank`)."""
        return self._held.ranks

    def start(self, num_blocks: int) -> None:
        """Wait until every worker has built its program (up to :data:`BUILD_TIMEOUT_S`: a build is
        no collective), then have each allocate its KV caches for ``num_blocks`` blocks and wait for steps."""
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for rank, conn in zip(self.ranks, self._held.conns):
            while not select.select([conn], [], [], 0.5)[0]:
                if self._exited() or time.monotonic() > deadline:
                    raise self.failure(TimeoutError(f"{rank.name} did not build its program within "
                                                    f"{BUILD_TIMEOUT_S:.0f} s"))
            frame = _reported(conn, decode=False)
            if frame != READY:
                raise self.failure(RuntimeError(f"{rank.name} closed its command channel"),
                                   reported=[frame.decode(errors="replace")] if frame else [])
        self._send([START, num_blocks, 0, 0, 0])

    def step(self, batch: StepMetadata) -> None:
        """Send one step's metadata; each worker runs its shard of the step on it."""
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        width, rows = batch.block_table.shape[1], batch.logits_indices.shape[0]
        self._send([STEP, num_tokens, num_seqs, width, rows], [t.reshape(-1).to(torch.int64) for t in batch])

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        self._send([COPY, len(blocks_to_copy), 0, 0, 0], [torch.tensor(blocks_to_copy, dtype=torch.int64).reshape(-1)])

    def check(self) -> None:
        """``EngineDeadError`` if a worker has ended (an idle engine's health check)."""
        if self._exited() or self._closed():
            raise self.failure(RuntimeError("a worker rank is gone"))

    def commit_kv_memory(self) -> None:
        self._send([COMMIT, 0, 0, 0, 0])

    def close(self) -> None:
        """Stop the workers, leave the group (also when this object is collected, or at exit), remove
        a Ray placement group and the model saved for the workers."""
        self._finalizer()

    def _send(self, header: list[int], payload: list[torch.Tensor] = ()) -> None:
        message = torch.cat([torch.tensor(header, dtype=torch.int64), *payload]).numpy().tobytes()
        try:
            if self._closed():
                raise RuntimeError("a worker rank closed its command channel")
            for conn in self._held.conns:
                send_frame(conn, message)
        except Exception as err:
            raise self.failure(err) from err

    def _exited(self) -> str | None:
        """The first worker rank found ended (how), else None."""
        return next(filter(None, (rank.exited() for rank in self.ranks)), None)

    def _closed(self) -> list[int]:
        """The indices of the workers whose channel has something to read: their end closed, or an
        error report (a worker sends nothing else)."""
        conns = self._held.conns
        readable = set(select.select(conns, [], [], 0)[0]) if conns else set()
        return [i for i, conn in enumerate(conns) if conn in readable]

    def failure(self, err: BaseException, reported: list[str] = ()) -> EngineDeadError:
        """The error to raise for ``err``, a collective (a broadcast here, or an all-reduce of the
        step) or command that failed: which workers ended and what they reported (``reported``: read
        already), else ``err`` itself. An :class:`~pagedpack.runtime.engine_loop.EngineDeadError`: the
        engine cannot step again."""
        closed = self._closed()
        reported = [*reported, *(text for text in map(_reported, self._held.conns) if text)]
        ended = [rank.exited(timeout_s=0.5) or (f"{rank.name} closed its command channel" if i in closed else None)
                 for i, rank in enumerate(self.ranks)]  # a killed worker's exit, once the OS or Ray has it
        why = "; ".join([e for e in ended if e] + reported) or f"{type(err).__name__}: {str(err)[:300]}"
        if self._finalizer.detach():  # the ranks cannot step together again: no stop command, end the rest
            _shutdown(self._held, stop=False)
        return EngineDeadError(f"tensor_parallel_size: a worker rank stopped answering ({why})")


@dataclass
class _Held:
    """What rank 0 holds for its workers, until :func:`_shutdown`: the ranks, their command
    channels, a Ray launcher, the folder of a model saved for them."""

    ranks: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    launcher: object = None
    saved: str | None = None


def _worker_model(module: torch.nn.Module) -> str:
    """A temporary directory holding ``module`` as ``save_pretrained`` writes it (safetensors and a
    config: the workers load it, nothing pickled); ``ValueError`` naming ``model`` for a module
    ``transformers`` cannot save."""
    if not callable(getattr(module, "save_pretrained", None)):
        raise ValueError(f"model: worker ranks load the model in their own processes; expected a model id or path, "
                         f"or a transformers PreTrainedModel (saved for them), got {type(module).__name__}")
    from pagedpack.models.aliases import no_progress_bars

    folder = tempfile.mkdtemp(prefix="pagedpack-tp-model-")
    try:
        with no_progress_bars():
            module.save_pretrained(folder)
    except Exception as err:
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError(f"model: worker ranks load the model in their own processes, and saving "
                         f"{type(module).__name__} for them failed ({type(err).__name__}: {str(err)[:300]}); "
                         f"give its directory or hub id") from err
    return folder


def _absolute(name):
    """A local path made absolute (a Ray actor runs in a folder of its own); a model alias, a hub id
    or None as it is."""
    from pagedpack.models.aliases import DEFAULT_MODEL, alias_names

    if not isinstance(name, (str, os.PathLike)) or name in (*alias_names(), DEFAULT_MODEL) or not os.path.exists(name):
        return name
    return os.path.abspath(name)


def _reported(conn, decode: bool = True) -> str | bytes | None:
    """The next frame a worker sent on ``conn`` within a second (its error text, or :data:`READY`),
    decoded unless not ``decode``; None if none came, or it closed without one."""
    try:
        if not select.select([conn], [], [], 1.0)[0]:
            return None
        conn.settimeout(1.0)
        frame = recv_frame(conn, _REPORT_LIMIT)
        conn.settimeout(None)
    except (OSError, ValueError):
        return None
    return frame.decode(errors="replace") if frame and decode else frame


def _shutdown(held: _Held, stop: bool = True) -> None:
    """Send the stop command if ``stop`` (else only close the channels: a worker reads their end),
    leave the group, then wait for the workers, else end them; remove what was made for them."""
    conns, held.conns = held.conns, []
    for conn in conns:
        try:
            if stop:
                send_frame(conn, torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64).numpy().tobytes())
            conn.close()
        except OSError:  # a worker gone already
            pass
    leave_group()
    for rank in held.ranks:
        rank.stop(timeout_s=5)
    if held.launcher is not None:
        held.launcher.close()
    if held.saved is not None:
        shutil.rmtree(held.saved, ignore_errors=True)
