"""The ``recurrent_state`` pass: each causal conv1d of a layer whose state pagedpack pages
(:data:`pagedpack.models.recurrent.PAGED_RECURRENT_CLASS`: LFM2's short conv) -> ``causal_conv1d_varlen``
over the packed tokens, reading and writing its sequence's state slot.

Before (one sequence, batch 1; transformers' ``causal_conv1d_fn`` without a cache)::

    y [1, dim, T] = conv1d(x [1, dim, T], weight [dim, 1, width], bias, padding=width - 1, groups=dim)[:, :, :T]

After (a packed step)::

    y [1, dim, T] = causal_conv1d_varlen(x[0].T, weight[:, 0], bias, conv_state_i, state_indices,
                                         cu_seqlens_q, has_initial_state).T[None]

with ``state_indices``, ``has_initial_state`` and one ``conv_state_i [num_slots, dim, width - 1]``
per site added as graph inputs after the KV caches (:mod:`pagedpack.step.contract`). A conv1d of
such a layer in another form (strided, dilated, not depthwise, not cut to the sequence's own
tokens) is refused naming its node and layer.
"""
from __future__ import annotations

import torch
from torch.fx import Node

import pagedpack.kernels.recurrent  # noqa: F401  (registers torch.ops.pagedpack.causal_conv1d_varlen)
from pagedpack.models.recurrent import PAGED_RECURRENT_CLASS
from pagedpack.passes.find import token_sizes
from pagedpack.passes.graph_edit import call_arg, set_fake_empty, set_fake_value
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.step.contract import STATE_INPUTS, StateSpec, state_input_names, state_layers

aten = torch.ops.aten


def paged_layer(node: Node) -> str | None:
    """The path of the innermost paged recurrent layer ``node`` was traced in, or None."""
    for path, kind in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        if PAGED_RECURRENT_CLASS.search(cls):
            return path.removeprefix("model.")
    return None


def _is_token_count(value, sizes: set) -> bool:
    val = value.meta.get("val") if isinstance(value, Node) else value
    return isinstance(val, torch.SymInt) and val.node.expr in sizes


def _why_not_causal(conv: Node, sizes: set) -> str | None:
    """None if ``conv`` is the causal depthwise conv of the module docstring, else why not."""
    x, weight = conv.args[0], conv.args[1]
    xv, wv = x.meta.get("val"), weight.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or wv.dim() != 3:
        return "no recorded shapes of its input and weight"
    dim, per_group, width = wv.shape
    groups = call_arg(conv, 6, "groups", 1)
    if per_group != 1 or groups != dim:
        return f"not depthwise (weight {tuple(wv.shape)}, groups {groups})"
    if list(call_arg(conv, 3, "stride", [1])) != [1] or list(call_arg(conv, 5, "dilation", [1])) != [1]:
        return "strided or dilated"
    if width < 2 or list(call_arg(conv, 4, "padding", [0])) != [width - 1]:
        return f"padding {call_arg(conv, 4, 'padding', [0])} is not width - 1 = {width - 1} (not causal)"
    if xv.dim() != 3 or xv.shape[0] != 1 or not _is_token_count(xv.shape[2], sizes):
        return f"input {tuple(xv.shape)} is not [1, dim, T]"
    users = list(conv.users)
    cut = users[0] if len(users) == 1 else None
    if (cut is None or cut.target is not aten.slice.Tensor or call_arg(cut, 1, "dim", 0) not in (2, -1)
            or call_arg(cut, 2, "start", None) not in (None, 0) or call_arg(cut, 4, "step", 1) != 1
            or not _is_token_count(call_arg(cut, 3, "end", None), sizes)):
        return "its output is not cut to the sequence's own T positions ([:, :, :T])"
    return None


class PagedRecurrentState(Pass):
    """``recurrent_state``: the module docstring's rewrite of every conv1d in a paged recurrent layer;
    fills ``ctx.state_specs`` (one ``conv_state`` per site, in graph order) and ``ctx.inputs``.
    Counts: matched = conv1d nodes of such layers, rewritten = all of them or refused = those in
    another form (nothing is rewritten then)."""

    name = "recurrent_state"
    requires = ("inputs",)
    provides = ("state_specs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        graph = ctx.graph
        sites = [(n, layer) for n in graph.nodes if n.op == "call_function" and n.target is aten.conv1d.default
                 and (layer := paged_layer(n)) is not None]
        if not sites:
            return PassResult()
        sizes = token_sizes(graph)
        refused = [f"recurrent_state: {layer}: {conv.name} = conv1d: {why}" for conv, layer in sites
                   if (why := _why_not_causal(conv, sizes)) is not None]
        if refused:
            ctx.report.notes.extend(refused)
            return PassResult(matched=len(sites), refused=len(refused))
        specs = [StateSpec("conv_state", (w.shape[0], w.shape[2] - 1), w.dtype, layer)
                 for conv, layer in sites for w in [conv.args[1].meta["val"]]]
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        for name in (*STATE_INPUTS, *state_input_names(specs)):
            with graph.inserting_after(last):
                last = ctx.inputs[name] = graph.placeholder(name)
        for index, (conv, _) in enumerate(sites):
            self._rewrite(graph, conv, ctx.inputs, ctx.inputs[f"conv_state_{index}"])
        ctx.state_specs = specs
        ctx.report.notes.append(
            f"recurrent_state: {len(sites)} causal conv1d ({state_layers(specs)}) continue from a state slot per "
            f"sequence ({sum(spec.bytes_per_slot for spec in specs):,} bytes a sequence); prefix caching is off for "
            "this model (its state is not cached with the prefix's KV blocks)")
        return PassResult(matched=len(sites), rewritten=len(sites))

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, conv: Node, inputs: dict[str, Node], conv_state: Node) -> None:
        cut = next(iter(conv.users))

        def call(op, *args):
            node = graph.call_function(op, args)
            set_fake_value(node)
            return node

        with graph.inserting_before(cut):
            x = call(aten.transpose.int, call(aten.select.int, conv.args[0], 0, 0), 0, 1)  # [T, dim]
            weight = call(aten.select.int, conv.args[1], 1, 0)  # [dim, width]
            bias = call_arg(conv, 2, "bias", None)
            y = graph.call_function(torch.ops.pagedpack.causal_conv1d_varlen.default,
                                    (x, weight, bias, conv_state, inputs["state_indices"], inputs["cu_seqlens_q"],
                                     inputs["has_initial_state"]))
            if "val" in x.meta:
                set_fake_empty(y, x, x.meta["val"].shape)
            out = call(aten.unsqueeze.default, call(aten.transpose.int, y, 0, 1), 0)  # [1, dim, T]
        cut.replace_all_uses_with(out)
        graph.erase_node(cut)
        graph.erase_node(conv)
