"""Reading and adding the tensors a ``torch.fx.GraphModule`` holds as attributes (``get_attr``)."""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def attr_tensor(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node of ``gm`` reads; None for anything else."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    owner, _, name = node.target.rpartition(".")
    try:
        value = getattr(gm.get_submodule(owner), name)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def fresh_attr_name(gm: torch.fx.GraphModule, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first name ``gm`` has no attribute of."""
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def vocab_size(gm: torch.fx.GraphModule) -> int:
    """Rows of the first ``aten.embedding`` weight of ``gm`` (token ids below it are valid); 1 if none."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.embedding.default:
            weight = attr_tensor(gm, node.args[0])
            if weight is not None:
                return weight.shape[0]
    return 1
