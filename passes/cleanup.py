"""Graph clean-up around the rewrite: export's guards and metadata asserts, dead code."""
from __future__ import annotations

import torch

from pagedpack.passes.manager import Pass, PassContext, PassResult

aten = torch.ops.aten


class StripExportChecks(Pass):
    """``strip_export_checks``: remove export's input guards (``_guards_fn``) and
    ``_assert_tensor_metadata`` nodes, which pin the captured calling convention (``input_ids
    [1, T]``) that the rewrite replaces. Counts: matched = rewritten = nodes removed."""

    name = "strip_export_checks"

    def __call__(self, ctx: PassContext) -> PassResult:
        removed = strip_export_checks(ctx.graph_module)
        ctx.report.notes.append(f"removed {removed} export guard/assert nodes")
        return PassResult(matched=removed, rewritten=removed)


def strip_export_checks(module: torch.fx.GraphModule) -> int:
    """Remove export's guards and metadata asserts from ``module``'s graph; returns how many."""
    removed = 0
    for node in list(module.graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        assert_meta = node.op == "call_function" and node.target is aten._assert_tensor_metadata.default
        if guard or assert_meta:
            module.graph.erase_node(node)
            removed += 1
    if hasattr(module, "_guards_fn"):
        delattr(module, "_guards_fn")
    return removed


class EliminateDeadCode(Pass):
    """``eliminate_dead_code``: dead-code elimination that treats inference-mode dropout as pure
    (it is the identity), then unused submodules. Counts: matched = rewritten = nodes removed."""

    name = "eliminate_dead_code"

    def __call__(self, ctx: PassContext) -> PassResult:
        graph = ctx.graph
        before = len(graph.nodes)
        graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False))
        ctx.graph_module.delete_all_unused_submodules()
        removed = before - len(graph.nodes)
        return PassResult(matched=removed, rewritten=removed)
