"""The ``merge_linears`` pass: one GEMM for the projections that read the same input.

A Llama-style layer computes ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` and, later,
``gate_proj(h)``, ``up_proj(h)``: several ``aten.linear`` calls on one input. As vLLM does
(``QKVParallelLinear``, ``MergedColumnParallelLinear``), each such group becomes one linear over
the weights concatenated along the output dimension, followed by a slice of the last dimension
per original projection::

    qkv = linear(x, merged_weight[, merged_bias])     # [..., N_q + N_k + N_v]
    q, k, v = qkv[..., :N_q], qkv[..., N_q:N_q + N_k], qkv[..., N_q + N_k:]

One larger GEMM keeps the cores busier than three small ones, above all at decode (a few rows).

A group is the linears reading the same input node whose weights (and biases) are ``get_attr``
tensors: floating, 2-D, strided, of one dtype and device and one ``in_features``; all with a bias
or all without. A weight that is already in a group is not put in another. The merged weight
(and bias) is a new parameter of the graph module, ``<first weight's name>_merged``; once the
merge is kept, each original parameter's ``.data`` becomes a view of its rows in the merged
tensor, so the ``transformers`` model (which holds the same parameter objects) and the graph
share one copy of the weights. (The ``.pt2`` export stores shared storage once; the ONNX export
keeps only the initializers the graph reads.)

Checked on a sample, as ``sequence_independence`` checks the packed step: the step graph runs one
sequence of random tokens before and after the merge. Equal logits (to a floor of 1e-6 of their
magnitude) pass; otherwise the merged logits' error against a float64 run of the captured graph
(``ctx.reference``, which the pass needs) may be at most
:data:`~pagedpack.passes.numerics.RTOL_FACTOR` times the unmerged step's own error, plus that
floor (:func:`~pagedpack.passes.numerics.excess_error`). A merge that fails (or whose graph does
not run, e.g. a ``view`` that a slice's strides do not allow) is undone: the pass is an
optimisation, so it notes the reason and leaves the graph unmerged instead of refusing the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx import Node

from pagedpack.passes.graph_attrs import attr_tensor, fresh_attr_name, vocab_size
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.numerics import equal_to_floor, excess_error, float64_copy
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import example_metadata, example_state_inputs

aten = torch.ops.aten
_SAMPLE_BLOCK_SIZE = 4


@dataclass
class _Merge:
    """One group of linears and what merging it added to the graph and the module."""

    linears: list[Node]
    sizes: list[int]
    added_nodes: list[Node] = field(default_factory=list)
    slices: list[Node] = field(default_factory=list)
    added_attrs: list[str] = field(default_factory=list)


class MergeLinears(Pass):
    """``merge_linears``: each group of linears sharing an input -> one linear and a slice per
    projection (module docstring). Counts: matched = groups found, rewritten = groups merged
    (0 if the sample check undid them; a note says why)."""

    name = "merge_linears"
    requires = ("kv_cache_specs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        gm = ctx.graph_module
        groups = find_linear_groups(gm)
        if not groups:
            return PassResult()
        sample = _StepSample(ctx)
        try:
            before = sample.run(gm)
        except Exception as err:  # the unmerged graph must run for the check: leave it alone
            ctx.report.notes.append(f"merge_linears: not merged, the step graph did not run on the check sample "
                                    f"({type(err).__name__}: {str(err)[:160]})")
            return PassResult(matched=len(groups))
        merges = [merge_group(gm, group) for group in groups]
        reason = sample.check(gm, before)
        if reason is not None:
            for merge in reversed(merges):
                undo_merge(gm, merge)
            gm.recompile()
            ctx.report.notes.append(f"merge_linears: merge undone, {reason}")
            return PassResult(matched=len(groups))
        for merge in merges:
            keep_merge(gm, merge)
        gm.recompile()
        linears = sum(len(m.linears) for m in merges)
        ctx.report.notes.append(f"merge_linears: {linears} linears sharing an input merged into {len(merges)}")
        return PassResult(matched=len(groups), rewritten=len(merges))


def _linear_parts(node: Node) -> tuple[Node, Node, Node | None]:
    """``(input, weight, bias)`` of an ``aten.linear.default`` node (bias None if absent)."""
    args = list(node.args) + [None] * (3 - len(node.args))
    bias = node.kwargs.get("bias", args[2])
    return args[0], args[1], bias




def find_linear_groups(gm: torch.fx.GraphModule) -> list[list[Node]]:
    """The groups of two or more ``aten.linear.default`` nodes of ``gm`` that can be merged
    (module docstring), each in graph order."""
    buckets: dict[tuple, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, weight_node, bias_node = _linear_parts(node)
        weight, bias = attr_tensor(gm, weight_node), attr_tensor(gm, bias_node)
        if (weight is None or weight.dim() != 2 or not weight.is_floating_point()
                or weight.layout != torch.strided or weight.is_quantized):
            continue
        if bias_node is not None and (bias is None or bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype
                                      or bias.device != weight.device or bias.layout != torch.strided):
            continue
        key = (x, weight.dtype, weight.device, weight.shape[1], bias_node is not None)
        buckets.setdefault(key, []).append(node)
    groups, taken = [], set()
    for nodes in buckets.values():
        group = []
        for node in nodes:
            targets = {p.target for p in _linear_parts(node)[1:] if p is not None}
            if not targets & taken:
                group.append(node)
                taken |= targets
        if len(group) > 1:
            groups.append(group)
    return groups




def merge_group(gm: torch.fx.GraphModule, linears: list[Node]) -> _Merge:
    """Add one linear over the concatenated weights of ``linears`` (before the first of them) and
    a slice of its last dimension per linear, which takes over that linear's uses. The originals
    stay in the graph, unused, until :func:`keep_merge` or :func:`undo_merge`."""
    graph = gm.graph
    parts = [_linear_parts(n) for n in linears]
    weights = [attr_tensor(gm, w) for _, w, _ in parts]
    merge = _Merge(list(linears), [w.shape[0] for w in weights])
    with torch.no_grad():
        tensors = [(parts[0][1].target, torch.cat(weights))]
        if parts[0][2] is not None:
            tensors.append((parts[0][2].target, torch.cat([attr_tensor(gm, b) for _, _, b in parts])))
    with graph.inserting_before(linears[0]):
        loaded = []
        for first, value in tensors:
            name = fresh_attr_name(gm, first.replace(".", "_") + "_merged")
            gm.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
            merge.added_attrs.append(name)
            loaded.append(graph.get_attr(name))
        merged = graph.call_function(aten.linear.default, (parts[0][0], *loaded))
        merge.added_nodes += [*loaded, merged]
        start = 0
        for node, size in zip(linears, merge.sizes):
            piece = graph.call_function(aten.slice.Tensor, (merged, -1, start, start + size))
            start += size
            if "val" in node.meta:
                piece.meta["val"] = node.meta["val"]
            merge.slices.append(piece)
    _merged_meta(merged, linears)
    for node, piece in zip(linears, merge.slices):
        node.replace_all_uses_with(piece)
    return merge


def _merged_meta(merged: Node, linears: list[Node]) -> None:
    """The merged linear's ``meta["val"]``: the originals' (fake) values concatenated, if they have them."""
    values = [n.meta.get("val") for n in linears]
    if all(isinstance(v, torch.Tensor) for v in values):
        try:
            merged.meta["val"] = torch.cat(values, -1)
        except Exception:  # meta is informative only
            pass


def keep_merge(gm: torch.fx.GraphModule, merge: _Merge) -> None:
    """Erase the original linears (and their ``get_attr`` nodes left unused) and make each original
    weight and bias a view of its rows of the merged tensor (one copy in memory)."""
    graph = gm.graph
    merged_tensors = [getattr(gm, name) for name in merge.added_attrs]
    loads = []
    for node in merge.linears:
        _, weight, bias = _linear_parts(node)
        loads.append([weight] + ([bias] if bias is not None else []))
        graph.erase_node(node)
    start = 0
    for group_loads, size in zip(loads, merge.sizes):
        for load, merged in zip(group_loads, merged_tensors):
            original = attr_tensor(gm, load)
            original.data = merged.data[start:start + size]
            if not load.users:
                graph.erase_node(load)
        start += size


def undo_merge(gm: torch.fx.GraphModule, merge: _Merge) -> None:
    """Give each original linear its uses back and remove what :func:`merge_group` added."""
    graph = gm.graph
    for node, piece in zip(merge.linears, merge.slices):
        piece.replace_all_uses_with(node)
    for node in [*merge.slices, *reversed(merge.added_nodes)]:  # users before what they use
        graph.erase_node(node)
    for name in merge.added_attrs:
        delattr(gm, name)


class _StepSample:
    """One sequence of random tokens, prefilled through the step graph (every row's logits), and
    the captured graph's float64 logits for it (``ctx.reference``, computed on first need)."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.device = next(ctx.graph_module.parameters()).device
        n = max(ctx.num_tokens, 2)
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size(ctx.graph_module), (n,), generator=g).to(self.device)
        self.num_blocks = -(-n // _SAMPLE_BLOCK_SIZE)
        batch = example_metadata([n], block_size=_SAMPLE_BLOCK_SIZE, num_blocks=self.num_blocks, device=self.device)
        every_row = torch.arange(n, device=self.device)
        self.inputs = batch._replace(input_ids=self.tokens, logits_indices=every_row).as_inputs()

    def run(self, gm: torch.fx.GraphModule) -> torch.Tensor:
        """``[n, vocab]`` logits of the step graph ``gm`` (recompiled first) on fresh caches."""
        gm.recompile()
        caches = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for spec in self.ctx.kv_cache_specs
                  for shape in spec.cache_shapes(self.num_blocks, _SAMPLE_BLOCK_SIZE)]
        states = example_state_inputs(self.ctx.state_specs, [0], self.device)
        with torch.no_grad():
            return gm(*(self.inputs[name] for name in METADATA_INPUTS), *caches, *states)

    def check(self, gm: torch.fx.GraphModule, before: torch.Tensor) -> str | None:
        """None if ``gm``'s logits are as close as the rule of the module docstring asks to
        ``before`` (the unmerged graph's), else the reason."""
        try:
            after = self.run(gm)
        except Exception as err:  # e.g. a view the slice's strides do not allow
            return f"the merged graph does not run on the sample ({type(err).__name__}: {str(err)[:160]})"
        if after.shape != before.shape:
            return f"the merged graph's logits have shape {tuple(after.shape)}, expected {tuple(before.shape)}"
        if equal_to_floor(after, before):
            return None
        excess = excess_error(after, before, self.exact())
        return None if excess is None else f"the merged logits are {excess}"

    def exact(self) -> torch.Tensor:
        """``[n, vocab]`` float64 logits of the captured graph on the sample's tokens."""
        float64 = float64_copy(self.ctx.reference)
        with torch.no_grad():
            out = float64(self.tokens[None], torch.arange(len(self.tokens), device=self.device)[None])
        return (out[0] if isinstance(out, (tuple, list)) else out)[0]
