"""The ranks of a tensor-parallel ``LLM(..., tensor_parallel_size=N)`` on ``torch.distributed``.

Rank 0 is the ``LLM``'s own process: scheduler, sampler and detokenizer run there once, beside its
shard of the step. Ranks 1 .. N-1 are worker processes (``torch.multiprocessing``, spawned), each
building its own shard from the same source (capture, rewrite, :mod:`pagedpack.passes.tensor_parallel`,
lowering) and KV caches of its own heads, then following rank 0. The all-reduces inside the step
graphs join the ranks on the default process group (``gloo`` on the CPU, as vLLM's CPU workers).

Commands travel outside the process group, on a pipe from rank 0 to each worker: per step one
message of int64s, a header ``[command, T, B, max_blocks, R]`` and the step's metadata
(:data:`pagedpack.step.contract.METADATA_INPUTS`, concatenated); block copies, the commit of the KV
pages at a server's start and the stop travel the same way. Nothing is pickled after start-up (a
worker takes its ``EngineArgs`` from rank 0 when spawned). A worker waits for its next command
without a deadline, so an idle engine stays up; only the collectives time out.

Under a launcher (``distributed_executor_backend="external_launcher"``, vLLM's name: ``torchrun``
starts every rank, each running the same script): no workers and no commands. Each rank joins the
launcher's group (:func:`join_launched_group`), builds its shard and runs a whole engine of its own
on the same requests; the schedulers decide alike and the step's all-reduces keep them in step, so
each rank's sampler sees the same logits and every rank returns the same outputs.

Faults: a worker that fails sends its error text on a pipe of its own and exits, and rank 0 raises
an error naming the rank and the error. A worker that dies breaks the next command or collective
(a closed pipe, gloo's closed connection); one that hangs makes the step's all-reduce time out
after ``timeout_s``. Either way rank 0's step raises
:class:`~pagedpack.runtime.engine_loop.EngineDeadError`, the engine loop fails every request with
it and takes no more (a server's ``/health`` turns 503, also for a worker that dies while idle:
:meth:`TensorParallelWorkers.check`). Workers die with rank 0 (``PR_SET_PDEATHSIG``, and the
command pipe's end).
"""
from __future__ import annotations

import atexit
import datetime
import os
import signal
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedpack.host.child_process import exit_with_parent, free_port
from pagedpack.runtime.engine_loop import EngineDeadError
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import StepMetadata

TIMEOUT_S = 60.0  # a collective no rank answers fails after this
JOIN_TIMEOUT_S = 60.0  # the workers' start (imports) until they join the group
_START, _STEP, _COPY, _COMMIT, _STOP = range(5)


# A worker spawned from a script whose LLM is built at import time exits before it can report.
_SPAWN_HINT = ("; a script that starts tensor-parallel ranks builds its LLM under `if __name__ == \"__main__\":`, "
               "as every spawned process requires (the worker imports the script again)")
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
        atexit.register(_leave_group)
    if "gloo" not in str(dist.get_backend()):
        raise ValueError(f"distributed_executor_backend: the step's all-reduces run on gloo (CPU), got a process "
                         f"group on {dist.get_backend()!r}")
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tensor_parallel_size: the launcher started {dist.get_world_size()} ranks, got "
                         f"tensor_parallel_size={tp_size}")
    return dist.get_rank()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def group_name() -> str:
    """The name the step graphs' all-reduces give the default process group."""
    return dist.group.WORLD.group_name


class TensorParallelRanks:
    """This process's place among the tensor-parallel ranks of ``args``, on the runtime's side: its
    ``rank`` (0, or under ``external_launcher`` the launcher's, its group joined here) and, on rank 0
    of ``"mp"``, the ``workers`` it starts (None until :meth:`join`, and without tensor parallelism).
    The program builder builds this rank's program and calls :meth:`join` when it needs the group;
    each worker builds its own with ``build(args, rank)``."""

    def __init__(self, args, build):
        self.args, self.build, self.workers = args, build, None
        launched = args.tensor_parallel_size > 1 and args.distributed_executor_backend == "external_launcher"
        self.rank = join_launched_group(args.tensor_parallel_size) if launched else 0

    def join(self) -> str:
        """The process group's name (:func:`group_name`); rank 0 of ``"mp"`` first starts the other
        ranks (:class:`TensorParallelWorkers`), which join it."""
        if self.rank == 0 and self.args.distributed_executor_backend == "mp" and self.workers is None:
            self.workers = TensorParallelWorkers(self.args, self.build)
        return group_name()


class TensorParallelWorkers:
    """Rank 0's end of the worker processes. Spawns ranks 1 .. ``tp_size - 1``, each building its
    program with ``build(args, rank)`` (a module-level function: it travels by name), and joins
    them in the default process group (``gloo``, on a free local TCP port) before the caller
    builds rank 0's own shard; :meth:`start` then gives them the pool size. ``EngineDeadError`` (a
    ``RuntimeError``) if a worker fails or does not join within ``timeout_s``."""

    def __init__(self, args, build, *, timeout_s: float | None = None):
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: this process already has a torch.distributed process group; "
                               "an LLM with tensor_parallel_size > 1 starts and owns its own")
        self.tp_size, self.timeout_s = args.tensor_parallel_size, TIMEOUT_S if timeout_s is None else timeout_s
        timeout_s = self.timeout_s
        context = mp.get_context("spawn")
        port = free_port()
        self._errors, self._commands, self._procs = [], [], []
        for rank in range(1, self.tp_size):
            errors, error_end = context.Pipe(duplex=False)  # a worker's error text, as bytes (nothing unpickled)
            command_end, commands = context.Pipe(duplex=False)
            self._procs.append(context.Process(target=_worker_main, name=f"pagedpack-tp-rank{rank}", daemon=True,
                                               args=(rank, args, build, port, timeout_s, os.getpid(), command_end,
                                                     error_end)))
            self._procs[-1].start()
            error_end.close()
            command_end.close()
            self._errors.append(errors)
            self._commands.append(commands)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._commands)
        atexit.register(self._finalizer)  # at exit before multiprocessing's own hook, which would kill them
        try:
            _init_group(0, self.tp_size, port, timeout_s, self._procs)
        except Exception as err:
            raise self.failure(err, hint=_SPAWN_HINT) from err

    def start(self, num_blocks: int) -> None:
        """Have every worker allocate its KV caches for ``num_blocks`` blocks and wait for steps."""
        self._send([_START, num_blocks, 0, 0, 0])

    def step(self, batch: StepMetadata) -> None:
        """Send one step's metadata; each worker runs its shard of the step on it."""
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        width, rows = batch.block_table.shape[1], batch.logits_indices.shape[0]
        self._send([_STEP, num_tokens, num_seqs, width, rows], [t.reshape(-1).to(torch.int64) for t in batch])

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        self._send([_COPY, len(blocks_to_copy), 0, 0, 0], [torch.tensor(blocks_to_copy, dtype=torch.int64).reshape(-1)])

    def check(self) -> None:
        """``EngineDeadError`` if a worker has exited (an idle engine's health check)."""
        if any(not p.is_alive() for p in self._procs):
            raise self.failure(RuntimeError("a worker process is gone"))

    def commit_kv_memory(self) -> None:
        self._send([_COMMIT, 0, 0, 0, 0])

    def close(self) -> None:
        """Stop the workers and leave the group (also when this object is collected, or at exit)."""
        self._finalizer()

    def _send(self, header: list[int], payload: list[torch.Tensor] = ()) -> None:
        message = torch.cat([torch.tensor(header, dtype=torch.int64), *payload]).numpy().tobytes()
        try:
            if any(not p.is_alive() for p in self._procs):
                raise RuntimeError("a worker process is gone")
            for conn in self._commands:
                conn.send_bytes(message)
        except Exception as err:
            raise self.failure(err) from err

    def failure(self, err: BaseException, hint: str = "") -> EngineDeadError:
        """The error to raise for ``err``, a collective (a broadcast here, or an all-reduce of the
        step) that failed: which workers exited and what they reported, else ``err`` itself, and
        ``hint`` for a worker that exited without a word. An
        :class:`~pagedpack.runtime.engine_loop.EngineDeadError`: the engine cannot step again."""
        reported = [text for text in map(_reported, self._errors) if text]
        for proc in self._procs:
            proc.join(timeout=0.5)  # a killed worker's exit code, once the OS has it
        exited = [f"{p.name} (pid {p.pid}) exited with code {p.exitcode}" for p in self._procs
                  if p.exitcode is not None]
        why = "; ".join(exited + reported) or f"{type(err).__name__}: {str(err)[:300]}"
        if self._finalizer.detach():  # the ranks cannot step together again: no stop command, end the rest
            _shutdown(self._procs, self._commands, stop=False)
        return EngineDeadError(f"tensor_parallel_size: a worker rank stopped answering ({why})"
                               f"{hint if exited and not reported else ''}")


def _reported(conn) -> str | None:
    """The error text a worker sent on ``conn``, if any (None once it closed without one)."""
    try:
        return conn.recv_bytes().decode(errors="replace") if conn.poll(1.0) else None
    except (OSError, EOFError):
        return None


def _shutdown(procs, commands, stop: bool = True) -> None:
    """Send the stop command if ``stop`` (else close the command pipes: a worker reads their end),
    leave the group, then join the workers, else terminate them."""
    for conn in commands:
        try:
            if stop:
                conn.send_bytes(torch.tensor([_STOP, 0, 0, 0, 0], dtype=torch.int64).numpy().tobytes())
            conn.close()
        except OSError:  # a worker gone already
            pass
    _leave_group()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def _init_group(rank: int, world_size: int, port: int, timeout_s: float, workers=()) -> None:
    """Join the gloo group: the rendezvous waits up to :data:`JOIN_TIMEOUT_S` (rank 0 gives up as
    soon as one of ``workers``, the processes, has exited), collectives ``timeout_s``."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)
    joined = [f"pagedpack/joined/{r}" for r in range(1, world_size)]
    if rank:
        store.set(joined[rank - 1], "1")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not rank and not store.check(joined):
        if any(not p.is_alive() for p in workers):
            raise RuntimeError("a worker process exited before it joined the group")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not join the group within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker_main(rank: int, args, build, port: int, timeout_s: float, parent: int, commands, errors) -> None:
    """A worker rank: join the group, ``build(args, rank)`` its program, then run what rank 0 sends
    until the stop command or the end of the command pipe (rank 0 gone)."""
    from pagedpack.runtime.cpu_threads import allowed_cpus
    from pagedpack.runtime.memory import release_memory
    from pagedpack.runtime.model_runner import ModelRunner

    exit_with_parent(parent, signal.SIGTERM)  # also while joining the group, when no pipe is read yet
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    try:
        torch.set_num_threads(args.num_threads or max(1, len(allowed_cpus()) // args.tensor_parallel_size))
        _init_group(rank, args.tensor_parallel_size, port, timeout_s)
        program = build(args, rank)
        release_memory()  # what the capture and the source model held, as LLM does after its build
        runner = None
        while True:
            try:
                message = torch.frombuffer(bytearray(commands.recv_bytes()), dtype=torch.int64)
            except EOFError:  # rank 0 is gone
                break
            (command, *sizes), payload = message[:5].tolist(), message[5:]
            if command == _STOP:
                break
            if command == _START:
                runner = ModelRunner(program, num_blocks=sizes[0], block_size=args.block_size, device=args.device)
            elif command == _STEP:
                runner.execute(_step_metadata(payload, *sizes))
            elif command == _COPY:
                runner.copy_blocks([tuple(p) for p in payload.view(-1, 2).tolist()])
            elif command == _COMMIT:
                runner.commit_kv_memory()
    except BaseException as err:
        try:
            errors.send_bytes(f"rank {rank}: {type(err).__name__}: {str(err)[:500]}".encode())
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        _leave_group()


def _step_metadata(payload: torch.Tensor, num_tokens: int, num_seqs: int, width: int, rows: int) -> StepMetadata:
    """The :class:`StepMetadata` :meth:`TensorParallelWorkers.step` flattened into ``payload``."""
    sizes = [num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_tokens, rows]
    int32 = ("cu_seqlens_q", "seq_lens", "block_table")
    parts = {name: (t.to(torch.int32) if name in int32 else t.clone())
             for name, t in zip(METADATA_INPUTS, payload.split(sizes))}
    parts["block_table"] = parts["block_table"].view(num_seqs, width)
    return StepMetadata(**parts)
