"""A tensor-parallel worker rank (1 .. N-1): ``python -m pagedpack.runtime.tp_worker ADDRESS PORT RANK``
(``distributed_executor_backend="mp"``), or :class:`RankActor` in a Ray actor (``"ray"``). Either
way it imports pagedpack only, never the script that built the ``LLM`` (no
``if __name__ == "__main__":`` guard needed there), and nothing it receives is unpickled.

It connects to rank 0's command channel (:mod:`pagedpack.runtime.rank_channel`; the token in
the environment variable :data:`TOKEN_ENV`, hex, or the actor's arguments), takes its
configuration (JSON: the ``EngineArgs`` as :meth:`~pagedpack.engine_args.EngineArgs.to_json`
wrote them, the process group's address and port, the collectives' timeout), joins the gloo
group, builds its program (:func:`pagedpack.compiler.program.build_rank_program`), says it is
ready and runs the commands rank 0 sends (:mod:`pagedpack.runtime.tensor_parallel`) until the stop command or the
connection's end (rank 0 gone). If anything fails it sends its error text and ends (exit code 1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pagedpack.runtime import rank_channel
from pagedpack.runtime.process_group import JOIN_TIMEOUT_S, init_group, leave_group
from pagedpack.runtime.rank_channel import COMMIT, COPY, READY, START, STEP, STOP, TOKEN_ENV
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import StepMetadata

_CONFIG_LIMIT = 1 << 20  # bytes of the configuration frame
_COMMAND_LIMIT = 1 << 30  # bytes of one command frame


def serve_rank(address: str, port: int, token: bytes, rank: int) -> None:
    """Run rank ``rank`` for the rank 0 listening on ``address:port``; returns at the stop command
    or the channel's end. Raises what failed, after sending its text to rank 0."""
    sock = rank_channel.connect(address, port, token, rank, timeout_s=JOIN_TIMEOUT_S)
    try:
        _serve(sock, rank)
    except BaseException as err:
        try:
            rank_channel.send_frame(sock, f"rank {rank}: {type(err).__name__}: {str(err)[:500]}".encode())
        except OSError:  # rank 0 is gone
            pass
        raise
    finally:
        leave_group()
        sock.close()


def _serve(sock, rank: int) -> None:
    from transformers.utils import logging as hf_logging

    from pagedpack.compiler.program import build_rank_program
    from pagedpack.engine_args import EngineArgs
    from pagedpack.runtime.cpu_threads import allowed_cpus
    from pagedpack.runtime.memory import release_memory
    from pagedpack.runtime.model_runner import ModelRunner

    hf_logging.disable_progress_bar()  # loading the model again: rank 0 speaks for the ranks
    config = _config(rank_channel.recv_frame(sock, _CONFIG_LIMIT))
    args = EngineArgs.from_json(config["engine_args"])
    torch.set_num_threads(args.num_threads or max(1, len(allowed_cpus()) // args.tensor_parallel_size))
    init_group(rank, args.tensor_parallel_size, config["master_addr"], config["master_port"], config["timeout_s"])
    program = build_rank_program(args, rank)
    release_memory()  # what the capture and the source model held, as LLM does after its build
    rank_channel.send_frame(sock, READY)
    runner = None
    while (frame := rank_channel.recv_frame(sock, _COMMAND_LIMIT)) is not None:
        message = torch.frombuffer(bytearray(frame), dtype=torch.int64)
        (command, *sizes), payload = message[:5].tolist(), message[5:]
        if command == STOP:
            break
        if command == START:
            runner = ModelRunner(program, num_blocks=sizes[0], block_size=args.block_size, device=args.device)
        elif command == STEP:
            runner.execute(_step_metadata(payload, *sizes))
        elif command == COPY:
            runner.copy_blocks([tuple(p) for p in payload.view(-1, 2).tolist()])
        elif command == COMMIT:
            runner.commit_kv_memory()


def _config(frame: bytes | None) -> dict:
    """The configuration frame's fields, checked; ``ValueError`` otherwise."""
    config = json.loads(frame) if frame is not None else None
    expected = {"engine_args": str, "master_addr": str, "master_port": int, "timeout_s": (int, float)}
    if not isinstance(config, dict) or set(config) != set(expected) or not all(
            isinstance(config[k], t) and not isinstance(config[k], bool) for k, t in expected.items()):
        raise ValueError(f"configuration: expected a JSON object of {sorted(expected)}, got {str(config)[:200]}")
    return config


def _step_metadata(payload: torch.Tensor, num_tokens: int, num_seqs: int, width: int, rows: int) -> StepMetadata:
    """The :class:`StepMetadata` :meth:`TensorParallelWorkers.step` flattened into ``payload``."""
    sizes = [num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_tokens, rows]
    int32 = ("cu_seqlens_q", "seq_lens", "block_table")
    parts = {name: (t.to(torch.int32) if name in int32 else t.clone())
             for name, t in zip(METADATA_INPUTS, payload.split(sizes))}
    parts["block_table"] = parts["block_table"].view(num_seqs, width)
    return StepMetadata(**parts)


class RankActor:
    """A worker rank in a Ray actor (``distributed_executor_backend="ray"``,
    :mod:`pagedpack.runtime.ray_ranks`): :meth:`run` serves it until rank 0 stops it."""

    def run(self, address: str, port: int, token_hex: str, rank: int) -> None:
        serve_rank(address, port, bytes.fromhex(token_hex), rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedpack.runtime.tp_worker",
                                     description=f"a tensor-parallel worker rank (its token: ${TOKEN_ENV}, hex)")
    parser.add_argument("address")
    parser.add_argument("port", type=int)
    parser.add_argument("rank", type=int)
    given = parser.parse_args(argv)
    token = bytes.fromhex(os.environ.pop(TOKEN_ENV, ""))
    try:
        serve_rank(given.address, given.port, token, given.rank)
    except BaseException:  # its text went to rank 0, which raises it
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
