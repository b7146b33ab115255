"""Capture a causal LM as an FX graph with ``torch.export`` and a dynamic token dimension.

The captured program is the model's forward for one sequence of ``T`` tokens (batch 1): the
per-token ops of any packed step are exactly these, which is why one graph serves every step
(docs/design.md). The passes then rewrite the few sequence-aware parts.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx
import torch.fx.config
from torch._dynamo.exc import UserError
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from pagedpack.models.config import mask_reach, position_limit, rope_type
from pagedpack.models.recurrent import first_recurrent, recurrent_refusal
from pagedpack.models.seams import kernel_seams
from pagedpack.models.sparse import first_indexer, indexer_refusal
from pagedpack.step.contract import UnsupportedModelError

# RoPE variants whose frequencies depend on the longest position of the call: in a packed step
# that would couple the sequences. (transformers' dynamic NTK rescales inv_freq from max(position_ids);
# LongRoPE switches every position to its long factors once max(position_ids) + 1 passes
# original_max_position_embeddings: modeling_rope_utils.dynamic_rope_update.)
_CALL_DEPENDENT_ROPE = {
    "dynamic": "dynamic-NTK RoPE recomputes its frequencies from the longest position of the forward call, "
               "which in a packed step would depend on the other sequences; not supported",
    "longrope": "LongRoPE takes its long or short factors for the whole forward call from its longest position, "
                "which in a packed step would depend on the other sequences; not supported",
}


@contextlib.contextmanager
def _no_stack_traces():
    """``torch.fx.config.do_not_emit_stack_traces`` set for the block (a plain module attribute)."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


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
    window_hint: int | None = None  # the config's sliding window or attention chunk: masks are checked past it

    def sample(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, position_ids)`` of one sequence of ``num_tokens`` (zeros, 0 .. n-1)."""
        device = next(self.graph_module.parameters()).device
        return (torch.zeros(1, num_tokens, dtype=torch.long, device=device),
                torch.arange(num_tokens, device=device)[None])


def capture(model: torch.nn.Module, *, example_num_tokens: int = 8) -> CapturedModel:
    """Export ``model`` (a ``transformers`` causal LM in eval mode) for one sequence.

    The token dimension is exported dynamic (``Dim.DYNAMIC``: export may narrow its range,
    e.g. to a position table's size; a packed step can hold more tokens than one sequence).
    The example is ``example_num_tokens`` long, at most the model's position limit.
    Raises ``ValueError`` if that leaves fewer than 2 tokens (export specialises 0 and 1);
    :class:`~pagedpack.step.contract.UnsupportedModelError` for a model feature whose computation
    depends on the longest position of the call (a known one, e.g. dynamic-NTK RoPE, named up
    front, as are layers with a recurrent state pagedpack does not page, :mod:`pagedpack.models.recurrent`, and
    sparse-attention indexers it does not page, :mod:`pagedpack.models.sparse`; otherwise
    export's data-dependent guard error, kept as the cause) and for any other error of the export
    (its message kept).
    """
    config = getattr(model, "config", None)
    limit = position_limit(config) if config is not None else None
    num_tokens = min(example_num_tokens, example_num_tokens if limit is None else limit)
    if num_tokens < 2:
        raise ValueError(f"model: expected a position limit >= 2 to capture it, got {limit}")
    if config is not None and rope_type(config) in _CALL_DEPENDENT_ROPE:
        raise UnsupportedModelError(f"rope_type={rope_type(config)!r}: {_CALL_DEPENDENT_ROPE[rope_type(config)]}")
    recurrent = first_recurrent(((path, type(module)) for path, module in model.named_modules()), paged=True)
    if recurrent is not None:
        raise UnsupportedModelError(recurrent_refusal(*recurrent))
    indexer = first_indexer(((path, type(module)) for path, module in model.named_modules()), paged=True)
    if indexer is not None:
        raise UnsupportedModelError(indexer_refusal(*indexer))
    device = next(model.parameters()).device
    input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
    position_ids = torch.arange(num_tokens, device=device)[None]
    dynamic = torch.export.Dim.DYNAMIC
    try:
        # No Python stack trace per node (node.meta["stack_trace"]): nothing here reads them (the passes
        # locate sites by nn_module_stack), and extracting them cost ~10 % of a tiny model's capture.
        # The graph, its other metadata and the generated code's statements are the same.
        with torch.no_grad(), kernel_seams(model), _no_stack_traces():
            exported = torch.export.export(_LogitsOnly(model), (input_ids, position_ids),
                                           dynamic_shapes=({1: dynamic}, {1: dynamic}))
    except (GuardOnDataDependentSymNode, UserError) as err:
        raise UnsupportedModelError(
            f"torch.export cannot capture {type(model).__name__} for a dynamic number of tokens: its forward "
            f"makes a data-dependent choice ({type(err).__name__}; the first lines: {str(err)[:300]!r})") from err
    except Exception as err:  # export's own failures are many types: the model cannot be captured, say why
        raise UnsupportedModelError(
            f"torch.export cannot capture {type(model).__name__} on one sequence of {num_tokens} tokens "
            f"({type(err).__name__}: {str(err).strip()[:300]})") from err
    graph_module = exported.module()
    # Plain positional calling convention instead of export's pytree one (and its input-spec
    # check), so that passes can add inputs.
    graph_module.graph._codegen = torch.fx.graph.CodeGen()
    graph_module._forward_pre_hooks.clear()
    graph_module.recompile()
    return CapturedModel(graph_module, num_tokens, mask_reach(config) if config is not None else None)
