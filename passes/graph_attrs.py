"""Reading and adding the tensors a ``torch.fx.GraphModule`` holds as attributes (``get_attr``)."""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def attr_tensor(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node of ``gm`` reads; None for anything else."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    try:
        owner, name = _attr_owner(gm, node.target)
        value = getattr(owner, name)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def linear_projections(gm: torch.fx.GraphModule, linear: torch.fx.Node) -> list[tuple[torch.fx.Node, int, int, int]]:
    """``(node, start, end, address)`` of each projection an ``aten.linear`` node of ``gm`` computes:
    the linear itself (rows ``0:out`` of its weight), or, when every use is a slice of its last
    dimension (a merged linear, :mod:`pagedpack.passes.linear_merge`), each slice, with its rows
    ``start:end``. ``address``: the ``data_ptr`` of those rows, which is the original module's weight's
    (the merge made each original a view of its rows). ``[]`` if the weight is not a ``get_attr`` tensor."""
    weight = attr_tensor(gm, linear.args[1])
    if weight is None:
        return []
    step = weight.stride(0) * weight.element_size()
    slices = [u for u in linear.users if u.target is aten.slice.Tensor and u.args[1] in (-1, 1)]
    if slices and len(slices) == len(linear.users):
        ranges = [(s, s.args[2], s.args[3]) for s in slices]
    else:
        ranges = [(linear, 0, weight.shape[0])]
    return [(node, start, end, weight.data_ptr() + start * step) for node, start, end in ranges]


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


def _attr_owner(gm: torch.fx.GraphModule, target: str) -> tuple[torch.nn.Module, str]:
    owner, _, name = target.rpartition(".")
    return gm.get_submodule(owner), name


def drop_unused_attrs(gm: torch.fx.GraphModule) -> int:
    """Delete the parameters and buffers of ``gm`` that no ``get_attr`` node reads and no
    ``call_module`` node's module owns (a rewrite replaced their readers), so that ``gm`` stops
    holding their memory; returns how many."""
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    called = tuple(f"{node.target}." for node in gm.graph.nodes if node.op == "call_module")
    unused = [name for name, _ in [*gm.named_parameters(remove_duplicate=False),
                                   *gm.named_buffers(remove_duplicate=False)]
              if name not in read and not name.startswith(called)]
    for name in unused:
        owner, leaf = _attr_owner(gm, name)
        delattr(owner, leaf)
    return len(unused)


def hoist_attrs(gm: torch.fx.GraphModule) -> int:
    """Make every tensor a ``get_attr`` node of ``gm`` reads from a submodule an attribute of ``gm``
    itself (the same parameter or buffer object, under a fresh name), so that the generated code reads
    it with one attribute lookup instead of one a path component (``self.model.model.layers`` ...,
    a Python ``Module.__getattr__`` call each, every step); returns how many nodes now read one. The
    paths they came from stay until :func:`drop_unused_attrs` deletes them."""
    hoisted = 0
    for node in gm.graph.nodes:
        value = attr_tensor(gm, node) if node.op == "get_attr" and "." in node.target else None
        if value is None:
            continue
        name = fresh_attr_name(gm, node.target.replace(".", "_"))
        if isinstance(value, torch.nn.Parameter):
            gm.register_parameter(name, value)
        else:
            gm.register_buffer(name, value)
        node.target = name
        hoisted += 1
    if hoisted:
        gm.recompile()
    return hoisted


def own_attrs(gm: torch.fx.GraphModule) -> None:
    """Give every strided tensor ``gm`` (or a graph module inside it) reads with ``get_attr``
    storage of its own (a copy, without grad; one per tensor shared under several names, while
    views of one storage become separate copies), so that ``gm`` no longer sees or keeps alive
    memory it shared with another module: later in-place edits of that module, or a checkpoint
    file ``transformers`` memory-mapped."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, copy): the original kept alive
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for target in dict.fromkeys(node.target for node in module.graph.nodes if node.op == "get_attr"):
                _own(module, target, copies)


def _own(gm: torch.fx.GraphModule, target: str, copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    owner, leaf = _attr_owner(gm, target)
    tensor = getattr(owner, leaf, None)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return
    if id(tensor) not in copies:
        copy = tensor.detach().clone()
        if isinstance(tensor, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=False)
        copies[id(tensor)] = tensor, copy
    copy = copies[id(tensor)][1]
    delattr(owner, leaf)
    if isinstance(copy, torch.nn.Parameter):
        owner.register_parameter(leaf, copy)
    else:
        owner.register_buffer(leaf, copy)
