"""The ``find_attention`` pass: the attention sites, and why every other softmax is not one.

Sites are what :data:`~pagedpack.passes.attention_sites.ATTENTION_PATTERNS` matches. Every softmax
no pattern took is reported with the reason it did not match. One over an *attention-shaped*
score tensor (``[1, heads, T, T]``, both ``T`` the symbolic token count) is attention the rewrite
does not understand, which would keep attending across the sequences of a packed step: it is a
refused site, and the model is refused.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from pagedpack.kernels.sparse_attention import sparse_attention_layers
from pagedpack.models.recurrent import paged_layer
from pagedpack.passes.attention_sites import (
    PASS_THROUGH,
    SOFTMAX,
    find_attention_sites,
    is_call,
    is_key_transpose,
    layer_index,
    matmul_operands,
)
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.report import SiteRecord, UnmatchedSoftmax, op_name

aten = torch.ops.aten
# Ops that may sit between the scores and the softmax (scale, soft-cap, bias, mask, casts, views).
_SCORE_OPS = PASS_THROUGH | {aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.div.Tensor, aten.div.Scalar,
                             aten.div_.Tensor, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.tanh.default,
                             aten.masked_fill.Scalar, aten.view.default, aten.reshape.default}
SOFT_CAP = ("a tanh between the scores and the softmax: attention logit soft-capping in a form other than "
            "cap * tanh(scores / cap) after the scale (Gemma 2's) is not supported")


class FindAttention(Pass):
    """``find_attention``: fill ``ctx.sites`` and report every softmax no pattern took.

    Counts: matched = sites found; refused = attention-shaped softmaxes no pattern took, or 1 when
    the graph has no attention at all, no layer whose state is paged and no sparse-attention layer
    (:mod:`pagedpack.passes.sparse_attention`): there is nothing to rewrite.
    """

    name = "find_attention"
    provides = ("sites",)
    mutates = False

    def __call__(self, ctx: PassContext) -> PassResult:
        graph, report = ctx.graph, ctx.report
        ctx.sites = find_attention_sites(graph)
        taken = {site.anchor for site in ctx.sites}
        sizes = token_sizes(graph)
        refused = 0
        for node in graph.nodes:
            if node in taken or not is_call(node, *SOFTMAX):
                continue
            shaped = is_attention_shaped(node, sizes)
            reason = explain_unmatched_softmax(node, attention_shaped=shaped)
            report.unmatched_softmaxes.append(UnmatchedSoftmax(node.name, reason, refused=shaped))
            if shaped:
                report.sites.append(SiteRecord(node.name, "softmax", layer_index(node), reason=reason))
                refused += 1
        paged = any(paged_layer(n) for n in graph.nodes) or sparse_attention_layers(graph)
        if not ctx.sites and not refused and not paged:
            report.notes.append("no attention site found")
            refused = 1
        return PassResult(matched=len(ctx.sites), refused=refused)


def explain_unmatched_softmax(softmax: Node, *, attention_shaped: bool = False) -> str:
    """Why no attention pattern took ``softmax``: not attention, a soft-cap, or another shape of
    attention (``attention_shaped``: its input is ``[1, heads, T, T]``). Scores are a matmul (or
    its einsum, :func:`matmul_operands`) of a query and a transposed key."""
    node, between = softmax.args[0], []
    while is_call(node, *_SCORE_OPS):
        between.append(op_name(node.target))
        node = node.args[0]
    query, key_t = matmul_operands(node) or (None, None)
    if not (_activation(query) and is_key_transpose(key_t) and _activation(key_t.args[0])):
        source = op_name(node.target) if isinstance(node, Node) and node.op == "call_function" else repr(node)
        if attention_shaped:
            return (f"attention-shaped scores [1, heads, T, T] computed through {source} (after: "
                    f"{', '.join(reversed(between)) or 'nothing'}), a form no entry of ATTENTION_PATTERNS matches "
                    "(each entry names the transformers code it reads)")
        return f"not attention (its input comes from {source}, not from a matmul of a query and a transposed key)"
    if op_name(aten.tanh.default) in between:
        return SOFT_CAP
    return ("attention scores that no entry of ATTENTION_PATTERNS matches (between the scores and the softmax: "
            f"{', '.join(reversed(between)) or 'nothing'}; softmax args {softmax.args[1:]})")


def token_sizes(graph: torch.fx.Graph) -> set:
    """The symbolic sizes of the graph inputs (for a captured LM: the token count ``T``)."""
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return {s.node.expr for v in vals if isinstance(v, torch.Tensor) for s in v.shape if isinstance(s, torch.SymInt)}


def is_attention_shaped(node: Node, sizes: set) -> bool:
    """``node`` is ``[1, heads, T, T]`` with ``T`` one of the symbolic input ``sizes``."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or val.shape[0] != 1:
        return False
    rows, cols = val.shape[-2:]
    return (isinstance(rows, torch.SymInt) and isinstance(cols, torch.SymInt)
            and rows.node.expr == cols.node.expr and rows.node.expr in sizes)


def _activation(node) -> bool:
    """A tensor computed in the graph (not a parameter or constant)."""
    return isinstance(node, Node) and node.op != "get_attr"
