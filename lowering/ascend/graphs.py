"""Graph modes of the ``ascend`` target: which steps run in a graph, which eagerly.

The names are vllm-ascend's ``cudagraph_mode`` values (vLLM's ``CUDAGraphMode``; vllm-ascend
``docs/source/user_guide/feature_guide/graph_mode.md``, v0.30.0 and main of 2026):

- ``"full_and_piecewise"`` (the default, as vllm-ascend's and vLLM's): uniform decode steps replay
  a full ACL graph per batch-size bucket (below); every other step up to the largest token bucket
  runs in pieces (:class:`PiecewiseGraphs`): the step graph split at its attention sites, each piece
  between them an ACL graph captured per padded token count, the attention eager;
- ``"full_decode_only"`` (``"aclgraph"``, its former name here, is an alias): full graphs of the
  uniform decode steps, every other step eager;
- ``"eager"`` (vllm-ascend's ``NONE``): every step eager;
- ``"decode_buckets"``, ``"dynamic"``: TorchAir graphs (below).

Full decode graphs (both ACL graph modes) are what production runs in 2026: vllm-ascend removed
its TorchAir graph mode (PR #4814, 2025-12, "aclgraph is stable and fast now") and captures ACL
graphs (``torch.npu.NPUGraph``) of its decode steps, per batch size. Here:

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
- every other step runs in pieces or the eager program (below).

Off an NPU the graphs are captured and replayed by :mod:`pagedpack.kernels.npu_graph_emulation`.

``"decode_buckets"`` is the pattern production Ascend inference shipped until late 2025: vllm-ascend's
former TorchAir model runner compiled decode only, with static shapes and the batch padded to a
list of graph batch sizes (``torchair_graph_config.graph_batch_sizes``), prefill eager;
cann-recipes-infer compiles decode with ``dynamic=False`` and runs prefill eagerly. TorchAir's
docs say that any dynamic dimension makes FIA compute its tiling on the host every step, which
static graphs avoid. Here:

The bucket modes (``full_and_piecewise``, ``full_decode_only``, ``decode_buckets``) pick decode
steps the same way:

- a step of decodes only (every sequence computes one token: ``T == B``, one logits row each) with
  ``B`` at most the largest bucket runs the static graph of the smallest bucket ``>= B``
  (captured or compiled on first use, then reused). The metadata is padded to the bucket by
  :func:`pad_decode`; the padding rows of the logits are dropped;
- every other step (prefill, chunked prefill, mixed, a decode batch above the largest bucket, or
  one returning the prompt rows of ``prompt_logprobs``) runs in pieces (``full_and_piecewise``,
  :class:`PiecewiseGraphs`) or the eager program: torch_npu's FIA with host length lists, as
  vllm-ascend's eager path.

``"dynamic"`` compiles one graph whose metadata dimensions are dynamic and runs every step in it
(:func:`pagedpack.lowering.ascend.torchair.compile_step`); no production stack ships this.

Padding sequences read and write no real block: each has one query row (so that the TND rule
``T == actual_seq_lengths[-1]`` holds, vllm-ascend #6076), KV length 1 (vllm-ascend pads decode
``seq_lens`` with 1) and its block-table row and slot in a padding block that the program asks
the runner to allocate beyond the pool (``padding_blocks``), which the KV manager never hands out.
A piecewise step is padded to its token bucket with one padding sequence of ``N - T`` query rows
and KV length ``N - T`` in the same padding block (:func:`pad_tokens`).
"""
from __future__ import annotations

import copy
import math
import operator
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from pagedpack.lowering.ascend.lower import HOST_LENGTH_INPUTS, AscendOps, host_lengths
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import StepMetadata

GRAPH_MODES = ("full_and_piecewise", "full_decode_only", "eager", "decode_buckets", "dynamic")
GRAPH_MODE_ALIASES = {"aclgraph": "full_decode_only"}  # this target's name for it until issue 61
DEFAULT_GRAPH_MODE = "full_and_piecewise"
BUCKET_MODES = ("full_and_piecewise", "full_decode_only", "decode_buckets")
EAGER_LOWERED_MODES = ("full_and_piecewise", "full_decode_only", "eager")  # host lengths; run or captured eagerly
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# vLLM's default cudagraph_capture_sizes (vllm/config/compilation.py, v0.11-v0.13) at its 512 cap;
# vllm-ascend (aclgraph_capture_sizes) trims them further to its stream budget.
DEFAULT_GRAPH_TOKEN_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


@dataclass
class GraphStats:
    """What a graph mode did so far: graphs compiled or captured (bucket sizes for the bucket
    modes), how many steps ran in a graph and how many eagerly; for the ACL graph modes also the
    seconds spent refreshing FIA's host lengths and replaying (host time, summed over replays);
    for ``full_and_piecewise`` the steps run in pieces and, per ``(piece, token bucket)``, the
    captures and replays of each captured piece (``piece`` its submodule's name, ``submod_0``, ...)."""

    mode: str
    graphs_compiled: int = 0
    buckets_compiled: list[int] = field(default_factory=list)
    graph_steps: int = 0
    eager_steps: int = 0
    refresh_s: float = 0.0
    replay_s: float = 0.0
    piecewise_steps: int = 0
    piece_captures: Counter = field(default_factory=Counter)
    piece_replays: Counter = field(default_factory=Counter)

    def describe(self) -> str:
        buckets = f" (batch sizes {', '.join(map(str, self.buckets_compiled))})" if self.buckets_compiled else ""
        if self.mode == "eager":
            return f"eager: {self.eager_steps} steps eagerly"
        if self.mode not in ("full_and_piecewise", "full_decode_only"):
            return (f"{self.mode}: {self.graphs_compiled} graph(s) compiled{buckets}; {self.graph_steps} steps ran "
                    f"in a compiled graph, {self.eager_steps} eagerly")
        timing = (f" (length refresh {1e3 * self.refresh_s / self.graph_steps:.3f} ms and replay "
                  f"{1e3 * self.replay_s / self.graph_steps:.1f} ms per replay)") if self.graph_steps else ""
        pieces = ""
        if self.mode == "full_and_piecewise":
            sizes = sorted({bucket for _, bucket in self.piece_captures})
            pieces = (f"; {sum(self.piece_captures.values())} piece graph(s) captured"
                      f"{' (token sizes ' + ', '.join(map(str, sizes)) + ')' if sizes else ''}, "
                      f"{self.piecewise_steps} steps in pieces")
        return (f"{self.mode}: {self.graphs_compiled} graph(s) captured{buckets}; {self.graph_steps} replays{timing}"
                f"{pieces}, {self.eager_steps} steps eagerly")


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


def _append_sequences(metadata: list[torch.Tensor], query_lens: list[int], *, width: int, padding_block: int,
                      block_size: int) -> list[torch.Tensor]:
    """The first six metadata inputs with padding sequences of ``query_lens`` rows appended: token
    id 0 at position 0, KV length equal to the query length, block-table rows of ``padding_block``
    (the table ``[B + P, width]``, real rows padded with it) and slots
    ``padding_block * block_size + i % block_size`` for the ``i``-th padding row."""
    input_ids, positions, cu_seqlens_q, seq_lens, block_table, slot_mapping = metadata[:6]
    rows, device = sum(query_lens), input_ids.device
    lengths = torch.tensor(query_lens, dtype=seq_lens.dtype, device=device)
    table = block_table.new_full((seq_lens.shape[0] + len(query_lens), width), padding_block)
    table[:seq_lens.shape[0], :block_table.shape[1]] = block_table
    slots = padding_block * block_size + torch.arange(rows, device=device) % block_size
    return [
        torch.cat([input_ids, input_ids.new_zeros(rows)]),
        torch.cat([positions, positions.new_zeros(rows)]),
        torch.cat([cu_seqlens_q, cu_seqlens_q[-1] + lengths.cumsum(0).to(cu_seqlens_q.dtype)]),
        torch.cat([seq_lens, lengths]),
        table,
        torch.cat([slot_mapping, slots.to(slot_mapping.dtype)]),
    ]


def pad_decode(metadata: list[torch.Tensor], bucket: int, *, width: int, padding_block: int,
               block_size: int) -> list[torch.Tensor]:
    """The seven metadata inputs of a decode step (``T == B``) padded to ``bucket`` sequences.

    Padding sequence ``i`` (of ``P = bucket - B``) has token id 0 at position 0, one query row,
    ``seq_lens`` 1, a block-table row of ``padding_block`` and slot
    ``padding_block * block_size + i % block_size``; ``logits_indices`` point at its own row.
    ``block_table`` becomes ``[bucket, width]`` (real rows padded with ``padding_block``).
    ``ValueError`` if the step is not a decode step or does not fit.
    """
    num_seqs, num_tokens, columns = metadata[3].shape[0], metadata[0].shape[0], metadata[4].shape[1]
    if num_tokens != num_seqs or not num_seqs <= bucket or columns > width:
        raise ValueError(f"pad_decode: expected a decode step (T == B) with B <= bucket={bucket} and at most "
                         f"{width} block-table columns, got T={num_tokens}, B={num_seqs}, {columns} columns")
    pad = bucket - num_seqs
    logits_indices = metadata[6]
    return [*_append_sequences(metadata, [1] * pad, width=width, padding_block=padding_block, block_size=block_size),
            torch.cat([logits_indices, num_tokens + torch.arange(pad, device=logits_indices.device)])]


def pad_tokens(metadata: list[torch.Tensor], bucket: int, *, padding_block: int,
               block_size: int) -> list[torch.Tensor]:
    """The seven metadata inputs of any step of ``T <= bucket`` tokens padded to ``bucket`` tokens
    (:class:`PiecewiseGraphs`): one padding sequence of ``P = bucket - T`` query rows (none when
    ``P == 0``), KV length ``P``, its ``ceil(P / block_size)`` block-table columns all
    ``padding_block`` (the table widened to them if narrower), slots
    ``padding_block * block_size + i % block_size`` (several rows may share a slot: padding keys are
    never read as real ones). ``logits_indices`` are unchanged (the logits are computed eagerly on the
    real rows). One sequence, not ``P`` (as :func:`pad_decode`), so that ``B`` stays within TND's
    sequence limit for any bucket; ``T == actual_seq_lengths[-1]`` holds (vllm-ascend #6076).
    ``ValueError`` if ``T > bucket``."""
    num_tokens, columns = metadata[0].shape[0], metadata[4].shape[1]
    if num_tokens > bucket:
        raise ValueError(f"pad_tokens: expected at most bucket={bucket} tokens, got T={num_tokens}")
    pad = bucket - num_tokens
    return [*_append_sequences(metadata, [pad] if pad else [], width=max(columns, math.ceil(pad / block_size)),
                               padding_block=padding_block, block_size=block_size), metadata[6]]


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
            return self.run_other(inputs, metadata, caches)
        key_cache = caches[0]
        padded = pad_decode(metadata, bucket, width=self.max_blocks_per_seq, padding_block=key_cache.shape[0] - 1,
                            block_size=key_cache.shape[1])
        self.stats.graph_steps += 1
        return self.run_bucket(bucket, padded, caches, metadata.num_seqs)

    def run_bucket(self, bucket: int, padded: list[torch.Tensor], caches, num_seqs: int) -> torch.Tensor:
        """The first ``num_seqs`` logits rows of the padded decode step."""
        raise NotImplementedError

    def run_other(self, inputs: tuple[torch.Tensor, ...], metadata: StepMetadata, caches) -> torch.Tensor:
        """A step no decode bucket takes: the eager program."""
        self.stats.eager_steps += 1
        return run_eager(self.eager, inputs, metadata)


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
    """The ``full_decode_only`` graph mode (module docstring). ``eager``: the step graph lowered with host
    lengths, for eager steps and captured per bucket. ``graph_api``: ``torch.npu`` on an NPU, else
    :mod:`pagedpack.kernels.npu_graph_emulation` (``NPUGraph`` and ``graph``). ``kv_updates``: per
    FIA call of ``eager``, in graph order, the name of its KV-lengths argument (v1 and v2 differ)
    and whether its site appends the sliding window's dummy sequence (its list then ends in a 0)."""

    def __init__(self, eager: Callable, *, batch_sizes: list[int], max_blocks_per_seq: int, graph_api,
                 kv_updates: list[tuple[str, bool]]):
        super().__init__(eager, batch_sizes=batch_sizes, max_blocks_per_seq=max_blocks_per_seq,
                         stats=GraphStats("full_decode_only"))
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


def run_eager(eager: Callable, inputs: tuple[torch.Tensor, ...], metadata: StepMetadata) -> torch.Tensor:
    """``eager`` (a step graph lowered with host lengths) on ``inputs`` and this step's host lists."""
    return eager(*inputs, *host_lengths(metadata.cu_seqlens_q, metadata.seq_lens))


class EagerSteps:
    """The ``eager`` graph mode (vllm-ascend's ``NONE``): every step runs the eager program."""

    padding_blocks = 0

    def __init__(self, eager: Callable):
        self.eager, self.stats = eager, GraphStats("eager")

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.stats.eager_steps += 1
        return run_eager(self.eager, inputs, StepMetadata(*inputs[:len(METADATA_INPUTS)]))


def split_at_attention(gm: torch.fx.GraphModule, ops: AscendOps) -> tuple[torch.fx.GraphModule, set[str]]:
    """``gm`` (lowered with host lengths) split as vLLM's piecewise backend splits at its
    ``splitting_ops`` (``vllm/compilation/backends.py: split_graph``, v0.11-v0.13): the split
    module, whose submodules run in order, and the names of those to capture (the pieces).

    The other submodules run eagerly: each attention region, from a site's first cache write
    (``scatter_nd_update_``) through its FIA call and the ``getitem`` of its output, as vLLM's
    ``unified_attention_with_output`` writes the KV cache and attends in one splitting op (the cache
    write reads ``slot_mapping``, whose padding rows differ per step; kept eager with its FIA it
    needs no captured copy of the cache views); and the logits region, from the first node reading
    ``logits_indices`` to the output, as vLLM computes logits outside its graphs (on the real rows
    only, so ``logits_indices`` needs no padding). ``ValueError`` if a piece would read a host length
    list (it would be frozen at capture) or nothing reads ``logits_indices``."""
    from torch.fx.passes.split_module import split_module

    writes, attends = {ops.scatter_nd_update_}, {ops.fused_infer_attention_score_eager,
                                                 ops.fused_infer_attention_score_v2_eager}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    logits_indices = placeholders[METADATA_INPUTS[-1]]
    partition, eager_parts = {}, set()
    part, region, attended = 0, None, None  # region: "attention" or "logits" while inside one
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if region == "attention" and attended is not None and not (
                node.target is operator.getitem and node.args[0] is attended):
            region, part = None, part + 1
        if region is None and (node.target in writes | attends or logits_indices in node.all_input_nodes):
            region, attended, part = ("logits" if logits_indices in node.all_input_nodes else "attention"), None, \
                part + 1
        if region == "attention" and node.target in attends:
            attended = node
        partition[node] = part
        if region is not None:
            eager_parts.add(part)
    if region != "logits":
        raise ValueError("split_at_attention: no node reads logits_indices, so the step's logits would come out "
                         "of a captured piece's static output")
    split = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    names = {f"submod_{p}" for p in set(partition.values()) - eager_parts}
    host = set(HOST_LENGTH_INPUTS)
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in names and host & {a.name for a in node.all_input_nodes}:
            raise ValueError(f"split_at_attention: piece {node.target} reads a host length list; only the "
                             "attention regions may")
    return split, names


@dataclass
class _CapturedPiece:
    """One piece's ACL graph at one token bucket: its arguments as captured (a buffer per tensor
    argument, which each replay copies into; the KV caches themselves, which it may read or view;
    non-tensor arguments, frozen), the caches and its output (tensors the replay writes)."""

    graph: object
    args: list
    caches: tuple[torch.Tensor, ...]
    output: object


class PiecewiseGraphs(ACLGraphBuckets):
    """The ``full_and_piecewise`` graph mode (module docstring): uniform decode steps in a decode
    bucket as :class:`ACLGraphBuckets`; every other step of ``T <= max(token_sizes)`` tokens padded
    to the smallest token bucket ``N >= T`` (:func:`pad_tokens`) and run through
    :func:`split_at_attention`'s split module: each piece captured as an ACL graph on its first
    step at ``N`` (``graph_api.graph``, no updatable calls in it), then replayed with this step's
    tensors copied into its captured buffers (:meth:`load`); the attention and logits regions eager,
    FIA with the padded step's host lists. Steps above the largest bucket run the eager program."""

    def __init__(self, eager: torch.fx.GraphModule, *, token_sizes: list[int], ops: AscendOps, **decode):
        super().__init__(eager, **decode)
        self.stats.mode = "full_and_piecewise"
        self.token_sizes = sorted(token_sizes)
        self.split, self.pieces = split_at_attention(eager, ops)
        self.captured_pieces: dict[tuple[str, int], _CapturedPiece] = {}

    def run_other(self, inputs, metadata, caches):
        bucket = next((size for size in self.token_sizes if size >= metadata.num_tokens), None)
        if bucket is None:
            return super().run_other(inputs, metadata, caches)
        padded = pad_tokens(metadata, bucket, padding_block=caches[0].shape[0] - 1, block_size=caches[0].shape[1])
        self.stats.piecewise_steps += 1
        return _PiecewiseRun(self, bucket, caches).run(*padded, *caches, *host_lengths(padded[2], padded[3]))

    def run_piece(self, name: str, bucket: int, args: tuple, caches: tuple[torch.Tensor, ...]) -> object:
        """Piece ``name`` at ``bucket``: captured on first use (again if the caches changed), replayed."""
        captured = self.captured_pieces.get((name, bucket))
        if captured is None or any(a is not b for a, b in zip(captured.caches, caches)):
            buffers = [a.clone() if isinstance(a, torch.Tensor) and not any(a is c for c in caches) else a
                       for a in args]
            graph = self.graph_api.NPUGraph()
            with self.graph_api.graph(graph):
                output = getattr(self.split, name)(*buffers)
            captured = self.captured_pieces[name, bucket] = _CapturedPiece(graph, buffers, tuple(caches), output)
            self.stats.piece_captures[name, bucket] += 1
        self.load(captured, args)
        captured.graph.replay()
        self.stats.piece_replays[name, bucket] += 1
        return captured.output

    @staticmethod
    def load(captured: _CapturedPiece, args: tuple) -> None:
        """The per-replay update: this step's tensors into the piece's captured buffers (a replay
        reads nothing else). ``RuntimeError`` if a shape or a non-tensor argument differs from the
        capture's (a replay cannot change either)."""
        for buffer, value in zip(captured.args, args):
            if not isinstance(value, torch.Tensor):
                if value != buffer:
                    raise RuntimeError(f"piecewise replay: a host argument was {buffer!r} at capture, now {value!r}")
            elif buffer is not value:
                if buffer.shape != value.shape:
                    raise RuntimeError(f"piecewise replay: captured shape {tuple(buffer.shape)}, "
                                       f"got {tuple(value.shape)}")
                buffer.copy_(value)


class _PiecewiseRun(torch.fx.Interpreter):
    """One step through the split module: pieces through :meth:`PiecewiseGraphs.run_piece`, the
    attention and logits regions called as they are."""

    def __init__(self, program: PiecewiseGraphs, bucket: int, caches):
        super().__init__(program.split, garbage_collect_values=True)
        self.program, self.bucket, self.caches = program, bucket, caches

    def call_module(self, target, args, kwargs):
        if target in self.program.pieces:
            return self.program.run_piece(target, self.bucket, args, self.caches)
        return super().call_module(target, args, kwargs)


class RecurrentSteps:
    """The ACL graph modes (and ``eager``) of a model with recurrent state: no decode graphs are captured (a padded
    bucket's padding rows would need state slots the runner does not have), every step runs eagerly
    with host lengths, in one of two lowerings (:mod:`pagedpack.lowering.ascend.recurrent`): a
    decode-only step (``T == B``, every sequence continuing its state) ``decode``, the recurrent ops'
    decode form; any other step ``prefill``. Reading ``has_initial_state`` is one device-to-host read
    a step, beside the host lengths'. ``num_caches``: the KV cache inputs (the state inputs follow
    them: ``state_indices, has_initial_state``, the states)."""

    padding_blocks = 0

    def __init__(self, prefill: Callable, decode: Callable, *, num_caches: int, mode: str):
        self.prefill, self.decode, self.num_caches = prefill, decode, num_caches
        self.stats = GraphStats(mode)
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


def check_sizes(name: str, sizes, *, limit: int) -> list[int]:
    """``sizes`` (the option ``name``: ``graph_batch_sizes``, ``graph_token_sizes``) as a sorted list
    of distinct ints in ``1..limit``; ``ValueError`` naming the option."""
    ok = isinstance(sizes, (list, tuple)) and sizes and all(
        isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= limit for s in sizes)
    if not ok:
        raise ValueError(f"{name}: expected a non-empty list of ints in 1..{limit}, got {sizes!r}")
    return sorted(set(sizes))


def max_blocks_per_seq(max_model_len: int | None, block_size: int) -> int:
    """The static block-table width of a bucket graph."""
    if max_model_len is None:
        raise ValueError("max_model_len: the bucket graph modes size its block tables by it, and the model "
                         "records no limit; pass max_model_len")
    return math.ceil(max_model_len / block_size)
