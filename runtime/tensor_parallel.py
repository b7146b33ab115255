"""The ranks of a tensor-parallel ``LLM(..., tensor_parallel_size=N)`` on ``torch.distributed``.

Rank 0 is the ``LLM``'s own process: scheduler, sampler and detokenizer run there once, beside its
shard of the step. Ranks 1 .. N-1 are worker processes (``torch.multiprocessing``, spawned), each
building its own shard from the same source (capture, rewrite, :mod:`pagedpack.passes.tensor_parallel`,
lowering) and KV caches of its own heads, then following rank 0. The all-reduces inside the step
graphs join the ranks on the default process group (``gloo`` on the CPU, as vLLM's CPU workers).

Per step rank 0 broadcasts one int64 header ``[command, T, B, max_blocks, R]`` and, for a step, one
int64 payload with the step's metadata (:data:`pagedpack.contract.METADATA_INPUTS`, concatenated):
two small collectives (a copy-on-write of blocks and the commit of the KV pages at a server's start
travel the same way). Nothing is pickled between ranks after start-up; a worker takes its
``EngineArgs`` from rank 0 when spawned.

Faults: a worker that fails while building sends its error text on a pipe and exits, and rank 0
raises an error naming the rank and the error; a worker that dies later breaks the next
collective (gloo sees the closed connection) and a worker that hangs makes it time out after
``timeout_s``: either way rank 0's step raises
:class:`~pagedpack.runtime.engine_loop.EngineDeadError`, the engine loop fails every request with
it and takes no more (a server's ``/health`` turns 503); workers exit when rank 0 does.
"""
from __future__ import annotations

import atexit
import datetime
import signal
import socket
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedpack.contract import METADATA_INPUTS
from pagedpack.metadata import StepMetadata
from pagedpack.runtime.engine_loop import EngineDeadError

TIMEOUT_S = 60.0  # a collective no rank answers fails after this
_HEADER = 5
_START, _STEP, _COPY, _COMMIT, _STOP = range(5)


def group_name() -> str:
    """The name the step graphs' all-reduces give the default process group."""
    return dist.group.WORLD.group_name


class TensorParallelWorkers:
    """Rank 0's end of the worker processes. Spawns ranks 1 .. ``tp_size - 1``, each building its
    program with ``build(args, rank)`` (a module-level function: it travels by name), and joins
    them in the default process group (``gloo``, on a free local TCP port) before the caller
    builds rank 0's own shard; :meth:`start` then gives them the pool size. ``EngineDeadError`` (a
    ``RuntimeError``) if a worker fails or does not join within ``timeout_s``."""

    def __init__(self, args, build, *, timeout_s: float = TIMEOUT_S):
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: this process already has a torch.distributed process group; "
                               "an LLM with tensor_parallel_size > 1 starts and owns its own")
        self.tp_size, self.timeout_s = args.tensor_parallel_size, timeout_s
        context = mp.get_context("spawn")
        port = _free_port()
        self._errors, self._procs = [], []
        for rank in range(1, self.tp_size):
            receive, send = context.Pipe(duplex=False)  # a worker's error text, as bytes (nothing unpickled)
            self._procs.append(context.Process(target=_worker_main, name=f"pagedpack-tp-rank{rank}", daemon=True,
                                               args=(rank, args, build, port, timeout_s, send)))
            self._procs[-1].start()
            send.close()
            self._errors.append(receive)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs)
        atexit.register(self._finalizer)  # at exit before multiprocessing's own hook, which would kill them
        try:
            _init_group(0, self.tp_size, port, timeout_s)
        except Exception as err:
            raise self.failure(err) from err

    def start(self, num_blocks: int) -> None:
        """Have every worker allocate its KV caches for ``num_blocks`` blocks and wait for steps."""
        self._send([_START, num_blocks, 0, 0, 0])

    def step(self, batch: StepMetadata) -> None:
        """Send one step's metadata; each worker runs its shard of the step on it."""
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        width, rows = batch.block_table.shape[1], batch.logits_indices.shape[0]
        payload = torch.cat([t.reshape(-1).to(torch.int64) for t in batch])
        self._send([_STEP, num_tokens, num_seqs, width, rows], payload)

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        self._send([_COPY, len(blocks_to_copy), 0, 0, 0], torch.tensor(blocks_to_copy, dtype=torch.int64).reshape(-1))

    def commit_kv_memory(self) -> None:
        self._send([_COMMIT, 0, 0, 0, 0])

    def close(self) -> None:
        """Stop the workers and leave the group (also when this object is collected, or at exit)."""
        self._finalizer()

    def _send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        try:
            if any(not p.is_alive() for p in self._procs):
                raise RuntimeError("a worker process is gone")
            dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0)
            if payload is not None:
                dist.broadcast(payload, src=0)
        except Exception as err:
            raise self.failure(err) from err

    def failure(self, err: BaseException) -> EngineDeadError:
        """The error to raise for ``err``, a collective (a broadcast here, or an all-reduce of the
        step) that failed: which workers exited and what they reported, else ``err`` itself. An
        :class:`~pagedpack.runtime.engine_loop.EngineDeadError`: the engine cannot step again."""
        reported = [text for text in map(_reported, self._errors) if text]
        for proc in self._procs:
            proc.join(timeout=0.5)  # a killed worker's exit code, once the OS has it
        exited = [f"{p.name} exited with code {p.exitcode}" for p in self._procs if p.exitcode is not None]
        why = "; ".join(exited + reported) or f"{type(err).__name__}: {str(err)[:300]}"
        if self._finalizer.detach():  # the ranks cannot step together again: no stop command, end the rest
            _shutdown(self._procs, stop=False)
        return EngineDeadError(f"tensor_parallel_size: a worker rank stopped answering ({why})")


def _reported(conn) -> str | None:
    """The error text a worker sent on ``conn``, if any (None once it closed without one)."""
    try:
        return conn.recv_bytes().decode(errors="replace") if conn.poll(1.0) else None
    except (OSError, EOFError):
        return None


def _shutdown(procs, stop: bool = True) -> None:
    """Leave the group, after a stop command if ``stop`` and every worker lives (a dead one would fail
    it); then join the workers, else terminate them."""
    if dist.is_initialized():
        if stop and all(proc.is_alive() for proc in procs):
            try:
                dist.broadcast(torch.tensor([_STOP, 0, 0, 0, 0], dtype=torch.int64), src=0)
            except Exception:  # noqa: BLE001 -- stopping anyway
                pass
        dist.destroy_process_group()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker_main(rank: int, args, build, port: int, timeout_s: float, errors) -> None:
    """A worker rank: join the group, ``build(args, rank)`` its program, then run what rank 0 sends."""
    from pagedpack.runtime.memory import release_memory
    from pagedpack.runtime.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    try:
        torch.set_num_threads(args.num_threads)
        _init_group(rank, args.tensor_parallel_size, port, timeout_s)
        program = build(args, rank)
        release_memory()  # what the capture and the source model held, as LLM does after its build
        runner = None
        while True:
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.broadcast(header, src=0)
            command, *sizes = header.tolist()
            if command == _STOP:
                break
            if command == _START:
                runner = ModelRunner(program, num_blocks=sizes[0], block_size=args.block_size, device=args.device)
            elif command == _STEP:
                runner.execute(_receive_step(*sizes))
            elif command == _COPY:
                pairs = torch.empty(2 * sizes[0], dtype=torch.int64)
                dist.broadcast(pairs, src=0)
                runner.copy_blocks([tuple(p) for p in pairs.view(-1, 2).tolist()])
            elif command == _COMMIT:
                runner.commit_kv_memory()
    except BaseException as err:
        try:
            errors.send_bytes(f"rank {rank}: {type(err).__name__}: {str(err)[:500]}".encode())
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _receive_step(num_tokens: int, num_seqs: int, width: int, rows: int) -> StepMetadata:
    sizes = {"input_ids": num_tokens, "positions": num_tokens, "cu_seqlens_q": num_seqs + 1, "seq_lens": num_seqs,
             "block_table": num_seqs * width, "slot_mapping": num_tokens, "logits_indices": rows}
    payload = torch.empty(sum(sizes.values()), dtype=torch.int64)
    dist.broadcast(payload, src=0)
    parts = dict(zip(METADATA_INPUTS, payload.split(list(sizes.values()))))
    int32 = ("cu_seqlens_q", "seq_lens", "block_table")
    parts = {name: (t.to(torch.int32) if name in int32 else t) for name, t in parts.items()}
    parts["block_table"] = parts["block_table"].view(num_seqs, width)
    return StepMetadata(**parts)
