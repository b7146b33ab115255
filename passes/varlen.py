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

import torch
import torch.fx
from torch.fx import Node

import pagedpack.kernels.varlen  # noqa: F401  (registers torch.ops.pagedpack.varlen_attention)
from pagedpack.passes.attention_sites import default_scale, find_attention_sites
from pagedpack.passes.cleanup import eliminate_dead_code
from pagedpack.passes.paged_attention import heads_first_to_tokens_first
from pagedpack.passes.report import PassReport, op_counts
from pagedpack.passes.verify import CAUSAL, verify_sites

aten = torch.ops.aten


def rewrite_varlen(gm: torch.fx.GraphModule, sample_inputs: tuple, num_tokens: int) -> PassReport:
    """Rewrite ``gm`` in place (unless a site is refused; then it is left as it was).

    ``sample_inputs`` is one sequence of ``num_tokens`` tokens in ``gm``'s calling convention,
    used to verify masks and find position ids. Returns the report; ``report.refused`` empty
    means the rewrite happened.
    """
    graph = gm.graph
    report = PassReport(ops_before=op_counts(graph))
    sites = find_attention_sites(graph)
    kinds, values = verify_sites(gm, sites, sample_inputs, num_tokens, report,
                                 also=lambda n: _maybe_positions(n, num_tokens))
    site_nodes = {n for s in sites for n in (s.mask, s.key, s.value, s.key_source, s.value_source)}
    if not sites or report.refused:
        report.ops_after = report.ops_before
        return report

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        cu_seqlens = graph.placeholder("cu_seqlens")
    with graph.inserting_after(placeholders[-1]):
        positions = graph.placeholder("positions")
    report.inputs_added = ["positions", "cu_seqlens"]

    arange = torch.arange(num_tokens)
    sources = [n for n, v in values.items() if n not in site_nodes and torch.equal(v.reshape(-1).cpu(), arange)]
    for node in sources:
        with graph.inserting_after(cu_seqlens):
            view = graph.call_function(aten.view.default, (positions, [1, -1] if values[node].dim() == 2 else [-1]))
        node.replace_all_uses_with(view)
    report.notes.append(f"position ids: {len(sources)} node(s) replaced by the positions input"
                        if sources else "no position-id computation found")

    for site, kind in zip(sites, kinds):
        with graph.inserting_before(site.output):
            q, k, v = (heads_first_to_tokens_first(graph, n) for n in (site.query, site.key_source, site.value_source))
            attention = graph.call_function(torch.ops.pagedpack.varlen_attention.default,
                                            (q, k, v, cu_seqlens, default_scale(site), kind == CAUSAL))
            out = graph.call_function(aten.unsqueeze.default,
                                      (graph.call_function(aten.transpose.int, (attention, 0, 1)), 0))
        site.output.replace_all_uses_with(out)

    firsts = _rewrite_first_token_selects(graph, cu_seqlens)
    if firsts:
        report.notes.append(f"{firsts} first-token select(s) now gather each sequence's first row")
    eliminate_dead_code(gm)
    graph.lint()
    gm.recompile()
    report.ops_after = op_counts(graph)
    return report


def _maybe_positions(node: Node, n: int) -> bool:
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.dtype == torch.int64 and val.dim() in (1, 2)
            and val.numel() == n and val.shape[-1] == n)


def _rewrite_first_token_selects(graph: torch.fx.Graph, cu_seqlens: Node) -> int:
    """``select(x [1, T, ...], 1, 0)`` -> ``index_select(x, 1, cu_seqlens[:-1])`` (``[1, B, ...]``)."""
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
