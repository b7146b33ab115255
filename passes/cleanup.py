"""Graph clean-up around the rewrite: export's guards and metadata asserts, dead code."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def strip_export_checks(module: torch.fx.GraphModule) -> int:
    """Remove export's input guards (``_guards_fn``) and ``_assert_tensor_metadata`` nodes.

    They pin the captured calling convention (``input_ids [1, T]``) that the rewrite replaces.
    Returns how many nodes were removed.
    """
    graph, removed = module.graph, 0
    for node in list(graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        assert_meta = node.op == "call_function" and node.target is aten._assert_tensor_metadata.default
        if guard or assert_meta:
            graph.erase_node(node)
            removed += 1
    if hasattr(module, "_guards_fn"):
        delattr(module, "_guards_fn")
    return removed


def eliminate_dead_code(module: torch.fx.GraphModule) -> None:
    """Dead-code elimination that treats inference-mode dropout as pure (it is the identity)."""
    module.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False))
    module.delete_all_unused_submodules()
