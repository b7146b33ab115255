"""Row-chunked MLPs: a prefill step's MLP computed a few hundred token rows at a time.

An MLP widens each token's hidden vector to the intermediate size and back: Llama's
``down(silu(gate(x)) * up(x))`` holds, for a step of ``T`` tokens, the merged gate/up output
``[T, 2I]``, ``silu(gate)`` and the product ``[T, I]`` at once, ``4 * I * T`` floats: on W1
(``I = 1408``) 44 MiB of a 2048-token step's 49 MiB activation peak. Every op between the up and
the down projections works on each token row alone, so :func:`chunk_mlps` runs that region on
:data:`CHUNK_ROWS` rows at a time (:class:`RowChunked`), which bounds its intermediates by
``CHUNK_ROWS`` rows whatever the step's size, and each chunk's intermediates stay in the CPU's
caches. The GEMMs keep hundreds of rows per call; W1's generation time did not change
(``docs/cpu-kernels.md``). Steps of at most ``CHUNK_ROWS`` rows (decode) run the region
unchanged, in one call.

A region is the subgraph from the up projections (linears reading one tensor ``x``, the MLP's
input) to the down projection (a linear), made only of row-local ops (:data:`ROW_LOCAL`: linears
whose weights and biases are ``get_attr`` tensors, elementwise ops, slices, splits and chunks of
the last dimension) on them and on constants (``get_attr`` tensors of at most one dimension,
scalars); nothing outside the region may use a tensor inside it. Anything else is left as it
was. The reference target's CPU lowering (:mod:`pagedpack.lowering.reference.cpu`) applies this after
prepacking the linears and checks the lowered graph on a step longer than ``CHUNK_ROWS``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference.cpu_activation import gated_activation_kernels
from pagedpack.passes.graph_attrs import attr_tensor, fresh_attr_name
from pagedpack.passes.graph_edit import call_arg, finish_rewrite, replace_with_call

aten = torch.ops.aten
CHUNK_ROWS = 256
LINEARS = frozenset({aten.linear.default, torch.ops.mkldnn._linear_pointwise.default})
_ELEMENTWISE = frozenset({
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
    aten.erf.default, aten.exp.default, aten.neg.default, aten.mul.Tensor, aten.mul.Scalar,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar,
})
_LAST_DIM = frozenset({aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
ROW_LOCAL = LINEARS | _ELEMENTWISE | _LAST_DIM | {operator.getitem}


def _linear_targets() -> frozenset:
    """:data:`LINEARS` and, with the native kernels, their ``bf16_linear`` (``weight`` its packed panels)."""
    native = native_ops()
    return LINEARS if native is None else LINEARS | {native.bf16_linear.default}


def _row_local_targets() -> frozenset:
    """:data:`ROW_LOCAL` and, with the native kernels, their linear and their elementwise ``silu_and_mul``
    and ``gelu_tanh_and_mul`` (:mod:`pagedpack.lowering.reference.cpu_activation`)."""
    native = native_ops()
    return ROW_LOCAL if native is None else ROW_LOCAL | _linear_targets() | set(gated_activation_kernels(native))


class RowChunked(torch.nn.Module):
    """Runs ``region`` (a graph of row-local ops on one input, :func:`chunk_mlps`) on ``x``'s rows
    (all dimensions but the last, flattened into the second-to-last, so that the chunks keep ``x``'s
    rank) ``rows`` at a time; one call when ``x`` has at most ``rows`` rows. Output:
    ``x.shape[:-1] + (features,)``, as ``region(x)``."""

    def __init__(self, region: torch.fx.GraphModule, rows: int = CHUNK_ROWS) -> None:
        super().__init__()
        self.region, self.rows = region, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[:-1].numel() <= self.rows:
            return self.region.forward(x)  # every decode step: without the module call's Python layers
        flat = x.reshape(*([1] * (x.dim() - 2)), -1, x.shape[-1])
        total = flat.shape[-2]
        out = None
        for start in range(0, total, self.rows):
            part = self.region(flat[..., start:start + self.rows, :])
            if out is None:
                out = part.new_empty((*part.shape[:-2], total, part.shape[-1]))
            out[..., start:start + part.shape[-2], :] = part
        return out.view(*x.shape[:-1], out.shape[-1])


def chunk_mlps(graph_module: torch.fx.GraphModule, rows: int = CHUNK_ROWS) -> int:
    """Replace each MLP region of ``graph_module`` (module docstring) by a ``call_module`` of a
    :class:`RowChunked` submodule holding it; returns how many were replaced."""
    graph, replaced, linears = graph_module.graph, 0, _linear_targets()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in linears:
            continue
        found = _region(graph_module, node)
        if found is None:
            continue
        entry, region = found
        name = fresh_attr_name(graph_module, f"row_chunked_mlp_{replaced}")
        graph_module.add_submodule(name, RowChunked(_extract(graph_module, entry, region, node), rows))
        replace_with_call(node, name, (entry,), op="call_module")
        for inner in reversed(region):
            graph.erase_node(inner)
        replaced += 1
    return finish_rewrite(graph_module, replaced)


def _region(gm: torch.fx.GraphModule, down: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """``(x, nodes in graph order, down last)`` of the MLP region ending at ``down``, or None. The
    walk back from ``down`` stops at the inputs of the other linears it meets (the up projections),
    which must all be the same tensor ``x``."""
    members, entry, todo, row_local, linears = {down}, None, [down], _row_local_targets(), _linear_targets()
    while todo:
        node = todo.pop()
        if node.target in linears and not _constant_weights(gm, node):
            return None  # a weight computed from activations: it mixes rows
        for arg in node.all_input_nodes:
            if node.target in linears and arg.op == "get_attr" and arg is not node.args[0]:
                continue  # its weight or bias
            if arg in members:
                continue
            elif arg.op == "get_attr":
                if not _is_constant(gm, arg):
                    return None  # a tensor with rows of its own
            elif node is not down and node.target in linears:
                if entry not in (None, arg):
                    return None  # up projections of different inputs
                entry = arg
            elif arg.op == "call_function" and arg.target in row_local and _row_local(arg):
                members.add(arg)
                todo.append(arg)
            else:
                return None  # something else joins in: not one tensor's rows
    if entry is None or entry in members or any(user not in members for node in members - {down}
                                                for user in node.users):
        return None
    order = {node: i for i, node in enumerate(down.graph.nodes)}
    return entry, sorted(members, key=order.__getitem__)


def _constant_weights(gm: torch.fx.GraphModule, linear: torch.fx.Node) -> bool:
    """The weight and bias (if any) of ``linear`` are ``get_attr`` tensors."""
    params = [*linear.args[1:3], linear.kwargs.get("bias")]
    return all(p is None or isinstance(p, torch.fx.Node) and attr_tensor(gm, p) is not None for p in params)


def _is_constant(gm: torch.fx.GraphModule, attr: torch.fx.Node) -> bool:
    """A tensor of at most one dimension: the same for every row."""
    tensor = attr_tensor(gm, attr)
    return tensor is not None and tensor.dim() <= 1


def _row_local(node: torch.fx.Node) -> bool:
    """Slices (step 1) and splits only of the last dimension (the features), items of such splits."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and node.args[0].target in _LAST_DIM - {aten.slice.Tensor}
    if node.target not in _LAST_DIM:
        return True
    if node.target is aten.slice.Tensor and call_arg(node, 4, "step", 1) != 1:
        return False
    dim = call_arg(node, 1, "dim", 0) if node.target is aten.slice.Tensor else call_arg(node, 2, "dim", 0)
    value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    ndim = value.dim() if isinstance(value, torch.Tensor) else None
    return dim == -1 or ndim is not None and dim == ndim - 1


def _extract(gm: torch.fx.GraphModule, entry: torch.fx.Node, region: list[torch.fx.Node],
             down: torch.fx.Node) -> torch.fx.GraphModule:
    """The region as a graph module of its own (input ``x``; weights shared with ``gm``)."""
    graph = torch.fx.Graph()
    env = {entry: graph.placeholder("x")}

    def remap(arg: torch.fx.Node) -> torch.fx.Node:
        if arg not in env:  # a constant read by the region
            env[arg] = graph.get_attr(arg.target)
        return env[arg]

    for node in region:
        env[node] = graph.node_copy(node, remap)
    graph.output(env[down])
    return torch.fx.GraphModule(gm, graph)
