"""Apply the LM head to the ``logits_indices`` rows only.

The captured graph computes logits for all ``T`` tokens; a step needs one row per sequence
(its last token), and the prompt rows of requests asking for prompt logprobs: ``R`` rows in all.
The gather goes in front of the LM head's ``linear`` when the path from it to the output is
row-wise (casts, scaling, soft-capping), else at the output itself.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from pagedpack.passes.manager import Pass, PassContext, PassResult

aten = torch.ops.aten
_ROW_WISE = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default,
             aten.mul.Tensor, aten.div.Tensor, aten.tanh.default, aten.contiguous.default}


class GatherLogits(Pass):
    """``gather_logits``: return the logits of the ``logits_indices`` rows only, ``[R, vocab]``.

    Counts: matched = rewritten = 1 (the graph output).
    """

    name = "gather_logits"
    requires = ("inputs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        where = gather_logits(ctx.graph, ctx.inputs["logits_indices"])
        ctx.report.notes.append("logits gathered " + where)
        return PassResult(matched=1, rewritten=1)


def gather_logits(graph: torch.fx.Graph, logits_indices: Node) -> str:
    """Make the graph return ``logits [len(logits_indices), vocab]``; returns where it gathered."""
    output = graph.output_node()
    (logits,) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    node = logits
    while node.op == "call_function" and node.target in _ROW_WISE and _scalar_tail(node):
        node = node.args[0]
    if node.op == "call_function" and node.target is aten.linear.default:
        consumer, target, where = node, node.args[0], f"before the LM head ({node.name})"
    else:
        consumer, target, where = None, logits, "at the output (no row-wise path to a linear LM head)"
    with graph.inserting_after(target):
        rows = graph.call_function(aten.index_select.default, (target, 1, logits_indices))
    if consumer is not None:
        consumer.replace_input_with(target, rows)
        last = logits
    else:
        last = rows
    with graph.inserting_before(output):
        squeezed = graph.call_function(aten.squeeze.dim, (last, 0))
    output.args = (squeezed,)
    return where


def _scalar_tail(node: Node) -> bool:
    """Only the first argument is a tensor (so the op is row-wise in it)."""
    return not any(isinstance(a, Node) for a in node.args[1:])
