"""The ``recurrent_state`` pass: the sequence mixing of each layer whose state pagedpack pages
(:data:`pagedpack.models.recurrent.PAGED_RECURRENT_CLASS`: LFM2's short conv, the gated DeltaNets and
Kimi Delta Attention, the Mamba and Mamba2 mixers, MiniMax's lightning attention) over the packed
tokens, each sequence reading and writing its state slot.

A causal conv1d (transformers' ``causal_conv1d_fn`` without a cache; batch 1)::

    y [1, dim, T] = conv1d(x [1, dim, T], weight [dim, 1, width], bias, padding=width - 1, groups=dim)[:, :, :T]
    ->  causal_conv1d_varlen(x[0].T, weight[:, 0], bias, conv_state_i, state_indices, cu_seqlens_q,
                             has_initial_state).T[None]

A gated delta rule (the capture's seam, :mod:`pagedpack.models.seams`)::

    o [1, T, Hv, Dv] = chunk_gated_delta_rule(q, k [1, T, Hk, Dk], v, g, beta, scale, l2norm)
    ->  gated_delta_rule_varlen(q[0], k[0], v[0], g[0], beta[0], ssm_state_i, state_indices, cu_seqlens_q,
                                has_initial_state, scale, l2norm)[None]

A selective scan (Mamba's or Mamba2's SSD, the seam's ``chunk_selective_scan``)::

    y [1, T, H, P] = chunk_selective_scan(x, dt [1, T, H], A, B, C [1, T, G, N], D, dt_bias, ...)
    ->  selective_scan_varlen(x[0], dt[0], A, B[0], C[0], D, dt_bias, ssm_state_i, state_indices,
                              cu_seqlens_q, has_initial_state, ...)[None]

Lightning attention (MiniMax; the seam's ``chunk_lightning_attention``)::

    o [1, T, H, Dv] = chunk_lightning_attention(q, k [1, T, H, D], v, slope_rate [H])
    ->  lightning_attention_varlen(q[0], k[0], v[0], slope_rate, ssm_state_i, state_indices, cu_seqlens_q,
                                   has_initial_state)[None]

with ``state_indices``, ``has_initial_state`` and one state input per site (``conv_state_i [num_slots,
dim, width - 1]``, ``ssm_state_i [num_slots, Hv, Dk, Dv]``, ``[num_slots, H, P, N]`` or ``[num_slots, H, D,
Dv]``) added as graph inputs after the KV caches (:mod:`pagedpack.step.contract`). A site in another form (a strided,
dilated or not depthwise conv, one not cut to the sequence's own tokens, a scan over more than one
sequence), and a layer without the sites its class needs (a gated DeltaNet whose scan did not go
through the seam), are refused naming the node or layer.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.fx import Node

import pagedpack.kernels.recurrent  # noqa: F401  (registers torch.ops.pagedpack's recurrent ops)
from pagedpack.models.recurrent import PAGED_LAYERS, paged_layer
from pagedpack.passes.find import token_sizes
from pagedpack.passes.graph_edit import call_arg, set_fake_empty, set_fake_value
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.step.contract import STATE_INPUTS, StateSpec, state_input_names, state_layers

aten = torch.ops.aten
CONV1D = aten.conv1d.default
GATED_DELTA_RULE = torch.ops.pagedpack.chunk_gated_delta_rule.default
SELECTIVE_SCAN = torch.ops.pagedpack.chunk_selective_scan.default
LIGHTNING_ATTENTION = torch.ops.pagedpack.chunk_lightning_attention.default

_SITE_OPS = {"conv1d": CONV1D, "gated_delta_rule": GATED_DELTA_RULE, "selective_scan": SELECTIVE_SCAN,
             "lightning_attention": LIGHTNING_ATTENTION}
_SITE_NAMES = {CONV1D: "conv1d", GATED_DELTA_RULE: "chunk_gated_delta_rule", SELECTIVE_SCAN: "chunk_selective_scan",
               LIGHTNING_ATTENTION: "chunk_lightning_attention"}


@dataclass(frozen=True)
class _Scan:
    """A scan seam's rewrite: its varlen op, which of its arguments are ``[1, T, ...]`` token tensors,
    how many come before the state and metadata the varlen op inserts, and where its output's
    ``[1, T, ...]`` shape is read (the argument whose shape and dtype it has)."""

    varlen: torch._ops.OpOverload
    token_args: tuple[int, ...]
    num_data_args: int
    like: int


_SCANS = {GATED_DELTA_RULE: _Scan(torch.ops.pagedpack.gated_delta_rule_varlen.default, (0, 1, 2, 3, 4), 5, 2),
          SELECTIVE_SCAN: _Scan(torch.ops.pagedpack.selective_scan_varlen.default, (0, 1, 3, 4), 7, 0),
          LIGHTNING_ATTENTION: _Scan(torch.ops.pagedpack.lightning_attention_varlen.default, (0, 1, 2), 4, 2)}


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


def _why_not_one_sequence(scan: Node, sizes: set) -> str | None:
    """None if the scan seam ``scan`` runs over one sequence of the step's tokens, else why not."""
    values = [arg.meta.get("val") if isinstance(arg, Node) else None
              for arg in (scan.args[i] for i in _SCANS[scan.target].token_args)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return "no recorded shapes of its inputs"
    if any(v.shape[0] != 1 or not _is_token_count(v.shape[1], sizes) for v in values):
        return f"inputs {[tuple(v.shape) for v in values]} are not [1, T, ...]"
    return None


def _state_spec(site: Node, layer: str) -> StateSpec:
    if site.target is CONV1D:
        weight = site.args[1].meta["val"]
        return StateSpec("conv_state", (weight.shape[0], weight.shape[2] - 1), weight.dtype, layer)
    if site.target in (GATED_DELTA_RULE, LIGHTNING_ATTENTION):  # [Hv, Dk, Dv]
        q, v = site.args[0].meta["val"], site.args[2].meta["val"]
        return StateSpec("ssm_state", (v.shape[2], q.shape[3], v.shape[3]), v.dtype, layer)
    x, b = site.args[0].meta["val"], site.args[3].meta["val"]  # selective scan: [H, P, N]
    return StateSpec("ssm_state", (x.shape[2], x.shape[3], b.shape[3]), x.dtype, layer)


def _missing_sites(graph: torch.fx.Graph, sites: list[tuple[Node, str]]) -> list[str]:
    """The paged layers traced in ``graph`` without a site their class needs (their sequence mixing
    went another way, which the rewrite would not see), one message each."""
    layers = {found for n in graph.nodes if (found := paged_layer(n)) is not None}
    held = {(layer, site.target) for site, layer in sites}
    missing = []
    for layer, cls in sorted(layers):
        need = {_SITE_OPS[site] for end, sites in PAGED_LAYERS.items() if cls.endswith(end) for site in sites}
        for op in sorted(need - {op for lay, op in held if lay == layer}, key=str):
            missing.append(f"recurrent_state: {layer} ({cls}): no {_SITE_NAMES[op]} in the captured graph (its "
                           "kernel was not captured through pagedpack's seam); its state cannot be paged")
    return missing


class PagedRecurrentState(Pass):
    """``recurrent_state``: the module docstring's rewrite of every site of a paged recurrent layer;
    fills ``ctx.state_specs`` (one per site, in graph order) and ``ctx.inputs``. Counts: matched =
    the sites, rewritten = all of them, or refused = those in another form plus the layers missing a
    site (nothing is rewritten then)."""

    name = "recurrent_state"
    requires = ("inputs",)
    provides = ("state_specs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        graph = ctx.graph
        sites = [(n, found[0]) for n in graph.nodes if n.op == "call_function" and n.target in _SITE_NAMES
                 and (found := paged_layer(n)) is not None]
        missing = _missing_sites(graph, sites)
        if not sites and not missing:
            return PassResult()
        sizes = token_sizes(graph)
        refused = missing + [f"recurrent_state: {layer}: {site.name} = {_SITE_NAMES[site.target]}: {why}"
                             for site, layer in sites if (why := self._why_not(site, sizes)) is not None]
        if refused:
            ctx.report.notes.extend(refused)
            return PassResult(matched=len(sites), refused=len(refused))
        specs = [_state_spec(site, layer) for site, layer in sites]
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        names = state_input_names(specs)
        for name in (*STATE_INPUTS, *names):
            with graph.inserting_after(last):
                last = ctx.inputs[name] = graph.placeholder(name)
        for (site, _), name in zip(sites, names):
            rewrite = self._rewrite_conv if site.target is CONV1D else self._rewrite_scan
            rewrite(graph, site, ctx.inputs, ctx.inputs[name])
        ctx.state_specs = specs
        kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(spec.kind for spec in specs).items())
        ctx.report.notes.append(
            f"recurrent_state: {len(sites)} sites ({kinds}; "
            f"{state_layers(specs)}) continue from a state slot per sequence "
            f"({sum(spec.bytes_per_slot for spec in specs):,} bytes a sequence); prefix caching is off for "
            "this model (its state is not cached with the prefix's KV blocks)")
        return PassResult(matched=len(sites), rewritten=len(sites))

    @staticmethod
    def _why_not(site: Node, sizes: set) -> str | None:
        return _why_not_causal(site, sizes) if site.target is CONV1D else _why_not_one_sequence(site, sizes)

    @staticmethod
    def _rewrite_conv(graph: torch.fx.Graph, conv: Node, inputs: dict[str, Node], conv_state: Node) -> None:
        cut = next(iter(conv.users))
        with graph.inserting_before(cut):
            x = _call(graph, aten.transpose.int, _call(graph, aten.select.int, conv.args[0], 0, 0), 0, 1)  # [T, dim]
            weight = _call(graph, aten.select.int, conv.args[1], 1, 0)  # [dim, width]
            y = graph.call_function(torch.ops.pagedpack.causal_conv1d_varlen.default,
                                    (x, weight, call_arg(conv, 2, "bias", None), conv_state, inputs["state_indices"],
                                     inputs["cu_seqlens_q"], inputs["has_initial_state"]))
            if "val" in x.meta:
                set_fake_empty(y, x, x.meta["val"].shape)
            out = _call(graph, aten.unsqueeze.default, _call(graph, aten.transpose.int, y, 0, 1), 0)  # [1, dim, T]
        cut.replace_all_uses_with(out)
        graph.erase_node(cut)
        graph.erase_node(conv)

    @staticmethod
    def _rewrite_scan(graph: torch.fx.Graph, scan: Node, inputs: dict[str, Node], ssm_state: Node) -> None:
        form = _SCANS[scan.target]
        with graph.inserting_before(scan):
            data = [_call(graph, aten.select.int, arg, 0, 0) if i in form.token_args else arg
                    for i, arg in enumerate(scan.args[:form.num_data_args])]
            o = graph.call_function(form.varlen, (*data, ssm_state, inputs["state_indices"], inputs["cu_seqlens_q"],
                                                  inputs["has_initial_state"], *scan.args[form.num_data_args:]),
                                    dict(scan.kwargs))
            like = data[form.like]
            if "val" in like.meta:
                set_fake_empty(o, like, like.meta["val"].shape)
            out = _call(graph, aten.unsqueeze.default, o, 0)
        scan.replace_all_uses_with(out)
        graph.erase_node(scan)


def _call(graph: torch.fx.Graph, op, *args) -> Node:
    node = graph.call_function(op, args)
    set_fake_value(node)
    return node
