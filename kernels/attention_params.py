"""The per-call attention parameters of ``paged_attention`` and ``varlen_attention``, in one record.

The pass fills an :class:`AttentionParams` and emits the op with :meth:`AttentionParams.op_kwargs`;
every lowering reads them back off the graph by name with :meth:`AttentionParams.from_node` (which
normalises ``node.args`` + ``node.kwargs`` against the op's schema, so a lowering never depends on
argument positions, and a graph that calls the op positionally, e.g. an older ``.pt2``, reads the
same).

Semantics (one sequence; query row ``i`` of ``q_len`` rows over ``kv_len`` keys, so the row's
absolute position is ``query_pos = kv_len - q_len + i`` and key ``j`` sits at position ``j``):

1. ``scores = q . k^T * scale`` (fp32);
2. ``logits_soft_cap``: ``scores = cap * tanh(scores / cap)`` (Gemma 2), before any bias or mask;
3. ``alibi_slopes``: ``scores[h] += slope[h] * (j - query_pos)`` (BLOOM/MPT/Falcon, FlashAttention's
   ``alibi_slopes``);
4. the mask: causal bottom-right ``j <= query_pos``, and with ``sliding_window = w`` also
   ``j >= query_pos - w + 1``, i.e. row ``i`` sees keys ``max(0, query_pos - w + 1) .. query_pos``
   (``w`` keys including its own, as ``transformers`` masks Mistral/Gemma sliding windows); with
   ``attention_chunk_size = c`` also ``j >= (query_pos // c) * c``: the row sees only the keys of its
   own chunk of ``c`` positions (Llama-4's chunked local attention, vLLM's ``attention_chunk_size``);
5. ``sinks``: a per-head logit that joins the softmax denominator (gpt-oss): softmax over
   ``[scores, sink]``, the sink column dropped, so a row's weights sum to less than one;
6. a row that sees no key gives zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.fx
from torch import Tensor

PARAM_NAMES = ("sliding_window", "logits_soft_cap", "alibi_slopes", "sinks", "attention_chunk_size")


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """What one attention call computes besides ``softmax(q k^T * scale) v`` with the causal mask.

    Attributes:
        scale: multiplier of ``q @ k^T`` (usually ``head_dim ** -0.5``).
        sliding_window: left window in tokens (``>= 1``), bottom-right aligned: query row ``i``
            sees keys ``max(0, i + kv_len - q_len - w + 1) .. i + kv_len - q_len``; None: every
            earlier key.
        logits_soft_cap: ``cap > 0``: ``scores = cap * tanh(scores / cap)`` before bias and mask.
        alibi_slopes: float ``[num_heads]``: bias ``slope[h] * (key_pos - query_pos)`` with key_pos
            ``0 .. kv_len - 1`` and query_pos ``kv_len - q_len + i``.
        sinks: float ``[num_heads]``: a learned logit per head in the softmax denominator
            (softmax over ``[scores, sink]``, the sink column dropped).
        attention_chunk_size: chunk length in positions (``>= 1``): query position ``p`` sees only
            keys ``(p // c) * c .. p`` (Llama-4); None: no chunks.

    Tensors may be fx ``Node``\\ s in a record read off a graph (:meth:`from_node`). Equality is
    identity (tensor fields have no boolean ``==``).

    Raises:
        ValueError: a value outside the ranges above (tensor shapes are checked by the ops,
            which know ``num_heads``).
    """

    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        cap = self.logits_soft_cap
        for name in ("sliding_window", "attention_chunk_size"):
            size = getattr(self, name)
            if not _is_node(size) and not (size is None or (_is_int(size) and size >= 1)):
                raise ValueError(f"{name}: expected None or an int >= 1, got {size!r}")
        if not _is_node(cap) and not (cap is None or (_is_real(cap) and math.isfinite(cap) and cap > 0)):
            raise ValueError(f"logits_soft_cap: expected None or a finite float > 0, got {cap!r}")
        for name in ("alibi_slopes", "sinks"):
            t = getattr(self, name)
            if isinstance(t, Tensor) and (t.dim() != 1 or not t.is_floating_point()):
                raise ValueError(f"{name}: expected None or a floating-point [num_heads] tensor, got "
                                 f"{str(t.dtype).removeprefix('torch.')} shape {tuple(t.shape)}")

    @property
    def is_default(self) -> bool:
        """True when no parameter is set (plain causal softmax attention)."""
        return all(getattr(self, name) is None for name in PARAM_NAMES)

    def op_kwargs(self) -> dict[str, Any]:
        """Every field by name, ``scale`` included: ``graph.call_function(op, args, params.op_kwargs())``
        after the op's tensor arguments (tensors may be replaced by the fx Nodes that hold them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        """Short text for the pass report, e.g. ``"window=512, soft_cap=50.0"``; ``""`` when none is set."""
        parts = []
        if self.sliding_window is not None:
            parts.append(f"window={self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"soft_cap={self.logits_soft_cap}")
        if self.alibi_slopes is not None:
            parts.append("alibi")
        if self.sinks is not None:
            parts.append("sinks")
        if self.attention_chunk_size is not None:
            parts.append(f"chunk={self.attention_chunk_size}")
        return ", ".join(parts)

    @classmethod
    def from_node(cls, node: torch.fx.Node) -> AttentionParams:
        """The parameters of a ``paged_attention`` / ``paged_attention_functional`` /
        ``varlen_attention`` call node, by name (tensors as the Nodes that produce them).

        Raises ``ValueError`` if the node's op has no ``scale`` argument."""
        values = op_arguments(node)
        if "scale" not in values:
            raise ValueError(f"node: expected a call of an attention op with a scale argument, got {node.target}")
        return cls(**{f.name: values.get(f.name) for f in fields(cls)})


def _is_node(value) -> bool:  # a value read off a graph: the op checks it when it runs
    return isinstance(value, torch.fx.Node)


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, torch.SymFloat)) and not isinstance(value, bool)


def op_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """Every argument of the op ``node`` calls, by schema name, defaults filled in.

    ``node.target`` must be an ``OpOverload`` (``torch.ops.ns.op.default``); arguments may be
    given positionally or by keyword. Raises ``ValueError`` for anything else or an argument
    the schema does not have."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        raise ValueError(f"node: expected a call of an OpOverload, got {node.target!r}")
    arguments = schema.arguments
    if len(node.args) > len(arguments):
        raise ValueError(f"node: {len(node.args)} positional arguments for {schema.name}, which takes "
                         f"{len(arguments)}")
    names = {a.name for a in arguments}
    unknown = set(node.kwargs) - names
    if unknown:
        raise ValueError(f"node: {schema.name} has no argument(s) {sorted(unknown)}")
    values = {}
    for index, argument in enumerate(arguments):
        if index < len(node.args):
            values[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
        else:
            raise ValueError(f"node: {schema.name} call without its required argument {argument.name}")
    return values
