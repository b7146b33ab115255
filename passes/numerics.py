"""How the passes compare a rewritten graph with the graph it came from, on a sample.

FlashAttention's rule (its tests; ``tests/test_ops.py`` here): a result in the model's dtype is
judged against a float64 run of the original graph, and may be off from it by at most
:data:`RTOL_FACTOR` times what the original graph itself loses in that dtype, plus a floor for
exact ties. The tolerance thus follows the model's own rounding (deep stacks, large activations)
instead of being a constant, so a failure means the rewrite computes something else.
"""
from __future__ import annotations

import copy

import torch
import torch.fx

from pagedpack.passes.cleanup import strip_export_checks

RTOL_FACTOR = 8.0
FLOOR = 1e-6  # relative to the float64 values' magnitude: ties of an exact computation


def float64_copy(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A float64 copy of ``module`` (parameters copied, the model's stay as they are): casts the
    graph hard-codes to a floating dtype (``x.to(torch.float32)`` in RMSNorm, softmax's
    ``dtype=``) cast to float64 instead, and export's dtype asserts are dropped."""
    # each floating parameter and buffer copied once, straight to float64 (not deep-copied, then cast)
    memo = {id(t): _float64_tensor(t) for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}
    module = copy.deepcopy(module, memo)
    strip_export_checks(module)
    for node in module.graph.nodes:
        node.args, node.kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _as_float64)
        if node.target is torch.ops.aten._grouped_mm.default and len(node.args) == 3 and not node.kwargs:
            node.target = grouped_mm  # aten's kernel takes no float64 (Mixture-of-Experts layers in bf16)
    module.recompile()
    return module


def _float64_tensor(tensor: torch.Tensor) -> torch.Tensor:
    copied = tensor.detach().double()
    return torch.nn.Parameter(copied, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else copied


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``aten._grouped_mm(input, weight, offs)`` for a 2-D ``input`` [S, K] whose rows are grouped
    by expert, 3-D ``weight`` [E, K, N] and ``offs`` [E], each group's end row (cumulative), in
    any dtype: ``[S, N]``, rows ``offs[e-1]:offs[e]`` times ``weight[e]``; rows past ``offs[-1]``
    (which aten leaves unset) are zero, as in transformers' own fallback (``integrations/moe.py``)."""
    if input.dim() != 2 or weight.dim() != 3:
        raise NotImplementedError(f"grouped_mm: a 2-D input and a 3-D weight, got {input.dim()}-D and {weight.dim()}-D")
    out = input.new_zeros(input.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(offs.tolist()):
        out[start:end] = input[start:end] @ weight[expert]
        start = end
    return out


def _as_float64(value):
    return torch.float64 if isinstance(value, torch.dtype) and value.is_floating_point else value


def float64_inputs(inputs) -> tuple:
    """``inputs`` with each floating tensor cast to float64, for a :func:`float64_copy`."""
    return tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)


def equal_to_floor(result: torch.Tensor, own: torch.Tensor) -> bool:
    """``result`` equals ``own`` (the original graph's, same dtype) to :data:`FLOOR` of its
    magnitude: no float64 run is needed. Integer and bool tensors: exactly equal; empty tensors
    of the same shape (a cache's zero-length past) are equal."""
    if not result.is_floating_point() or not result.numel():
        return torch.equal(result, own)
    return (result.double() - own.double()).abs().max().item() <= FLOOR * (1 + own.abs().max().item())


def excess_error(result: torch.Tensor, own: torch.Tensor, exact: torch.Tensor) -> str | None:
    """None if ``result`` is within the rule of the module docstring, else what it is off by.

    ``own``: the original graph's value in the model's dtype, ``exact``: the float64 run's, both
    of ``result``'s shape. Integer and bool tensors must equal ``own``; empty tensors of the same
    shape (a cache's zero-length past) compare as equal."""
    if not result.numel() and result.shape == own.shape:
        return None
    if not result.is_floating_point():
        return None if torch.equal(result, own) else "integer values differ"
    exact = exact.double()
    error = (result.double() - exact).abs().max().item()
    own_error = (own.double() - exact).abs().max().item()
    floor = FLOOR * (1 + exact.abs().max().item())
    if error <= RTOL_FACTOR * own_error + floor:
        return None
    return (f"off by {error:.3g} from a float64 run of the original graph, more than {RTOL_FACTOR:g} x the "
            f"original's own {own_error:.3g} + {floor:.3g}")
