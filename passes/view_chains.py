"""Chains of view ops (``view``, ``reshape``, ``transpose``, ``squeeze``, ``slice``, ...) read as
index maps, and the chains that map nothing collapsed into one ``reshape``.

An exported attention layer reaches its kernels through such chains: the merged QKV output sliced,
viewed as ``[1, T, H, D]``, transposed to ``[1, H, T, D]``; the attention output transposed,
unsqueezed and reshaped back to ``[1, T, H * D]``. Each op is a dispatch a call and a layer has
about 25. :func:`evaluate_views` runs a chain on a tensor of element indices (``arange``, every
symbolic size set to :data:`TOKENS`; a chain with two different symbols is not read), which tells exactly which
source element each output element is, whatever ops the chain holds; the CPU lowering uses it to
prove that a chain selects what a fused kernel reads (``lowering/reference/cpu_qkv.py``), and
:func:`collapse_view_chains` to replace a chain whose output is its source's elements in their
own order by one ``reshape`` of the source.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from pagedpack.passes.graph_edit import finish_rewrite

aten = torch.ops.aten

VIEW_OPS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.slice.Tensor, aten.select.int,
    aten.flatten.using_ints, aten.unflatten.int, aten.t.default,
})
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
TOKENS = 3  # the value every symbolic size takes in an evaluation (any value works: maps are compared whole)


class _Unknown(Exception):
    """An argument that is not a constant or the bare token-count symbol."""


def view_source(node: torch.fx.Node) -> torch.fx.Node:
    """The first node before ``node`` (itself included) that is not a call of a :data:`VIEW_OPS` op."""
    while _is_view(node):
        node = node.args[0]
    return node


def evaluate_views(node: torch.fx.Node, source: torch.fx.Node, value: torch.Tensor) -> torch.Tensor | None:
    """``node``'s value when ``source``'s is ``value``, ``node`` reached from ``source`` through
    :data:`VIEW_OPS` calls on their first argument only; None if it is not, or an argument is
    neither a constant nor a bare symbolic size (taken as :data:`TOKENS`; the sizes of ``source``'s
    ``meta["val"]`` and the chain's may hold one symbol, the same), or an op refuses the value."""
    chain = []
    while node is not source:
        if not _is_view(node):
            return None
        chain.append(node)
        node = node.args[0]
    symbols = _symbols_of(source)
    if symbols is None:
        return None
    try:
        for call in reversed(chain):
            value = call.target(value, *_concrete(call.args[1:], symbols), **_concrete(call.kwargs, symbols))
    except (_Unknown, RuntimeError, IndexError, TypeError, ValueError):
        return None
    return value if len(symbols) <= 1 else None


def index_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    """``arange`` over ``node``'s shape (from its ``meta["val"]``, symbolic sizes as :data:`TOKENS`),
    int64: each element its own index in row-major order. None without a known shape."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        shape = [_size(d, set()) for d in value.shape]
    except _Unknown:
        return None
    return torch.arange(math.prod(shape), dtype=torch.int64).view(shape)


def collapse_view_chains(graph_module: torch.fx.GraphModule) -> int:
    """Replace each chain of two or more view ops ending in a ``view`` / ``reshape`` whose output is
    its source's elements in row-major order (the chain only regroups dimensions) by that last op
    applied to the source: one dispatch instead of several, the same values. Returns how many."""
    collapsed = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in RESHAPES or node.kwargs or len(node.args) != 2:
            continue
        source = view_source(node)
        if not _is_view(node.args[0]) or any(_is_view(user) for user in node.users):
            continue  # a chain of one, or not the chain's end
        indices = index_tensor(source)
        result = evaluate_views(node, source, indices) if indices is not None else None
        if result is None or not torch.equal(result.flatten(), indices.flatten()):
            continue
        node.target = aten.reshape.default
        node.args = (source, node.args[1])
        collapsed += 1
    return finish_rewrite(graph_module, collapsed)


def _is_view(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEW_OPS
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node))


def _size(dim, symbols: set) -> int:
    """``dim`` as an int: :data:`TOKENS` for a bare symbol (added to ``symbols``)."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, torch.SymInt) and dim.node.expr.is_Symbol:
        symbols.add(dim.node.expr)
        return TOKENS
    raise _Unknown(dim)


def _symbols_of(node: torch.fx.Node) -> set | None:
    """The symbols of ``node``'s shape (None without a known shape, or with a size that is an expression)."""
    value = node.meta.get("val")
    symbols: set = set()
    try:
        for dim in value.shape:
            _size(dim, symbols)
    except (_Unknown, AttributeError):
        return None
    return symbols


def _concrete(arg, symbols: set):
    """``arg`` with each node of a bare symbolic size replaced by :data:`TOKENS` (its symbol added
    to ``symbols``; :class:`_Unknown` for any other node)."""
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("val")
        if isinstance(value, (int, torch.SymInt)):
            return _size(value, symbols)
        raise _Unknown(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_concrete(a, symbols) for a in arg)
    if isinstance(arg, dict):
        return {k: _concrete(v, symbols) for k, v in arg.items()}
    if arg is None or isinstance(arg, (bool, int, float, torch.dtype, torch.memory_format, torch.device)):
        return arg
    raise _Unknown(arg)
