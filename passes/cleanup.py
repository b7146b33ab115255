"""Graph clean-up around the rewrite: export's guards and metadata asserts, dead code."""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

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
    if removed:
        module.recompile()
    return removed


def drop_noop_conversions(module: torch.fx.GraphModule) -> int:
    """Remove each ``aten.to`` whose input already has the dtype and device it asks for (and no
    ``copy=True`` / ``memory_format``): ATen returns the input itself there, so the node is an
    alias that only costs a dispatch (``transformers``' norms cast to fp32 and back, which in an
    fp32 model is 4 such calls a layer). Returns how many were removed."""
    removed = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in _CONVERSIONS or not node.args:
            continue
        source, value = node.args[0], node.meta.get("val")
        before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not (isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor)):
            continue
        given = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if given is None or given.kwargs.get("copy") or given.kwargs.get("memory_format") is not None:
            continue
        if (value.dtype, value.device, value.layout) == (before.dtype, before.device, before.layout):
            node.replace_all_uses_with(source)
            module.graph.erase_node(node)
            removed += 1
    if removed:
        module.recompile()
    return removed


_CONVERSIONS = (aten.to.dtype, aten.to.device, aten.to.dtype_layout)


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
