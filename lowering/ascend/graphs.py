"""Graph modes of the ``ascend`` target: which steps run in a compiled graph, which eagerly.

``"decode_buckets"`` (the default) is the pattern production Ascend inference ships: vllm-ascend's
former TorchAir model runner compiled decode only, with static shapes and the batch padded to a
list of graph batch sizes (``torchair_graph_config.graph_batch_sizes``), prefill eager;
cann-recipes-infer compiles decode with ``dynamic=False`` and runs prefill eagerly. TorchAir's
docs say that any dynamic dimension makes FIA compute its tiling on the host every step, which
static graphs avoid. Here:

- a step of decodes only (every sequence computes one token: ``T == B``, one logits row each) with
  ``B`` at most the largest bucket runs the static graph of the smallest bucket ``>= B``
  (compiled on first use, then reused). The metadata is padded to the bucket by
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
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from pagedpack.contract import METADATA_INPUTS
from pagedpack.metadata import StepMetadata

GRAPH_MODES = ("decode_buckets", "dynamic")
DEFAULT_GRAPH_MODE = "decode_buckets"
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class GraphStats:
    """What a graph mode did so far: graphs compiled (bucket sizes for ``decode_buckets``) and how
    many steps ran in a compiled graph and how many eagerly."""

    mode: str
    graphs_compiled: int = 0
    buckets_compiled: list[int] = field(default_factory=list)
    graph_steps: int = 0
    eager_steps: int = 0

    def describe(self) -> str:
        buckets = f" (batch sizes {', '.join(map(str, self.buckets_compiled))})" if self.buckets_compiled else ""
        return (f"{self.mode}: {self.graphs_compiled} graph(s) compiled{buckets}; {self.graph_steps} steps ran in a "
                f"compiled graph, {self.eager_steps} eagerly")


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


class DecodeBuckets:
    """The ``decode_buckets`` graph mode (module docstring): a step program over caches of
    ``num_blocks + padding_blocks`` blocks.

    ``graph``: the step graph lowered for compiled graphs (tensor lengths); a copy is compiled per
    bucket with ``backend`` (``torch.compile(..., dynamic=False, fullgraph=True)``). ``eager``: the
    step graph lowered for eager runs (host lengths). ``batch_sizes``: the buckets, ascending.
    ``max_blocks_per_seq``: the static block-table width, ``ceil(max_model_len / block_size)``.
    """

    padding_blocks = 1

    def __init__(self, graph: torch.fx.GraphModule, eager: Callable, *, batch_sizes: list[int],
                 max_blocks_per_seq: int, backend: Callable):
        self.graph, self.eager, self.batch_sizes = graph, eager, sorted(batch_sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.stats = GraphStats("decode_buckets")
        self.backend = counting(backend, self.stats)
        self.graphs: dict[int, Callable] = {}

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
            return self.eager(*inputs)
        if bucket not in self.graphs:
            self.graphs[bucket] = torch.compile(copy_module(self.graph), backend=self.backend, dynamic=False,
                                                fullgraph=True)
            self.stats.buckets_compiled.append(bucket)
        key_cache = caches[0]
        padded = pad_decode(metadata, bucket, width=self.max_blocks_per_seq, padding_block=key_cache.shape[0] - 1,
                            block_size=key_cache.shape[1])
        self.stats.graph_steps += 1
        return self.graphs[bucket](*padded, *caches)[:metadata.num_seqs]


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
        raise ValueError("max_model_len: the decode_buckets graph mode sizes its block tables by it, and the model "
                         "records no limit; pass max_model_len")
    return math.ceil(max_model_len / block_size)
