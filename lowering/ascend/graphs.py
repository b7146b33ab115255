"""Graph modes of the ``ascend`` target: which steps run in a graph, which eagerly.

``"aclgraph"`` (the default) is what production runs in 2026: vllm-ascend removed its TorchAir
graph mode (PR #4814, 2025-12, "aclgraph is stable and fast now") and captures ACL graphs
(``torch.npu.NPUGraph``) of its decode steps, per batch size, running prefill eagerly
(``FULL_DECODE_ONLY``; ``docs/source/user_guide/feature_guide/graph_mode.md``). Here:

- a decode step (the bucket rule below) copies its padded metadata into the input tensors its
  bucket's graph captured, refreshes FIA's host length lists and replays the graph. The graph is
  the eager program (torch_npu's FIA with host lists, :data:`~pagedpack.lowering.ascend.lower.
  HOST_LENGTH_INPUTS`), captured on the bucket's first step with ``auto_dispatch_capture=True``;
- the refresh is one call per replay, not per layer: the KV lengths are read once
  (``seq_lens.tolist()``) and ``NPUGraph.update`` gets them for every FIA call it recorded (one
  dict for all of them, or one per call when sites differ: a windowed site's list carries its dummy
  sequence, and FIA v2 names the argument ``actual_seq_kvlen``). torch_npu
  then relaunches each call's task group on its update stream, the per-layer work vllm-ascend
  measured at ~38 % of its main thread (RFC #13058), which no caller can avoid; the query lengths
  of a padded decode bucket (``1 .. bucket``) never change and are not refreshed. A replay without
  the refresh computes with the lengths of the capture's step (tested: the emulation then gives
  the wrong logits);
- every other step runs the eager program.

Off an NPU the graphs are captured and replayed by :mod:`pagedpack.kernels.npu_graph_emulation`.

``"decode_buckets"`` is the pattern production Ascend inference shipped until late 2025: vllm-ascend's
former TorchAir model runner compiled decode only, with static shapes and the batch padded to a
list of graph batch sizes (``torchair_graph_config.graph_batch_sizes``), prefill eager;
cann-recipes-infer compiles decode with ``dynamic=False`` and runs prefill eagerly. TorchAir's
docs say that any dynamic dimension makes FIA compute its tiling on the host every step, which
static graphs avoid. Here:

Both bucket modes (``aclgraph``, ``decode_buckets``) pick steps the same way:

- a step of decodes only (every sequence computes one token: ``T == B``, one logits row each) with
  ``B`` at most the largest bucket runs the static graph of the smallest bucket ``>= B``
  (captured or compiled on first use, then reused). The metadata is padded to the bucket by
  :func:`pad_decode`; the padding rows of the logits are dropped;
- every other step (prefill, chunked prefill, mixed, a decode batch above the largest bucket, or
  one returning the prompt rows of ``prompt_logprobs``) runs the eager program: torch_npu's FIA
  with host length lists, as vllm-ascend's eager path.

``"dynamic"`` compiles one graph whose metadata dimensions are dynamic and runs every step in it
(:func:`pagedpack.lowering.ascend.torchair.compile_step`); no production stack ships this.

Padding sequences read and write no real block: each has one query row (so that the TND rule
``T == actual_seq_lengths[-1]`` holds, vllm-ascend #6076), KV length 1 (vllm-ascend pads decode
``seq_lens`` with 1) and its block-table row and slot in a padding block that the program asks
the runner to allocate beyond the pool (``padding_blocks``), which the KV manager never hands out.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from pagedpack.lowering.ascend.lower import host_lengths
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import StepMetadata

GRAPH_MODES = ("aclgraph", "decode_buckets", "dynamic")
DEFAULT_GRAPH_MODE = "aclgraph"
BUCKET_MODES = ("aclgraph", "decode_buckets")
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class GraphStats:
    """What a graph mode did so far: graphs compiled or captured (bucket sizes for the bucket
    modes), how many steps ran in a graph and how many eagerly; for ``aclgraph`` also the
    seconds spent refreshing FIA's host lengths and replaying (host time, summed over replays)."""

    mode: str
    graphs_compiled: int = 0
    buckets_compiled: list[int] = field(default_factory=list)
    graph_steps: int = 0
    eager_steps: int = 0
    refresh_s: float = 0.0
    replay_s: float = 0.0

    def describe(self) -> str:
        buckets = f" (batch sizes {', '.join(map(str, self.buckets_compiled))})" if self.buckets_compiled else ""
        if self.mode != "aclgraph":
            return (f"{self.mode}: {self.graphs_compiled} graph(s) compiled{buckets}; {self.graph_steps} steps ran "
                    f"in a compiled graph, {self.eager_steps} eagerly")
        timing = (f" (length refresh {1e3 * self.refresh_s / self.graph_steps:.3f} ms and replay "
                  f"{1e3 * self.replay_s / self.graph_steps:.1f} ms per replay)") if self.graph_steps else ""
        return (f"aclgraph: {self.graphs_compiled} graph(s) captured{buckets}; {self.graph_steps} replays{timing}, "
                f"{self.eager_steps} steps eagerly")


def counting(backend: Callable, stats: GraphStats) -> Callable:
    """``backend`` that counts the graphs dynamo hands it in ``stats.graphs_compiled``."""
    def compile_graph(gm, example_inputs):
        stats.graphs_compiled += 1
        return backend(gm, example_inputs)

    return compile_graph


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module with a copy of ``gm``'s graph, sharing its parameters and buffers (each copy
    has its own generated ``forward``, so dynamo keeps a separate cache entry per copy)."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def pad_decode(metadata: list[torch.Tensor], bucket: int, *, width: int, padding_block: int,
               block_size: int) -> list[torch.Tensor]:
    """The seven metadata inputs of a decode step (``T == B``) padded to ``bucket`` sequences.

    Padding sequence ``i`` (of ``P = bucket - B``) has token id 0 at position 0, one query row,
    ``seq_lens`` 1, a block-table row of ``padding_block`` and slot
    ``padding_block * block_size + i % block_size``; ``logits_indices`` point at its own row.
    ``block_table`` becomes ``[bucket, width]`` (real rows padded with ``padding_block``).
    ``ValueError`` if the step is not a decode step or does not fit.
    """
    input_ids, positions, cu_seqlens_q, seq_lens, block_table, slot_mapping, logits_indices = metadata
    num_seqs, num_tokens = seq_lens.shape[0], input_ids.shape[0]
    if num_tokens != num_seqs or not num_seqs <= bucket or block_table.shape[1] > width:
        raise ValueError(f"pad_decode: expected a decode step (T == B) with B <= bucket={bucket} and at most "
                         f"{width} block-table columns, got T={num_tokens}, B={num_seqs}, "
                         f"{block_table.shape[1]} columns")
    pad = bucket - num_seqs
    extra = torch.arange(1, pad + 1, device=input_ids.device)
    table = block_table.new_full((bucket, width), padding_block)
    table[:num_seqs, :block_table.shape[1]] = block_table
    return [
        torch.cat([input_ids, input_ids.new_zeros(pad)]),
        torch.cat([positions, positions.new_zeros(pad)]),
        torch.cat([cu_seqlens_q, cu_seqlens_q[-1] + extra.to(cu_seqlens_q.dtype)]),
        torch.cat([seq_lens, seq_lens.new_ones(pad)]),
        table,
        torch.cat([slot_mapping, padding_block * block_size + (extra - 1) % block_size]),
        torch.cat([logits_indices, num_tokens + extra - 1]),
    ]


class _DecodeBucketProgram:
    """What the bucket modes share (module docstring): a step program over caches of
    ``num_blocks + padding_blocks`` blocks whose decode steps run padded to a bucket
    (:meth:`run_bucket`) and whose other steps run ``eager``, the step graph lowered with host
    lengths (``eager(*inputs, *host_lengths(...))``). ``batch_sizes``: the buckets.
    ``max_blocks_per_seq``: the static block-table width, ``ceil(max_model_len / block_size)``."""

    padding_blocks = 1

    def __init__(self, eager: Callable, *, batch_sizes: list[int], max_blocks_per_seq: int, stats: GraphStats):
        self.eager, self.batch_sizes = eager, sorted(batch_sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.stats = stats

    def bucket(self, num_tokens: int, num_seqs: int, num_columns: int) -> int | None:
        """The bucket a step runs in, or None (run eagerly)."""
        if num_tokens != num_seqs or num_columns > self.max_blocks_per_seq:
            return None
        return next((size for size in self.batch_sizes if size >= num_seqs), None)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        metadata, caches = StepMetadata(*inputs[:len(METADATA_INPUTS)]), inputs[len(METADATA_INPUTS):]
        bucket = self.bucket(metadata.num_tokens, metadata.num_seqs, metadata.block_table.shape[1]) \
            if metadata.logits_indices.shape[0] == metadata.num_seqs else None
        if bucket is None:
            self.stats.eager_steps += 1
            return self.eager(*inputs, *host_lengths(metadata.cu_seqlens_q, metadata.seq_lens))
        key_cache = caches[0]
        padded = pad_decode(metadata, bucket, width=self.max_blocks_per_seq, padding_block=key_cache.shape[0] - 1,
                            block_size=key_cache.shape[1])
        self.stats.graph_steps += 1
        return self.run_bucket(bucket, padded, caches, metadata.num_seqs)

    def run_bucket(self, bucket: int, padded: list[torch.Tensor], caches, num_seqs: int) -> torch.Tensor:
        """The first ``num_seqs`` logits rows of the padded decode step."""
        raise NotImplementedError


class DecodeBuckets(_DecodeBucketProgram):
    """The ``decode_buckets`` graph mode: ``graph``, the step graph lowered for compiled graphs
    (tensor lengths), is compiled per bucket with ``backend``
    (``torch.compile(..., dynamic=False, fullgraph=True)``) on a copy each."""

    def __init__(self, graph: torch.fx.GraphModule, eager: Callable, *, batch_sizes: list[int],
                 max_blocks_per_seq: int, backend: Callable):
        super().__init__(eager, batch_sizes=batch_sizes, max_blocks_per_seq=max_blocks_per_seq,
                         stats=GraphStats("decode_buckets"))
        self.graph = graph
        self.backend = counting(backend, self.stats)
        self.graphs: dict[int, Callable] = {}

    def run_bucket(self, bucket, padded, caches, num_seqs):
        if bucket not in self.graphs:
            self.graphs[bucket] = torch.compile(copy_module(self.graph), backend=self.backend, dynamic=False,
                                                fullgraph=True)
            self.stats.buckets_compiled.append(bucket)
        return self.graphs[bucket](*padded, *caches)[:num_seqs]


@dataclass
class _Captured:
    """One bucket's ACL graph: the input tensors it captured, its output, the caches it writes."""

    graph: object
    inputs: list[torch.Tensor]
    caches: tuple[torch.Tensor, ...]
    output: torch.Tensor


class ACLGraphBuckets(_DecodeBucketProgram):
    """The ``aclgraph`` graph mode (module docstring). ``eager``: the step graph lowered with host
    lengths, for eager steps and captured per bucket. ``graph_api``: ``torch.npu`` on an NPU, else
    :mod:`pagedpack.kernels.npu_graph_emulation` (``NPUGraph`` and ``graph``). ``kv_updates``: per
    FIA call of ``eager``, in graph order, the name of its KV-lengths argument (v1 and v2 differ)
    and whether its site appends the sliding window's dummy sequence (its list then ends in a 0)."""

    def __init__(self, eager: Callable, *, batch_sizes: list[int], max_blocks_per_seq: int, graph_api,
                 kv_updates: list[tuple[str, bool]]):
        super().__init__(eager, batch_sizes=batch_sizes, max_blocks_per_seq=max_blocks_per_seq,
                         stats=GraphStats("aclgraph"))
        self.graph_api, self.kv_updates = graph_api, kv_updates
        self.captured: dict[int, _Captured] = {}

    def run_bucket(self, bucket, padded, caches, num_seqs):
        captured = self.captured.get(bucket)
        if captured is None or any(a is not b for a, b in zip(captured.caches, caches)):
            captured = self.captured[bucket] = self.capture(padded, caches)
            self.stats.graphs_compiled += 1
            self.stats.buckets_compiled.append(bucket)
        for buffer, value in zip(captured.inputs, padded):
            buffer.copy_(value)
        start = time.perf_counter()
        self.refresh(captured, padded)
        replay = time.perf_counter()
        captured.graph.replay()
        self.stats.refresh_s += replay - start
        self.stats.replay_s += time.perf_counter() - replay
        return captured.output[:num_seqs].clone()

    def capture(self, padded: list[torch.Tensor], caches) -> _Captured:
        """Capture the eager program on copies of ``padded`` (which later steps copy into). The host
        lists are read before the capture, which cannot read the device."""
        inputs = [t.clone() for t in padded]
        lengths = host_lengths(inputs[2], inputs[3])
        graph = self.graph_api.NPUGraph()
        with self.graph_api.graph(graph, auto_dispatch_capture=True):
            output = self.eager(*inputs, *caches, *lengths)
        return _Captured(graph, inputs, tuple(caches), output)

    def refresh(self, captured: _Captured, padded: list[torch.Tensor]) -> None:
        """This step's KV lengths into every captured FIA call: one read, one ``update``."""
        kv_lens = padded[3].tolist()
        if len(set(self.kv_updates)) == 1:  # one dict serves every call
            (name, dummy), = set(self.kv_updates)
            captured.graph.update(cpu_update_input=[{name: kv_lens + [0] if dummy else kv_lens}])
        else:
            with_dummy = kv_lens + [0]
            captured.graph.update(cpu_update_input=[{name: with_dummy if dummy else kv_lens}
                                                    for name, dummy in self.kv_updates])


class RecurrentSteps:
    """The ``aclgraph`` mode of a model with recurrent state: no decode graphs are captured (a padded
    bucket's padding rows would need state slots the runner does not have), every step runs eagerly
    with host lengths, in one of two lowerings (:mod:`pagedpack.lowering.ascend.recurrent`): a
    decode-only step (``T == B``, every sequence continuing its state) ``decode``, the recurrent ops'
    decode form; any other step ``prefill``. Reading ``has_initial_state`` is one device-to-host read
    a step, beside the host lengths'. ``num_caches``: the KV cache inputs (the state inputs follow
    them: ``state_indices, has_initial_state``, the states)."""

    padding_blocks = 0

    def __init__(self, prefill: Callable, decode: Callable, *, num_caches: int):
        self.prefill, self.decode, self.num_caches = prefill, decode, num_caches
        self.stats = GraphStats("aclgraph")
        self.decode_steps = 0

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        metadata = StepMetadata(*inputs[:len(METADATA_INPUTS)])
        has_initial_state = inputs[len(METADATA_INPUTS) + self.num_caches + 1]
        decode = metadata.num_tokens == metadata.num_seqs and bool(has_initial_state.all())
        self.stats.eager_steps += 1
        self.decode_steps += decode
        return (self.decode if decode else self.prefill)(*inputs, *host_lengths(metadata.cu_seqlens_q,
                                                                                 metadata.seq_lens))


class DynamicGraph:
    """The ``dynamic`` graph mode: every step in one graph compiled by ``compile`` (``compile_step``)."""

    padding_blocks = 0

    def __init__(self, graph: torch.fx.GraphModule, backend: Callable,
                 compile: Callable[[torch.fx.GraphModule, Callable], Callable]):
        self.stats = GraphStats("dynamic")
        self.run = compile(graph, counting(backend, self.stats))

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.stats.graph_steps += 1
        return self.run(*inputs)


def check_graph_batch_sizes(sizes, *, limit: int) -> list[int]:
    """``sizes`` as a sorted list of distinct ints in ``1..limit``; ``ValueError`` naming the argument."""
    ok = isinstance(sizes, (list, tuple)) and sizes and all(
        isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= limit for s in sizes)
    if not ok:
        raise ValueError(f"graph_batch_sizes: expected a non-empty list of ints in 1..{limit}, got {sizes!r}")
    return sorted(set(sizes))


def max_blocks_per_seq(max_model_len: int | None, block_size: int) -> int:
    """The static block-table width of a bucket graph."""
    if max_model_len is None:
        raise ValueError("max_model_len: the bucket graph modes size its block tables by it, and the model "
                         "records no limit; pass max_model_len")
    return math.ceil(max_model_len / block_size)
