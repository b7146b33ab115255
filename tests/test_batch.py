"""build_batch against a plainly written per-token computation of the same fields."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.runtime.scheduler import ScheduledRequest
from pagedpack.step.metadata import StepMetadata

INPUT_NAMES = ["input_ids", "positions", "cu_seqlens_q", "seq_lens", "block_table", "slot_mapping", "logits_indices"]
DTYPES = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "cu_seqlens_q": torch.int32,
    "seq_lens": torch.int32,
    "block_table": torch.int32,
    "slot_mapping": torch.int64,
    "logits_indices": torch.int64,
}


def make_scheduled(
    request_id: str,
    prompt: list[int],
    outputs: list[int],
    num_computed: int,
    num_new: int,
    block_ids: list[int],
) -> ScheduledRequest:
    req = Request(request_id, prompt, SamplingParams(max_tokens=1000))
    for tok in outputs:
        req.append_output(tok, max_model_len=10_000)
    req.num_computed_tokens = num_computed
    req.block_ids = list(block_ids)
    return ScheduledRequest(req, num_new)


def reference_batch(scheduled: list[ScheduledRequest], block_size: int) -> dict[str, list]:
    """Per-token Python, straight from the definitions in docs/design.md."""
    ref = {name: [] for name in INPUT_NAMES}
    ref["cu_seqlens_q"].append(0)
    widths = []
    for s in scheduled:
        req, start = s.request, s.request.num_computed_tokens
        for pos in range(start, start + s.num_new_tokens):
            ref["input_ids"].append(req.all_token_ids[pos])
            ref["positions"].append(pos)
            ref["slot_mapping"].append(req.block_ids[pos // block_size] * block_size + pos % block_size)
        ref["cu_seqlens_q"].append(ref["cu_seqlens_q"][-1] + s.num_new_tokens)
        ref["seq_lens"].append(start + s.num_new_tokens)
        ref["logits_indices"].append(ref["cu_seqlens_q"][-1] - 1)
        widths.append((start + s.num_new_tokens + block_size - 1) // block_size)
    width = max(widths, default=0)
    ref["block_table"] = [(s.request.block_ids[:w] + [0] * width)[:width] for s, w in zip(scheduled, widths)]
    return ref


def assert_matches_reference(md: StepMetadata, scheduled: list[ScheduledRequest], block_size: int) -> None:
    ref = reference_batch(scheduled, block_size)
    inputs = md.as_inputs()
    assert list(inputs) == INPUT_NAMES
    for name in INPUT_NAMES:
        assert inputs[name].dtype == DTYPES[name], name
        if name == "block_table":
            assert inputs[name].shape == (len(scheduled), len(ref[name][0]) if ref[name] else 0)
        assert inputs[name].tolist() == ref[name], name
    assert md.num_tokens == len(ref["input_ids"]) and md.num_seqs == len(scheduled)


@st.composite
def compositions(draw):
    """A step mixing prefills, decodes and chunked prefills (resuming anywhere, mid-block too),
    with each request's blocks drawn from one shuffled pool."""
    block_size = draw(st.integers(1, 8))
    shapes = []
    for _ in range(draw(st.integers(0, 6))):
        num_prompt = draw(st.integers(1, 40))
        num_output = draw(st.integers(0, 10))
        num_tokens = num_prompt + num_output
        kind = draw(st.sampled_from(["prefill", "decode", "chunk"]))
        if kind == "prefill":
            num_computed, num_new = 0, num_tokens
        elif kind == "decode":
            num_computed, num_new = num_tokens - 1, 1
        else:
            num_computed = draw(st.integers(0, num_tokens - 1))
            num_new = draw(st.integers(1, num_tokens - num_computed))
        extra_blocks = draw(st.integers(0, 2))  # block_ids may run past this step's tokens
        num_blocks = -(-(num_computed + num_new) // block_size) + extra_blocks
        shapes.append((num_prompt, num_output, num_computed, num_new, num_blocks))
    pool_size = sum(shape[-1] for shape in shapes) + draw(st.integers(0, 5))
    pool = draw(st.permutations(range(pool_size)))
    scheduled = []
    for i, (num_prompt, num_output, num_computed, num_new, num_blocks) in enumerate(shapes):
        size = num_prompt + num_output
        tokens = draw(st.lists(st.integers(0, 50_000), min_size=size, max_size=size))
        blocks, pool = pool[:num_blocks], pool[num_blocks:]
        scheduled.append(
            make_scheduled(f"r{i}", tokens[:num_prompt], tokens[num_prompt:], num_computed, num_new, blocks)
        )
    return scheduled, block_size, max(pool_size, 1)


@settings(max_examples=150, deadline=None)
@given(compositions())
def test_matches_per_token_reference(case):
    scheduled, block_size, num_blocks = case
    md = build_batch(scheduled, block_size=block_size, num_blocks=num_blocks)
    assert_matches_reference(md, scheduled, block_size)


def test_mixed_step_by_hand():
    # block_size 4. a: prefill of 6; b: decode at position 9; c: chunk resuming mid-block at 5.
    a = make_scheduled("a", [10, 11, 12, 13, 14, 15], [], 0, 6, [3, 7])
    b = make_scheduled("b", [20, 21, 22, 23, 24, 25, 26, 27, 28], [29], 9, 1, [0, 1, 2])
    c = make_scheduled("c", list(range(30, 40)), [], 5, 3, [5, 6])
    md = build_batch([a, b, c], block_size=4, num_blocks=8)
    assert md.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 29, 35, 36, 37]
    assert md.positions.tolist() == [0, 1, 2, 3, 4, 5, 9, 5, 6, 7]
    assert md.cu_seqlens_q.tolist() == [0, 6, 7, 10]
    assert md.seq_lens.tolist() == [6, 10, 8]
    assert md.block_table.tolist() == [[3, 7, 0], [0, 1, 2], [5, 6, 0]]
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 28, 29, 9, 25, 26, 27]
    assert md.logits_indices.tolist() == [5, 6, 9]
    assert (md.num_tokens, md.num_seqs) == (10, 3)


def test_empty_step():
    md = build_batch([], block_size=4, num_blocks=4)
    assert (md.num_tokens, md.num_seqs) == (0, 0)
    assert md.cu_seqlens_q.tolist() == [0]
    assert md.block_table.shape == (0, 0)


def test_block_ids_too_short_raise_naming_block_table():
    short = make_scheduled("a", list(range(9)), [], 0, 9, [0, 1])  # 9 tokens need 3 blocks of 4
    with pytest.raises(ValueError, match=r"^block_table: expected block ids in \[0, 8\), got block_table\[0, 2\]=-1"):
        build_batch([short], block_size=4, num_blocks=8)


def test_block_id_outside_pool_raises():
    bad = make_scheduled("a", [1, 2, 3], [], 0, 3, [8])
    with pytest.raises(ValueError, match=r"^block_table: .*got block_table\[0, 0\]=8"):
        build_batch([bad], block_size=4, num_blocks=8)


def test_chunk_past_known_tokens_is_rejected():
    req = Request("a", [1, 2, 3], SamplingParams())
    req.num_computed_tokens = 2
    with pytest.raises(ValueError, match="num_new_tokens: expected 1 .. 1"):
        ScheduledRequest(req, 2)
    with pytest.raises(ValueError, match="num_new_tokens"):
        ScheduledRequest(req, 0)


def test_moves_to_device():
    a = make_scheduled("a", [1, 2, 3], [], 0, 3, [0])
    md = build_batch([a], block_size=4, num_blocks=1, device=torch.device("meta"))
    assert all(t.device.type == "meta" for t in md.as_inputs().values())
