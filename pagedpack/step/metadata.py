"""The packed, paged metadata of one step (the step program's extra inputs), as plain arithmetic.

A leaf module: it imports nothing of the project, so the passes, the lowerings
and the exporters build their sample steps without the serving runtime; ``runtime.batch`` adapts
the scheduler's requests to :func:`paged_metadata` and checks the result.

Names, shapes and dtypes are those of docs/design.md: all ``T`` new tokens of the ``B``
sequences form one packed row; sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch


class StepMetadata(NamedTuple):
    """One step's inputs, in :data:`~pagedpack.step.contract.METADATA_INPUTS` order (a test holds them equal).

    input_ids: int64 ``[T]``, the new tokens.
    positions: int64 ``[T]``, each token's absolute position in its sequence.
    cu_seqlens_q: int32 ``[B+1]``, packed row offsets of the sequences.
    seq_lens: int32 ``[B]``, KV length of each sequence including this step's tokens.
    block_table: int32 ``[B, max_blocks_per_seq]``, physical blocks of each sequence; the width
        is the most blocks any sequence of this step needs, shorter rows are padded.
    slot_mapping: int64 ``[T]``, cache slot each new token's K/V is written to.
    logits_indices: int64 ``[R]``, the rows whose logits the step returns: the last row of each
        sequence (``cu_seqlens_q[1:] - 1``, what :func:`paged_metadata` gives: ``R = B``), then
        any prompt rows asked for (``runtime.batch``, for prompt logprobs).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def as_inputs(self) -> dict[str, torch.Tensor]:
        """The seven tensors by name (the graph's metadata inputs)."""
        return self._asdict()

    def to(self, device: torch.device | str) -> StepMetadata:
        return StepMetadata(*(t.to(device) for t in self))


def paged_metadata(q_lens: Sequence[int], context_lens: Sequence[int], block_ids: Sequence[Sequence[int]], *,
                   block_size: int, input_ids=None, pad_block: int = 0) -> StepMetadata:
    """The metadata of a step in which sequence ``b`` has ``context_lens[b]`` tokens cached and
    computes ``q_lens[b]`` new ones at positions ``context_lens[b] ..``, its K/V going to slot
    ``block_ids[b][pos // block_size] * block_size + pos % block_size``.

    ``input_ids``: the ``T`` new tokens, sequence after sequence (an int array or sequence; None:
    zeros). ``block_ids[b]`` may hold more blocks than the sequence needs; missing ones are
    ``pad_block`` in the table (``runtime.batch`` passes -1 so that its check refuses them) and give
    negative slots. Built on the CPU with NumPy; nothing is checked here.
    """
    num_seqs = len(q_lens)
    q = np.asarray(q_lens, dtype=np.int64).reshape(num_seqs)
    starts = np.asarray(context_lens, dtype=np.int64).reshape(num_seqs)
    seq_lens = starts + q
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q)
    positions = np.arange(num_tokens) - cu_seqlens_q[:-1][seq_of_token] + starts[seq_of_token]
    ids = np.zeros(num_tokens, dtype=np.int64) if input_ids is None else np.asarray(input_ids, dtype=np.int64)
    blocks_needed = -(-seq_lens // block_size)
    block_table = np.full((num_seqs, int(blocks_needed.max(initial=0))), pad_block, dtype=np.int32)
    for b, (row, needed) in enumerate(zip(block_ids, blocks_needed.tolist())):
        row = row[:needed]
        block_table[b, : len(row)] = row
    slot_mapping = block_table[seq_of_token, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    return StepMetadata(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(positions),
        cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        logits_indices=torch.from_numpy(cu_seqlens_q[1:] - 1),
    )


def example_metadata(q_lens: Sequence[int], context_lens: Sequence[int] | None = None, *, block_size: int,
                     num_blocks: int, device: torch.device | str = "cpu") -> StepMetadata:
    """A valid step for tracing, exporting or checking a step program: sequence ``b`` has
    ``context_lens[b]`` tokens cached (default 0) and computes ``q_lens[b]`` new ones (token id
    0); blocks are numbered consecutively over the sequences, modulo ``num_blocks``."""
    context_lens = list(context_lens or [0] * len(q_lens))
    block_ids, next_block = [], 0
    for q_len, cached in zip(q_lens, context_lens):
        needed = -(-(cached + q_len) // block_size)
        block_ids.append([(next_block + j) % num_blocks for j in range(needed)])
        next_block += needed
    return paged_metadata(q_lens, context_lens, block_ids, block_size=block_size).to(device)


def state_metadata(slots: Sequence[int], context_lens: Sequence[int], device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(state_indices [B] int32, has_initial_state [B] bool)`` of a step whose sequence ``b`` owns
    state slot ``slots[b]`` and has ``context_lens[b]`` tokens computed before it (its slot holds
    their state: True exactly when it has some)."""
    return (torch.tensor(list(slots), dtype=torch.int32, device=device),
            torch.tensor([c > 0 for c in context_lens], dtype=torch.bool, device=device).reshape(len(slots)))


def example_lora_inputs(lora_specs: Sequence, q_lens: Sequence[int], device: torch.device | str = "cpu", *,
                        max_loras: int = 2, max_rank: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """The LoRA inputs of an example step (:func:`~pagedpack.step.contract.lora_input_names`): sequence ``b``
    in slot ``b % (max_loras + 1) - 1`` (the base model every ``max_loras + 1``-th), random adapter
    weights of ``max_rank`` scaled to a few percent of an activation's change; ``[]`` without ``lora_specs``."""
    if not lora_specs:
        return []
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([b % (max_loras + 1) - 1 for b in range(len(q_lens))], dtype=torch.int32)
    inputs = [slots.repeat_interleave(torch.tensor(list(q_lens))).to(device)]
    for spec in lora_specs:
        a = torch.randn(spec.a_shape(max_loras, max_rank), generator=g) / spec.in_features ** 0.5
        b = torch.randn(spec.b_shape(max_loras, max_rank), generator=g) * 0.05 / max_rank ** 0.5
        inputs += [a.to(spec.dtype).to(device), b.to(spec.dtype).to(device)]
    return inputs


def example_state_inputs(state_specs: Sequence, context_lens: Sequence[int], device: torch.device | str = "cpu",
                         num_slots: int | None = None) -> list[torch.Tensor]:
    """The state inputs of an example step (docs/design.md): sequence ``b`` in slot ``b``, zeroed states of
    ``num_slots`` slots (default: one a sequence; a sequence with context starts from zeros, which is a
    state like any other); ``[]`` for a program without ``state_specs``
    (:class:`~pagedpack.step.contract.StateSpec`)."""
    if not state_specs:
        return []
    num_slots = len(context_lens) if num_slots is None else num_slots
    states = [torch.zeros(spec.state_shape(num_slots), dtype=spec.dtype, device=device) for spec in state_specs]
    return [*state_metadata(range(len(context_lens)), context_lens, device), *states]
