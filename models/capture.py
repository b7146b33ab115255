"""Capture a causal LM as an FX graph with ``torch.export`` and a dynamic token dimension.

The captured program is the model's forward for one sequence of ``T`` tokens (batch 1): the
per-token ops of any packed step are exactly these, which is why one graph serves every step
(docs/design.md). The passes then rewrite the few sequence-aware parts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx


class _LogitsOnly(torch.nn.Module):
    """``(input_ids [1, T], position_ids [1, T]) -> logits [1, T, vocab]``, no KV cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


@dataclass
class CapturedModel:
    """An exported causal LM as a plain positional ``GraphModule``.

    ``graph_module(input_ids [1, T] int64, position_ids [1, T] int64) -> logits [1, T, V]``,
    for any ``T >= 1`` (export's range guards are dropped by the rewrite).
    """

    graph_module: torch.fx.GraphModule
    example_num_tokens: int


def capture(model: torch.nn.Module, *, example_num_tokens: int = 8) -> CapturedModel:
    """Export ``model`` (a ``transformers`` causal LM in eval mode) for one sequence.

    The token dimension is exported dynamic (``Dim.DYNAMIC``: export may narrow its range,
    e.g. to a position table's size; a packed step can hold more tokens than one sequence).
    The example is ``example_num_tokens`` long, at most the model's position limit.
    Raises ``ValueError`` if that leaves fewer than 2 tokens (export specialises 0 and 1).
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or example_num_tokens
    num_tokens = min(example_num_tokens, int(limit))
    if num_tokens < 2:
        raise ValueError(f"model: expected max_position_embeddings >= 2 to capture it, got {limit}")
    device = next(model.parameters()).device
    input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
    position_ids = torch.arange(num_tokens, device=device)[None]
    dynamic = torch.export.Dim.DYNAMIC
    with torch.no_grad():
        exported = torch.export.export(_LogitsOnly(model), (input_ids, position_ids),
                                       dynamic_shapes=({1: dynamic}, {1: dynamic}))
    graph_module = exported.module()
    # Plain positional calling convention instead of export's pytree one (and its input-spec
    # check), so that passes can add inputs.
    graph_module.graph._codegen = torch.fx.graph.CodeGen()
    graph_module._forward_pre_hooks.clear()
    graph_module.recompile()
    return CapturedModel(graph_module, num_tokens)
