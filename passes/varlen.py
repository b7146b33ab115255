"""Rewrite a single-sequence graph to packed variable-length attention, with no KV cache.

Used by the ``torch.compile`` backend for padded forward passes: the padding is removed before
the graph runs, so the graph sees one row of ``T`` real tokens from ``B`` sequences. Per-token
ops run unchanged; the sequence-aware parts are rewritten:

1. attention -> ``pagedpack.varlen_attention(q, k, v, cu_seqlens, scale, causal)`` (causal or
   bidirectional, as the verified mask says);
2. position ids computed in the graph (``arange`` over the tokens) -> the ``positions`` input;
3. "first token of the sequence" (``x[:, 0]``, e.g. BERT's pooler) -> a gather at each
   sequence's first row, making the result per sequence (``[1, B, ...]``).

Result signature: ``forward(*original inputs (token tensors now [1, T]), positions [T] int64,
cu_seqlens [B+1] int32)``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.fx import Node

import pagedpack.kernels.varlen  # noqa: F401  (registers torch.ops.pagedpack.varlen_attention)
from pagedpack.passes.attention_sites import AttentionSite, from_tokens_first
from pagedpack.passes.cleanup import EliminateDeadCode, StripExportChecks
from pagedpack.passes.find import FindAttention
from pagedpack.passes.manager import Pass, PassContext, PassManager, PassResult, SiteRewritePass
from pagedpack.passes.paged_attention import params_kwargs
from pagedpack.passes.positions import PositionsInput, maybe_positions
from pagedpack.passes.postcondition import NoAttentionLeft
from pagedpack.passes.recurrent import RecurrentLayers
from pagedpack.passes.report import PassReport
from pagedpack.passes.verify import CAUSAL, VerifyAttention

aten = torch.ops.aten


def rewrite_varlen(gm: torch.fx.GraphModule, sample_inputs: tuple, num_tokens: int, *,
                   make_sample: Callable[[int], tuple] | None = None, window_hint: int | None = None) -> PassReport:
    """Rewrite ``gm`` in place with :data:`VARLEN_PIPELINE` (unless a site is refused; then it is
    left as it was).

    ``sample_inputs`` is one sequence of ``num_tokens`` tokens in ``gm``'s calling convention,
    used to verify masks and find position ids; ``make_sample(n)`` makes such inputs for ``n``
    tokens, to check the masks past ``window_hint`` tokens too (sliding windows). Returns the
    report; ``report.ok`` means the rewrite happened.
    """
    ctx = PassContext(gm, PassReport(), sample_inputs, num_tokens, make_sample=make_sample, window_hint=window_hint)
    PassManager(VARLEN_PIPELINE).run(ctx)
    return ctx.report


class AddVarlenInputs(Pass):
    """``varlen_inputs``: the ``positions`` and ``cu_seqlens`` inputs, after the original ones
    (``ctx.inputs``). Counts: matched = rewritten = 2."""

    name = "varlen_inputs"
    provides = ("inputs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        graph = ctx.graph
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        for name in ("cu_seqlens", "positions"):
            with graph.inserting_after(last):
                ctx.inputs[name] = graph.placeholder(name)
        ctx.report.inputs_added = ["positions", "cu_seqlens"]
        return PassResult(matched=2, rewritten=2)


class VarlenAttention(SiteRewritePass):
    """``varlen_attention``: every site -> ``pagedpack.varlen_attention(q, k, v, cu_seqlens, scale=,
    causal=, sliding_window=, logits_soft_cap=, alibi_slopes=, ...)``, causal or bidirectional as
    verified, the site's parameters by name (tensors as buffers, :func:`params_kwargs`), q/k/v/out
    converted from and to the site's layout."""

    name = "varlen_attention"

    def rewrite_one(self, ctx: PassContext, index: int, site: AttentionSite) -> None:
        graph = ctx.graph
        with graph.inserting_before(site.output):
            q, k, v = site.tokens_first(call=graph.call_function)
            attention = graph.call_function(torch.ops.pagedpack.varlen_attention.default,
                                            (q, k, v, ctx.inputs["cu_seqlens"]),
                                            {**params_kwargs(graph, site), "causal": ctx.kinds[index] == CAUSAL})
            out = from_tokens_first(attention, site.layout, graph.call_function)
        site.output.replace_all_uses_with(out)


class FirstTokenGather(Pass):
    """``first_token_gather``: ``select(x [1, T, ...], 1, 0)`` (e.g. BERT's pooler) ->
    ``index_select(x, 1, cu_seqlens[:-1])`` (``[1, B, ...]``). Counts: matched = rewritten = selects."""

    name = "first_token_gather"
    requires = ("inputs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        count = _rewrite_first_token_selects(ctx.graph, ctx.inputs["cu_seqlens"])
        if count:
            ctx.report.notes.append(f"{count} first-token select(s) now gather each sequence's first row")
        return PassResult(matched=count, rewritten=count)


def _rewrite_first_token_selects(graph: torch.fx.Graph, cu_seqlens: Node) -> int:
    count, starts = 0, None
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is aten.select.int and node.args[1:] == (1, 0)):
            continue
        val = node.args[0].meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[0] == 1
                and isinstance(val.shape[1], torch.SymInt)):
            continue
        if starts is None:
            with graph.inserting_after(cu_seqlens):
                sliced = graph.call_function(aten.slice.Tensor, (cu_seqlens, 0, 0, -1))
            with graph.inserting_after(sliced):
                starts = graph.call_function(aten.to.dtype, (sliced, torch.int64))
        with graph.inserting_before(node):
            gathered = graph.call_function(aten.index_select.default, (node.args[0], 1, starts))
        node.replace_all_uses_with(gathered)
        count += 1
    return count


VARLEN_PIPELINE: tuple[Pass, ...] = (
    RecurrentLayers(), FindAttention(), VerifyAttention(causal_only=False, also=maybe_positions), StripExportChecks(),
    AddVarlenInputs(), PositionsInput(), VarlenAttention(), FirstTokenGather(), EliminateDeadCode(),
    NoAttentionLeft(),
)
