"""Small edits of a ``torch.fx`` graph that the rewrites and lowerings share."""
from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode


def call_arg(node: torch.fx.Node, index: int, name: str, default=None):
    """Argument ``name`` of a call node, given at position ``index`` or by keyword, else ``default``
    (an ATen schema's default: ``slice``'s ``dim`` 0, ``step`` 1, ...)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def replace_with_call(node: torch.fx.Node, target, args, *, op: str = "call_function") -> torch.fx.Node:
    """A new ``op`` node calling ``target(*args)`` just before ``node``, with ``node``'s meta,
    that ``node``'s users now read instead (``node`` stays until dead-code elimination)."""
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.create_node(op, target, tuple(args))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    return new


def finish_rewrite(graph_module: torch.fx.GraphModule, count: int) -> int:
    """After ``count`` replacements: drop the dead nodes, check the graph, regenerate its code
    (nothing when ``count`` is 0). Returns ``count``."""
    if count:
        graph_module.graph.eliminate_dead_code()
        graph_module.graph.lint()
        graph_module.recompile()
    return count



def set_fake_value(node: torch.fx.Node) -> None:
    """``node.meta["val"]``: its op run on its arguments' fake values (a view's shape and strides,
    symbolic sizes kept), as export records them; nothing where an argument has none."""
    values = []
    for arg in node.args:
        if isinstance(arg, torch.fx.Node):
            if "val" not in arg.meta:
                return
            arg = arg.meta["val"]
        values.append(arg)
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if mode is None:
        return
    try:
        with mode:
            node.meta["val"] = node.target(*values, **node.kwargs)
    except Exception:  # noqa: BLE001 -- a value the op refuses fake: the node just has none, as before
        node.meta.pop("val", None)


def set_fake_empty(node: torch.fx.Node, like: torch.fx.Node, shape) -> None:
    """``node.meta["val"]``: a fake tensor of ``shape`` (sizes may be ``like``'s symbolic ones) with
    the dtype and device of ``like``'s fake value; nothing where ``like`` has none."""
    value = like.meta.get("val")
    mode = detect_fake_mode([value]) if isinstance(value, torch.Tensor) else None
    if mode is not None:
        with mode:
            node.meta["val"] = value.new_empty(tuple(shape))
