"""The ``positions_input`` pass: positions computed in the graph read the ``positions`` input.

A captured graph sees one sequence, so ``arange(T)`` over its tokens is each token's position:
learned position embeddings (BART-style decoders, XGLM), ``cache_position``-based scales (Llama-4's
attention temperature) and masks compute it so. In a packed step the tokens of several sequences
share the row and ``arange`` would number them across sequences; each token's position is the
``positions`` input instead. A node is replaced when its sampled value (from ``verify_attention``,
at ``ctx.num_tokens`` tokens) is ``arange(T)`` and :func:`maybe_positions` holds; the check of
``sequence_independence`` (step pipeline) or of the backend's packed sample then covers the rest.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from pagedpack.passes.manager import Pass, PassContext, PassResult

aten = torch.ops.aten


class PositionsInput(Pass):
    """``positions_input``: the nodes whose sampled value is ``arange(T)``, except the sites' own
    tensors -> views of the ``positions`` input. Counts: matched = rewritten = nodes replaced."""

    name = "positions_input"
    requires = ("sites", "values", "inputs")

    def __call__(self, ctx: PassContext) -> PassResult:
        graph, positions = ctx.graph, ctx.inputs["positions"]
        arange = torch.arange(ctx.num_tokens)
        site_nodes = {n for s in ctx.sites for n in s.sampled_nodes}
        orderings = _token_orderings(graph)
        sources = [n for n, v in ctx.values.items() if n not in site_nodes and n not in orderings
                   and maybe_positions(n, ctx.num_tokens) and torch.equal(v.reshape(-1).cpu(), arange)]
        for node in sources:
            with graph.inserting_before(node):
                shape = [1, -1] if ctx.values[node].dim() == 2 else [-1]
                view = graph.call_function(aten.view.default, (positions, shape))
            node.replace_all_uses_with(view)
        ctx.report.notes.append(f"position ids: {len(sources)} node(s) computing arange(T) replaced by the positions "
                                "input" if sources else "no position-id computation found")
        return PassResult(matched=len(sources), rewritten=len(sources))


# ops whose index output orders the tokens by their data (a mixture of experts' dispatch by expert id)
_ORDERING_OPS = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable, aten.topk.default}
_SCATTERS = {aten.index_put_.default, aten.index_put.default, aten.scatter.src, aten.scatter_.src}


def _token_orderings(graph: torch.fx.Graph) -> set[Node]:
    """The nodes that hold an ordering of the tokens rather than their positions, however their sampled
    value looks (with one expert a token, a sort of the experts' ids can be ``arange(T)``): those computed
    from a sort / top-k, and what is scattered by an index (``inverse[order] = arange(T)``: the
    inverse of an ordering), with everything computed from them."""
    found: set[Node] = set()
    for node in graph.nodes:
        args = node.all_input_nodes
        scattered = node.target in _SCATTERS and len(node.args) > 2 and isinstance(node.args[2], Node)
        if node.target in _ORDERING_OPS or any(a in found for a in args):
            found.add(node)
        if scattered:
            found.update((node, node.args[2]))
    return found


def maybe_positions(node: Node, n: int) -> bool:
    """``node`` may hold the position ids of a sample of ``n`` tokens: int64 ``[T]`` or ``[1, T]``
    with ``T`` symbolic (a model size that happens to equal ``n``, e.g. ``arange(num_heads)``, is not
    a candidate; the symbol's hint is the capture's example length, not ``n``)."""
    val = node.meta.get("val")
    return (node.op == "call_function" and isinstance(val, torch.Tensor) and val.dtype == torch.int64
            and val.dim() in (1, 2) and isinstance(val.shape[-1], torch.SymInt)
            and (val.dim() == 1 or val.shape[0] == 1))
