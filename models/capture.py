"""Capture a causal LM as an FX graph with ``torch.export`` and a dynamic token dimension.

The captured program is the model's forward for one sequence of ``T`` tokens (batch 1): the
per-token ops of any packed step are exactly these, which is why one graph serves every step
(DESIGN.md). The passes then rewrite the few sequence-aware parts.
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

    ``graph_module(input_ids [1, T] int64, position_ids [1, T] int64) -> logits [1, T, V]``.
    ``max_num_tokens`` is the upper bound the token dimension was exported with.
    """

    graph_module: torch.fx.GraphModule
    max_num_tokens: int
    example_num_tokens: int


def capture(model: torch.nn.Module, *, max_num_tokens: int, example_num_tokens: int = 8) -> CapturedModel:
    """Export ``model`` (a ``transformers`` causal LM in eval mode) for one sequence.

    ``max_num_tokens`` bounds the dynamic token dimension (use the model's maximum position).
    Raises ``ValueError`` if the bound is smaller than the example length.
    """
    if max_num_tokens <= example_num_tokens:
        raise ValueError(f"max_num_tokens: expected > {example_num_tokens}, got {max_num_tokens}")
    device = next(model.parameters()).device
    input_ids = torch.zeros(1, example_num_tokens, dtype=torch.long, device=device)
    position_ids = torch.arange(example_num_tokens, device=device)[None]
    num_tokens = torch.export.Dim("num_tokens", min=1, max=max_num_tokens)
    with torch.no_grad():
        exported = torch.export.export(
            _LogitsOnly(model),
            (input_ids, position_ids),
            dynamic_shapes=({1: num_tokens}, {1: num_tokens}),
        )
    graph_module = exported.module()
    # Plain positional calling convention instead of export's pytree one (and its input-spec
    # check), so that passes can add inputs.
    graph_module.graph._codegen = torch.fx.graph.CodeGen()
    graph_module._forward_pre_hooks.clear()
    graph_module.recompile()
    return CapturedModel(graph_module, max_num_tokens, example_num_tokens)
