"""The ``lora`` pass: every decoder linear of a step graph gains a batched low-rank update.

Multi-LoRA serving as punica and vLLM run it (``--enable-lora``): each token ``t`` of a packed step
belongs to a request that names an adapter slot ``lora_indices[t]`` (``-1``: the base model), and
each augmented linear computes::

    y = x W^T                                           # the base projection, unchanged
    y += (x A_slot^T) B_slot^T                          # per slice; scaling folded into B

as two ops per linear, :func:`torch.ops.pagedpack.lora_shrink` (``x [T, in] -> [T, S * R]`` fp32)
and :func:`torch.ops.pagedpack.lora_expand` (adds each slice's ``[T, R] @ B^T`` to its columns of
``y``; :mod:`pagedpack.kernels.lora`). A merged linear (``merge_linears``: QKV, gate-up) stays one
GEMM and takes one shrink and one expand over its ``S`` slices, the adapters sliced as vLLM's
``MergedQKVParallelLinearWithLoRA`` slices them.

Which linears: every ``aten.linear`` whose weight (or each slice of whose merged weight) is the
weight of an ``nn.Linear`` in one of the source model's decoder layers (not the LM head, not the
embeddings), as vLLM applies LoRA to every supported linear and an adapter that targets fewer leaves
the others' slots zero. A merged linear with a slice that is no such module is left alone.

The graph gains inputs after all others (:func:`pagedpack.step.contract.lora_input_names`):
``lora_indices [T] int32`` and, per augmented linear ``i`` (:class:`~pagedpack.step.contract.LoRASpec`),
``lora_a_i [max_loras, S * max_rank, in]`` and ``lora_b_i [max_loras, out, max_rank]``, which the
runtime allocates and fills per slot (:mod:`pagedpack.runtime.lora`). The slot count and rank are
sizes of those inputs, not of the graph: one rewritten graph serves any ``max_loras`` / ``max_lora_rank``.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from pagedpack.formats.lora_adapter import lora_module_shapes
from pagedpack.passes.graph_attrs import attr_tensor, linear_projections
from pagedpack.step.contract import LORA_INDICES, LoRASpec, lora_input_names

aten = torch.ops.aten


def lora_module_names(model: torch.nn.Module) -> dict[int, str]:
    """``data_ptr`` of each LoRA-able module's weight -> its module path: the ``nn.Linear`` modules of
    ``model``'s decoder layers (:func:`~pagedpack.formats.lora_adapter.lora_module_shapes`, the modules an
    adapter file may name). ``ValueError`` naming ``enable_lora`` for a model without decoder layer classes."""
    try:
        names = lora_module_shapes(model)
    except ValueError as err:
        raise ValueError(f"enable_lora: {err}, so the linears LoRA may target are unknown") from None
    return {model.get_submodule(name).weight.data_ptr(): name for name in names}


def add_lora(gm: torch.fx.GraphModule, model: torch.nn.Module) -> list[LoRASpec]:
    """Augment every LoRA-able linear of the step graph ``gm`` in place (module docstring); returns
    one :class:`LoRASpec` per augmented linear, in input order. ``ValueError`` naming ``enable_lora``
    if the graph has no such linear (nothing to adapt)."""
    modules = lora_module_names(model)
    graph = gm.graph
    targets = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        parts = sorted(linear_projections(gm, node), key=lambda part: part[1])
        names = [modules.get(address) for *_, address in parts]
        weight = attr_tensor(gm, node.args[1])
        if not parts or None in names or not _tiles(parts, weight.shape[0]):
            continue
        spec = LoRASpec(tuple(names), weight.shape[1], tuple(end - start for _, start, end, _ in parts), weight.dtype)
        targets.append((node, spec))
    if not targets:
        raise ValueError(f"enable_lora: {type(model).__name__}'s step graph has no linear of an nn.Linear module "
                         "of its decoder layers, so there is nothing a LoRA adapter could target")
    specs = [spec for _, spec in targets]
    inputs = _add_inputs(graph, lora_input_names(specs))
    for i, (linear, spec) in enumerate(targets):
        _augment(graph, linear, inputs[LORA_INDICES], inputs[f"lora_a_{i}"], inputs[f"lora_b_{i}"], spec)
    graph.lint()
    gm.recompile()
    return specs


def _tiles(parts: list[tuple], out_features: int) -> bool:
    """The sorted slices cover the linear's output rows exactly once."""
    start = 0
    for _, first, end, _ in parts:
        if first != start:
            return False
        start = end
    return start == out_features


def _add_inputs(graph: torch.fx.Graph, names: list[str]) -> dict[str, Node]:
    """New placeholders ``names`` after the last placeholder of ``graph``."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    added = {}
    for name in names:
        with graph.inserting_after(last):
            last = added[name] = graph.placeholder(name)
    return added


def _augment(graph: torch.fx.Graph, linear: Node, indices: Node, lora_a: Node, lora_b: Node, spec: LoRASpec) -> None:
    """``linear``'s users read ``lora_expand(linear, lora_shrink(x, lora_a), lora_b)`` instead."""
    with graph.inserting_after(linear):
        shrink = graph.call_function(torch.ops.pagedpack.lora_shrink.default, (linear.args[0], lora_a, indices))
    with graph.inserting_after(shrink):
        expand = graph.call_function(torch.ops.pagedpack.lora_expand.default,
                                     (linear, shrink, lora_b, indices, list(spec.slice_sizes)))
    if "val" in linear.meta:
        expand.meta["val"] = linear.meta["val"]
    linear.replace_all_uses_with(expand, delete_user_cb=lambda user: user is not expand)
