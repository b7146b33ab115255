"""Find the attention sites of a captured graph with the table of attention patterns.

:data:`ATTENTION_PATTERNS` names each form ``transformers`` emits under ``torch.export``, with the
model families it comes from and the attention implementation:
- ``sdpa``: ``aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=,
  enable_gqa=)``;
- ``eager_*``: ``matmul(q, k^T) -> [mul or div by a constant] -> [add mask] -> softmax(-1) ->
  [casts, dropout] -> matmul(., v)``;
- ``eager_alibi_*``: the same with an ALiBi bias joining the scores (BLOOM, MPT, Falcon with
  ``alibi=True``), BLOOM's on ``[H, T, D]`` tensors (batch and heads merged, :data:`MERGED_HEADS`);
- ``eager_sinks``: a sink logit per head joins the scores as one more column, dropped after the
  softmax (gpt-oss).
In all, K and V may come through ``repeat_kv`` (``unsqueeze(2) -> expand -> reshape``); the site
records the pre-repeat tensors, which are what the paged KV cache stores.
Structural problems are recorded as a refusal reason on the site; nothing is changed here. What
the mask and the bias compute (the window, the ALiBi slopes) is read on a sample by
:mod:`pagedpack.passes.verify`.
"""
from __future__ import annotations

import math
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.fx import Node

from pagedpack.kernels.attention_params import AttentionParams, op_arguments
from pagedpack.passes.report import op_name

aten = torch.ops.aten
SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
PASS_THROUGH = frozenset({aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.alias.default,
                          aten.clone.default, aten.contiguous.default})
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
BLOCKED = -1e4  # an additive mask entry at or below this blocks its key (transformers uses the dtype's min)

# The layouts of a site's query, key, value and output (T tokens of one sequence, H heads, D head_dim).
HEADS_FIRST = "[1, H, T, D]"  # transformers' attention tensors, batch 1
MERGED_HEADS = "[H, T, D]"  # batch and heads merged: BLOOM's baddbmm / bmm
LAYOUT_RANK = {HEADS_FIRST: 4, MERGED_HEADS: 3}
_LAYOUT_OF_RANK = {rank: layout for layout, rank in LAYOUT_RANK.items()}


def _apply(op, args: tuple):
    return op(*args)


@dataclass
class AttentionSite:
    """One attention computation in the graph (query, key, value and output in ``layout``)."""

    name: str
    form: str
    layer: int | None
    output: Node
    query: Node
    key: Node
    value: Node
    key_source: Node  # K before repeat_kv: what the cache stores
    value_source: Node
    num_rep: int  # query heads per KV head, as repeat_kv repeats them
    mask: Node | None
    is_causal: bool
    scale: float | None
    refusal: str | None = None
    pattern: str = ""  # the ATTENTION_PATTERNS entry that matched
    anchor: Node | None = None  # the node it matched at (the SDPA call or the softmax)
    logits_soft_cap: float | None = None  # cap * tanh(scores / cap), read off the graph
    sliding_window: int | None = None  # read off the verified mask
    attention_chunk_size: int | None = None  # read off the verified mask (Llama-4's chunked layers)
    layout: str = HEADS_FIRST  # HEADS_FIRST or MERGED_HEADS
    mask_marks_blocked: bool = False  # a boolean mask that is True at the blocked keys (masked_fill's)
    bias: Node | None = None  # a score bias (ALiBi) broadcasting to the scores [..., H, T, T]
    bias_factor: float = 1.0  # the bias enters the softmax times this (baddbmm beta; the scale if added before it)
    alibi_slopes: Tensor | None = None  # float32 [num_heads], read off the verified bias and mask
    sinks: Node | None = None  # the per-head sink logits (before their reshape and expand to a column)
    sink_values: Tensor | None = None  # [num_heads], read off ``sinks`` on the sample
    key_transposed: bool = False  # key and key_source are k^T ([..., H, D, T]): the model never forms k (GPT-1)

    @property
    def sampled_nodes(self) -> tuple[Node | None, ...]:
        """The nodes whose values on a sample the verification checks (``mask``, ``bias`` may be None),
        then the other leaves of :meth:`computation`."""
        nodes = (self.mask, self.bias, self.query, self.key, self.value, self.key_source, self.value_source,
                 self.output, self.sinks)
        return nodes + tuple(leaf for leaf in self.computation()[0] if leaf not in nodes)

    def computation(self) -> tuple[list[Node], list[Node]]:
        """``(leaves, inner)``: the nodes the site's output is computed from (its query, key, value,
        mask and bias, and whatever else feeds the nodes between them and the output: sizes,
        constants) and those nodes in between, the output last, in graph order."""
        starts = [n for n in (self.query, self.key, self.value, self.mask, self.bias) if n is not None]
        ancestors, stack = set(), [self.output]
        while stack:
            node = stack.pop()
            if node not in ancestors:
                ancestors.add(node)
                stack.extend([] if node in starts else node.all_input_nodes)
        derived, inner = set(starts), []
        for node in self.output.graph.nodes:
            if node in ancestors and node not in derived and any(i in derived for i in node.all_input_nodes):
                derived.add(node)
                inner.append(node)
        leaves = [*starts, *(i for n in inner for i in n.all_input_nodes if i not in derived)]
        return list(dict.fromkeys(leaves)), inner

    def key_in_layout(self, key, call: Callable = _apply):
        """``key`` (the site's key or key source, as a node or a value) in the site's layout:
        transposed back from ``k^T`` if :attr:`key_transposed` (``call`` as :func:`to_tokens_first`'s)."""
        return call(aten.transpose.int, (key, -2, -1)) if self.key_transposed else key

    def tokens_first(self, value_of: Callable = lambda node: node, call: Callable = _apply) -> tuple:
        """``(query, key, value)`` as ``[T, H, D]``, the ops' layout: ``value_of(node)`` (the node
        itself, or its sampled tensor) of the query and the key and value before ``repeat_kv``,
        converted by ``call`` (:func:`to_tokens_first`)."""
        key = self.key_in_layout(value_of(self.key_source), call)
        return tuple(to_tokens_first(x, self.layout, call)
                     for x in (value_of(self.query), key, value_of(self.value_source)))

    @property
    def num_heads(self) -> int:
        """Query heads (dim -3 of the query in either layout)."""
        return self.query.meta["val"].shape[-3]

    def params(self) -> AttentionParams:
        """What the site computes besides causal ``softmax(q k^T * scale) v``, for the ops."""
        return AttentionParams(scale=default_scale(self), sliding_window=self.sliding_window,
                               logits_soft_cap=self.logits_soft_cap, alibi_slopes=self.alibi_slopes,
                               sinks=self.sink_values, attention_chunk_size=self.attention_chunk_size)


def to_tokens_first(x, layout: str, call: Callable = _apply):
    """``x`` in ``layout`` (:data:`HEADS_FIRST` or :data:`MERGED_HEADS`) -> ``[T, H, D]``, the ops' layout.

    ``call(op, args)`` applies each aten op: to the tensor ``x`` by default; ``graph.call_function``
    emits them into a graph instead (``x`` a Node)."""
    if layout == HEADS_FIRST:
        x = call(aten.squeeze.dim, (x, 0))
    return call(aten.transpose.int, (x, 0, 1))


def from_tokens_first(x, layout: str, call: Callable = _apply):
    """``[T, H, D]`` -> ``layout``: the inverse of :func:`to_tokens_first` (same ``call``)."""
    x = call(aten.transpose.int, (x, 0, 1))
    return call(aten.unsqueeze.default, (x, 0)) if layout == HEADS_FIRST else x


@dataclass(frozen=True)
class AttentionPattern:
    """One entry of :data:`ATTENTION_PATTERNS`.

    ``families``: the models (and code) that emit it; ``implementation``: their
    ``attn_implementation`` (the site's ``form``); ``anchors``: the ops a match starts at;
    ``match(anchor) -> AttentionSite | None``.
    """

    name: str
    families: str
    implementation: str
    anchors: frozenset
    match: Callable[[Node], AttentionSite | None]


def find_attention_sites(graph: torch.fx.Graph) -> list[AttentionSite]:
    """All attention sites of ``graph`` in graph order: per node, the first pattern that matches."""
    sites = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for pattern in ATTENTION_PATTERNS:
            site = pattern.match(node) if node.target in pattern.anchors else None
            if site is not None:
                site.pattern, site.anchor = pattern.name, node
                sites.append(site)
                break
    return sites


def _sdpa_site(node: Node) -> AttentionSite:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    defaults = (None, None, None, None, 0.0, False)
    a = {k: node.args[i] if i < len(node.args) else node.kwargs.get(k, d)
         for i, (k, d) in enumerate(zip(names, defaults))}
    key_src, k_rep = unrepeat_kv(a["key"])
    value_src, v_rep = unrepeat_kv(a["value"])
    layout = _layout(a["query"], a["key"], a["value"], node)
    site = AttentionSite(
        name=node.name, form="sdpa", layer=layer_index(node), output=node,
        query=a["query"], key=a["key"], value=a["value"], key_source=key_src, value_source=value_src,
        num_rep=k_rep, mask=a["attn_mask"], is_causal=bool(a["is_causal"]),
        scale=node.kwargs.get("scale"), layout=layout or HEADS_FIRST,
    )
    if a["dropout_p"] != 0.0:
        site.refusal = f"dropout_p={a['dropout_p']} (attention dropout is active; put the model in eval mode)"
    elif k_rep != v_rep:
        site.refusal = f"K and V are repeated differently ({k_rep} vs {v_rep})"
    elif layout is None:
        site.refusal = f"query, key, value and output are neither all {HEADS_FIRST} nor all {MERGED_HEADS}"
    return site


@dataclass
class _Scores:
    """An eager site's softmax input as a pattern reads it: ``q @ k^T`` (``key_t`` is ``k^T``) and
    its scale, with what joins them (the :class:`AttentionSite` fields of the same names)."""

    query: Node
    key_t: Node
    scale: float
    mask: Node | None = None
    mask_marks_blocked: bool = False
    logits_soft_cap: float | None = None
    bias: Node | None = None
    bias_factor: float = 1.0
    sinks: Node | None = None


def _eager_site(softmax: Node, scores_of: Callable[[Node], _Scores | None],
                lse_sink: bool = False) -> AttentionSite | None:
    """Match ``<scores> -> [casts] softmax(-1) -> [casts, dropout, views] -> matmul or bmm(., v)``;
    None if no match. ``scores_of(x)`` reads the softmax input ``x`` (None: not this pattern's form).
    With ``lse_sink`` the site's output is that ``@ v`` gated by a sink through the logsumexp of
    the scores (:func:`_lse_sink_gate`), which is then the scores' one reader besides the softmax.
    Query and key merged from ``[1, H, T, D]`` to ``[H, T, D]`` for a ``bmm`` / ``baddbmm`` whose
    probabilities ``@ v`` stay ``[1, H, T, D]`` (GPT-NeoX-Japanese) are read before the merge.
    """
    if softmax.args[1] not in (-1, 3):
        return None
    inner = _before_casts(softmax.args[0])
    scores = scores_of(inner)
    if scores is None:
        return None
    start = softmax if scores.sinks is None else _sink_column_dropped(softmax)
    if start is None:
        return None
    probs = _single_user_chain(start)
    readers = _readers(probs)
    attention = readers[0] if len(readers) == 1 else None
    operands = matmul_operands(attention)
    if operands is None or operands[0] is not probs:
        return None
    out, gate_reader = attention, None
    if lse_sink:
        gated = _lse_sink_gate(attention, inner)
        if gated is None:
            return None
        out, scores.sinks, gate_reader = gated
    query, (key, key_transposed), value = scores.query, _key_of(scores.key_t), operands[1]
    layout = _layout(query, key, value, out)
    if layout is None:
        query, key = _unmerged_heads(query), _unmerged_heads(key)
        layout = _layout(query, key, value, out)
    if layout is None:
        return None
    key_src, k_rep = unrepeat_kv(key)
    value_src, v_rep = unrepeat_kv(value)
    site = AttentionSite(
        name=out.name, form="eager", layer=layer_index(out), output=out,
        query=query, key=key, value=value, key_source=key_src, value_source=value_src,
        num_rep=k_rep, mask=scores.mask, is_causal=False, scale=scores.scale,
        logits_soft_cap=scores.logits_soft_cap, layout=layout, mask_marks_blocked=scores.mask_marks_blocked,
        bias=scores.bias, bias_factor=scores.bias_factor, sinks=scores.sinks, key_transposed=key_transposed,
    )
    reader = _other_reader(softmax, expected=gate_reader)
    if reader is not None:
        site.refusal = (f"the attention scores are also read outside the softmax (by {reader.name} = "
                        f"{op_name(reader.target)}), a form paged attention does not compute")
    elif probs is not softmax and _has_active_dropout(softmax, probs):
        site.refusal = "attention dropout is active (put the model in eval mode)"
    elif k_rep != v_rep:
        site.refusal = f"K and V are repeated differently ({k_rep} vs {v_rep})"
    return site


def _lse_sink_gate(attention: Node, scores: Node) -> tuple[Node, Node, Node] | None:
    """Granite-SWA (``modeling_granite_swa.eager_attention_forward``, GraniteMoE-SWA's the same):
    ``attention * sigmoid(logsumexp(scores, -1) - sinks.view(1, -1, 1)).unsqueeze(-1)``, casts
    between, where ``attention`` is ``softmax(scores) @ v``: ``(the product, sinks before the view,
    the logsumexp)``; None if ``attention``'s one reader is not that.

    It is gpt-oss's sinks (:attr:`AttentionParams.sinks`): with ``l = logsumexp(scores)``,
    ``sigmoid(l - s) = e^l / (e^l + e^s)`` and ``softmax(scores) = e^scores / e^l``, so the gated
    weights are ``e^scores / (e^l + e^s)``, the softmax over ``[scores, s]`` less its sink column
    (the check of the site's output on the sample proves it per site)."""
    readers = _readers(attention)
    product = readers[0] if len(readers) == 1 else None
    if not (is_call(product, aten.mul.Tensor) and product.args[0] is attention):
        return None
    factor = _before_casts(product.args[1])
    if not (is_call(factor, aten.unsqueeze.default) and factor.args[1] in (-1, 3)):
        return None
    gate = _before_casts(factor.args[0])
    difference = _before_casts(gate.args[0]) if is_call(gate, aten.sigmoid.default) else None
    if not is_call(difference, aten.sub.Tensor):
        return None
    lse, sinks = difference.args
    if not (is_call(lse, aten.logsumexp.default) and lse.args[0] is scores and list(lse.args[1]) in ([-1], [3])
            and not (lse.args[2:] or (False,))[0] and isinstance(sinks, Node)):
        return None
    return product, _before_reshape(sinks), lse


def _key_of(key_t: Node) -> tuple[Node, bool]:
    """``(key, key_transposed)`` of the ``k^T`` of ``q @ k^T`` (:func:`is_key_transpose`): ``k``
    for ``k.transpose(-2, -1)``; ``k^T`` itself when the model never forms ``k`` (GPT-1's
    ``split_heads(k, k=True)``: ``view(x, [1, T, H, D]).permute(0, 2, 3, 1)``)."""
    return (key_t.args[0], False) if is_call(key_t, aten.transpose.int) else (key_t, True)


def _unmerged_heads(node: Node) -> Node:
    """``node`` before a view that merges batch and heads of ``[1, H, T, D]`` into ``[H, T, D]``,
    else ``node``."""
    source = node.args[0] if is_call(node, *_RESHAPES) else None
    return source if _rank(source) == 4 and _rank(node) == 3 and _regroups_heads(source, node) else node


def _with_sinks(scores_of: Callable[[Node], _Scores | None], x: Node) -> _Scores | None:
    """gpt-oss (``modeling_gpt_oss.eager_attention_forward``), MiMo-V2-Flash's sliding layers:
    ``cat([<scores>, sinks.reshape(1, -1, 1, 1).expand(...)], -1)``, less its row maximum or not
    (:func:`_less_row_max`), into the softmax, whose last column is dropped after
    (:func:`_sink_column_dropped`). ``scores_of`` reads ``<scores>``; the sinks are the tensor
    before the reshape and expand (the verification reads them on the sample and checks the
    site's output)."""
    x = _less_row_max(x) or x
    if not (is_call(x, aten.cat.default) and len(x.args[0]) == 2 and x.args[1] in (-1, 3)):
        return None
    inner, column = x.args[0]
    scores = scores_of(inner)
    if scores is None or not is_call(column, aten.expand.default):
        return None
    scores.sinks = _before_reshape(column.args[0])
    return scores


def _less_row_max(x: Node) -> Node | None:
    """``y`` if ``x`` is ``y - y.max(-1, keepdim=True).values`` (a shift softmax ignores, for
    stability in bf16: gpt-oss, MiMo-V2-Flash), else None."""
    if not is_call(x, aten.sub.Tensor):
        return None
    y, peak = x.args
    if (is_call(peak, operator.getitem) and peak.args[1] == 0 and is_call(peak.args[0], aten.max.dim)
            and peak.args[0].args[0] is y and peak.args[0].args[1:] in ((-1, True), (3, True))):
        return y
    return None


def _row_max_shifted(scores_of: Callable[[Node], _Scores | None], x: Node) -> _Scores | None:
    """MiMo-V2-Flash's full-attention layers (``modeling_mimo_v2_flash.eager_attention_forward``
    without sinks): ``<scores> - <scores>.max(-1, keepdim=True).values`` (:func:`_less_row_max`),
    ``scores_of`` reading ``<scores>``."""
    y = _less_row_max(x)
    return None if y is None else scores_of(y)


def _sink_column_dropped(softmax: Node) -> Node | None:
    """The softmax's only reader if it is ``probs[..., :-1]`` (the sink column dropped), else None."""
    readers = _readers(softmax)
    drop = readers[0] if len(readers) == 1 else None
    if is_call(drop, aten.slice.Tensor) and drop.args[1] in (-1, 3) and tuple(drop.args[2:4]) == (0, -1):
        return drop
    return None


def _other_reader(softmax: Node, expected: Node | None = None) -> Node | None:
    """A node other than ``softmax`` (and the pattern's ``expected`` reader) that reads its input
    scores (or a cast of them on the way): once the site is rewritten, such a reader would see the
    packed step's scores across sequences."""
    chain, node = [softmax.args[0]], softmax.args[0]
    while is_call(node, *PASS_THROUGH):
        node = node.args[0]
        chain.append(node)
    inside = {softmax, expected, *chain}
    return next((user for n in chain for user in _readers(n) if user not in inside), None)


def _readers(node: Node) -> list[Node]:
    """``node``'s users but those that compute nothing from it: the export's dtype assertions
    (``_assert_tensor_metadata``), a ``type_as`` that takes only its dtype (ProphetNet's
    ``softmax(scores).type_as(scores)``) and dead nodes (unread and pure: ProphetNet's view of the
    probabilities it would return with ``output_attentions``)."""
    return [u for u in node.users if not (is_call(u, aten._assert_tensor_metadata.default)
                                          or (is_call(u, aten.type_as.default) and u.args[0] is not node)
                                          or (not u.users and not u.is_impure()))]


def _scaled_scores(x: Node, scaling: Callable[[Node], tuple[Node, float] | None],
                   soft_cap: bool = False) -> _Scores | None:
    """``scaling(matmul(q, k^T)) [soft-cap] [+ mask]`` (``eager_attention_forward``).

    ``scaling(x)`` is ``(scores, scale)`` if ``x`` is the scores scaled that way, else None; with
    ``soft_cap`` the scaled scores must pass ``cap * tanh(scores / cap)`` (Gemma 2).
    """
    plus = _plus(x)
    x, mask = plus or (x, None)
    cap = None
    if soft_cap:
        capped = _soft_cap(x)
        if capped is None:
            return None
        x, cap = capped
    scaled = scaling(x)
    return None if scaled is None else _matmul_scores(*scaled, mask=mask, logits_soft_cap=cap)


def _baddbmm_scores(x: Node) -> _Scores | None:
    """BLOOM (``modeling_bloom.BloomAttention.forward``): ``baddbmm(alibi [H, 1, T], q [H, T, D], k^T,
    beta=beta, alpha=inv_norm_factor)`` viewed as ``[1, H, T, T]``, ``+ mask``; GPT-NeoX-Japanese
    (``modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention._attn``) the same onto
    ``torch.zeros(H, T, T)``: no bias."""
    plus = _plus(x)
    if plus is None:
        return None
    scores, mask = plus
    scores = _before_reshape(scores)
    if not is_call(scores, aten.baddbmm.default):
        return None
    a = op_arguments(scores)
    if not is_key_transpose(a["batch2"]):
        return None
    bias = None if is_call(a["self"], aten.zeros.default) else a["self"]
    return _Scores(a["batch1"], a["batch2"], float(a["alpha"]), mask=mask, bias=bias, bias_factor=float(a["beta"]))


def _masked_fill_scores(x: Node) -> _Scores | None:
    """``scores.masked_fill(mask, min)``, the boolean mask True at the blocked keys, ``scores`` one of:
    MPT's (``modeling_mpt.MptAttention.forward``) ``matmul(q, k^T) * softmax_scale + position_bias
    [H, 1, T]``; XLM's (``modeling_xlm.MultiHeadAttention.forward``, in place: ``masked_fill_``)
    ``matmul(q, k^T)``, ``q`` divided by ``sqrt(head_dim)`` before."""
    if not is_call(x, aten.masked_fill.Scalar, aten.masked_fill_.Scalar):
        return None
    a = op_arguments(x)
    if not (isinstance(a["value"], (int, float)) and a["value"] <= BLOCKED):
        return None
    plus = _plus(a["self"])
    if plus is None:
        return _matmul_scores(a["self"], 1.0, mask=a["mask"], mask_marks_blocked=True)
    scores, bias = plus
    scaled = _mul_scale(scores)
    return None if scaled is None else _matmul_scores(*scaled, mask=a["mask"], mask_marks_blocked=True, bias=bias)


def _keep_masked_scores(x: Node) -> _Scores | None:
    """GPT-1 (``modeling_openai.Attention._attn``): ``w * b + -1e4 * (1 - b)``, ``w`` the scores
    ``matmul(q, k^T)`` (``/ sqrt(head_dim)`` with ``scale``), ``b`` the ``[1, 1, T, T]`` causal
    buffer of ones and zeros. The site's mask is the additive ``-1e4 * (1 - b)``, read on the
    samples as any mask; the keep factor is the same ``b``, so wherever that mask lets a key
    through unbiased (0) it is one, and it only zeroes the scores the mask sets to ``-1e4`` (at or
    below :data:`BLOCKED`, blocked)."""
    plus = _plus(x)
    if plus is None or not (is_call(plus[0], aten.mul.Tensor) and is_call(plus[1], aten.mul.Tensor)):
        return None
    (scaled, keep), (complement, fill) = plus[0].args, plus[1].args
    if not (is_call(complement, aten.rsub.Scalar) and complement.args[0] is keep and complement.args[1:2] == (1,)
            and isinstance(fill, (int, float)) and fill <= BLOCKED):
        return None
    scores, scale = _div_scale(scaled) or _unscaled(scaled)
    return _matmul_scores(scores, scale, mask=plus[1])


def _where_scores(x: Node) -> _Scores | None:
    """GPT-Neo (``modeling_gpt_neo.GPTNeoSelfAttention._attn``): ``where(bias[..., :T, :T], matmul(q,
    k^T), finfo.min) + mask``, unscaled. The boolean buffer (True at the keys each query sees: causal,
    within ``window_size`` on the local layers) is the site's mask; the additive mask after it (the
    model's causal mask) must add nothing to it, which the check of the site's output on the sample
    proves, as it proves the fill blocks."""
    plus = _plus(x)
    where = plus[0] if plus is not None else x
    if not is_call(where, aten.where.self) or not isinstance(where.args[0], Node):
        return None
    return _matmul_scores(where.args[1], 1.0, mask=where.args[0])


def _falcon_alibi_scores(x: Node) -> _Scores | None:
    """Falcon with ``alibi=True`` (``modeling_falcon.FalconAttention.forward``, eager):
    ``(view(matmul(q, k^T)) + alibi [1, H, 1, T]) *= inv_norm_factor``, ``+ mask``; the bias joins
    before the scale (and ``FalconModel.forward`` puts ``alibi / sqrt(head_dim)`` in the mask too)."""
    plus = _plus(x)
    scaled = None if plus is None else _mul_scale(plus[0])
    biased = None if scaled is None else _plus(scaled[0])
    if biased is None:
        return None
    (scores, bias), (_, scale), mask = biased, scaled, plus[1]
    return _matmul_scores(_before_reshape(scores), scale, mask=mask, bias=bias, bias_factor=scale)


def _matmul_scores(x: Node, scale: float, **fields) -> _Scores | None:
    """``x`` is ``matmul(q, k^T)`` (or that einsum, :func:`matmul_operands`): its :class:`_Scores`
    with ``scale`` and ``fields``; else None."""
    operands = matmul_operands(x)
    if operands is not None and is_key_transpose(operands[1]):
        return _Scores(*operands, scale, **fields)
    return None


def _biased_scores(x: Node) -> _Scores | None:
    """ProphetNet's main stream (``modeling_prophetnet.ProphetNetNgramSelfAttention.forward``):
    ``einsum("bntc,bncs->bnts", q, k^T) + bias + mask``, the query scaled before; the bias (its
    relative-position embeddings) is the site's, which :mod:`.verify` serves only if it is ALiBi."""
    plus = _plus(x)
    biased = None if plus is None else _plus(plus[0])
    return None if biased is None else _matmul_scores(biased[0], 1.0, mask=plus[1], bias=biased[1])


def matmul_operands(node) -> tuple[Node, Node] | None:
    """``(a, b)`` if ``node`` is ``a @ b``: ``matmul``, ``bmm``, or an ``einsum`` whose equation is
    a batched matmul (``"...ij,...jk->...ik"`` in any letters: ProphetNet's ``"bntc,bncs->bnts"``);
    else None."""
    if is_call(node, aten.matmul.default, aten.bmm.default):
        return node.args[0], node.args[1]
    if not (is_call(node, aten.einsum.default) and len(node.args[1]) == 2):
        return None
    inputs, _, out = node.args[0].replace(" ", "").partition("->")
    a, _, b = inputs.partition(",")
    batch = out[:-2]
    letters = batch + out[-2:] + a[-1:]
    if (len(a) == len(b) == len(out) >= 2 and a[:-2] == b[:-2] == batch and (a[-2], b[-1]) == (out[-2], out[-1])
            and a[-1] == b[-2] and len(set(letters)) == len(letters) and letters.isalpha()):
        return tuple(node.args[1])
    return None


def _plus(x: Node) -> tuple[Node, Node] | None:
    """``a + b`` of two tensors: ``(a, b)``; else None."""
    if is_call(x, aten.add.Tensor) and isinstance(x.args[1], Node):
        return x.args[0], x.args[1]
    return None


def _before_casts(x: Node) -> Node:
    """``x`` before the dtype casts and copies (:data:`PASS_THROUGH`) that produce it."""
    while is_call(x, *PASS_THROUGH):
        x = x.args[0]
    return x


def _before_reshape(x: Node) -> Node:
    """``x`` before a reshape or view of it (the output check on the sample proves what it did)."""
    return x.args[0] if is_call(x, *_RESHAPES) else x


def _layout(*nodes: Node) -> str | None:
    """The layout of ``nodes`` (query, key, value, output) from their rank, None if they differ or
    are neither 4-D nor 3-D."""
    ranks = {_rank(n) for n in nodes}
    return _LAYOUT_OF_RANK.get(ranks.pop()) if len(ranks) == 1 else None


def _rank(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val.dim() if isinstance(val, Tensor) else None


def _mul_scale(x: Node) -> tuple[Node, float] | None:
    """``scores * s``, ``s`` a constant (or ``scores *= s`` on scores used nowhere else)."""
    if _by_constant(x, (aten.mul.Tensor, aten.mul.Scalar), (aten.mul_.Tensor, aten.mul_.Scalar)):
        return x.args[0], float(x.args[1])
    return None


def _div_scale(x: Node) -> tuple[Node, float] | None:
    """``scores / d``, ``d`` a constant (or ``scores /= d``, as Falcon's eager attention, on
    scores used nowhere else)."""
    if _by_constant(x, (aten.div.Tensor, aten.div.Scalar), (aten.div_.Tensor, aten.div_.Scalar)):
        return x.args[0], 1.0 / float(x.args[1])
    return None


def _by_constant(x: Node, ops: tuple, in_place_ops: tuple) -> bool:
    """``x`` is one of ``ops`` (or an in-place one whose input has no other user) by a constant."""
    if not (isinstance(x, Node) and len(x.args) == 2 and isinstance(x.args[1], (int, float))):
        return False
    return is_call(x, *ops) or (is_call(x, *in_place_ops) and len(x.args[0].users) == 1)


def _soft_cap(x: Node) -> tuple[Node, float] | None:
    """``cap * tanh(scores / cap)``, ``cap`` one constant: ``(scores, cap)``."""
    if not (is_call(x, aten.mul.Tensor, aten.mul.Scalar) and isinstance(x.args[1], (int, float))
            and is_call(x.args[0], aten.tanh.default)):
        return None
    divided = x.args[0].args[0]
    if is_call(divided, aten.div.Tensor, aten.div.Scalar) and divided.args[1] == x.args[1]:
        return divided.args[0], float(x.args[1])
    return None


def _unscaled(x: Node) -> tuple[Node, float]:
    return x, 1.0


def is_key_transpose(node) -> bool:
    """``k.transpose(-2, -1)`` of a 4-D or 3-D ``k`` (the ``k^T`` of ``q @ k^T``), or GPT-1's
    ``view(x, [1, T, H, D]).permute(0, 2, 3, 1)``, ``k^T`` of a ``k`` it never forms."""
    if is_call(node, aten.permute.default):
        return _rank(node) == 4 and list(node.args[1]) == [0, 2, 3, 1]
    rank = _rank(node) if is_call(node, aten.transpose.int) else None
    return rank in _LAYOUT_OF_RANK and sorted(d % rank for d in node.args[1:]) == [rank - 2, rank - 1]


def _single_user_chain(node: Node) -> Node | None:
    """Follow casts, inactive dropout and views that keep the rows (:func:`_regroups_heads`) from the
    softmax to the node feeding ``@ v``."""
    while True:
        users = _readers(node)
        if len(users) != 1:
            return node
        user = users[0]
        if user.target in PASS_THROUGH or is_call(user, aten.dropout.default) or _regroups_heads(node, user):
            node = user
        else:
            return node


def _regroups_heads(node: Node, view: Node) -> bool:
    """``view`` reshapes ``node`` keeping its last two sizes (the ``[T, T]`` of each head): only batch
    and heads regroup (BLOOM's ``[1, H, T, T] -> [H, T, T]``)."""
    before, after = node.meta.get("val"), view.meta.get("val")
    return (is_call(view, *_RESHAPES) and isinstance(before, Tensor) and isinstance(after, Tensor)
            and _sizes(before.shape[-2:]) == _sizes(after.shape[-2:]))


def _sizes(shape) -> tuple:
    """``shape`` comparable without guards: a symbolic size as its expression."""
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in shape)


def _has_active_dropout(start: Node, end: Node) -> bool:
    node = end
    while node is not start:
        if is_call(node, aten.dropout.default) and node.args[1] != 0.0 and node.args[2]:
            return True
        node = node.args[0]
    return False


def unrepeat_kv(node: Node) -> tuple[Node, int]:
    """Undo ``repeat_kv`` (``x[:, :, None].expand(b, h, n, s, d).reshape(b, h*n, s, d)``).

    Returns ``(pre-repeat node, n)``; ``(node, 1)`` when ``node`` is not a repeat.
    """
    if is_call(node, *_RESHAPES) and is_call(node.args[0], aten.expand.default):
        expand = node.args[0]
        unsqueezed = _skip_full_slices(expand.args[0])
        if is_call(unsqueezed, aten.unsqueeze.default) and unsqueezed.args[1] == 2:
            source = unsqueezed.args[0]
            rep = expand.args[1][2]
            if isinstance(rep, int):
                return source, rep
    return node, 1


def _skip_full_slices(node):
    """Step over ``x[:, :, :, :]``-style slices (``slice(x, dim, 0, INT64_MAX)``), which are no-ops."""
    while is_call(node, aten.slice.Tensor) and tuple(node.args[2:]) in ((0, sys.maxsize), (0, sys.maxsize, 1)):
        node = node.args[0]
    return node


def default_scale(site: AttentionSite) -> float:
    """The softmax scale: the explicit one, else SDPA's ``1/sqrt(head_dim)``."""
    if site.scale is not None:
        return float(site.scale)
    return 1.0 / math.sqrt(site.query.meta["val"].shape[-1])


def is_call(node, *targets) -> bool:
    """``node`` is a ``call_function`` node of one of ``targets``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def layer_index(node: Node) -> int | None:
    """The decoder layer a node belongs to, from export's ``nn_module_stack`` metadata."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        match = re.search(r"layers[._](\d+)", str(path))
        if match:
            return int(match.group(1))
    return None


ATTENTION_PATTERNS: tuple[AttentionPattern, ...] = (
    AttentionPattern(
        "sdpa", families="every transformers model under attn_implementation='sdpa' (sdpa_attention_forward); "
        "Falcon with alibi=True puts its ALiBi bias in the float attn_mask (FalconModel.forward), read by "
        "verify_attention", implementation="sdpa", anchors=frozenset({aten.scaled_dot_product_attention.default}),
        match=_sdpa_site),
    AttentionPattern(
        "eager_lse_sink", families="Granite-SWA, GraniteMoE-SWA (eager_attention_forward: softmax(matmul(q, k^T) * "
        "scaling + mask) @ v gated by sigmoid(logsumexp(scores, -1) - sinks), gpt-oss's sinks in another form)",
        implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_scaled_scores, scaling=_mul_scale), lse_sink=True)),
    AttentionPattern(
        "eager_mul_scale", families="Llama, Mistral, Qwen2 and every model sharing their eager_attention_forward "
        "(matmul(q, k^T) * scaling)", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_scaled_scores, scaling=_mul_scale))),
    AttentionPattern(
        "eager_sinks", families="gpt-oss, MiMo-V2-Flash's sliding layers (eager_attention_forward: softmax over "
        "cat([matmul(q, k^T) * scaling + mask, sinks], -1) less its row max, the sink column dropped)",
        implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_with_sinks, partial(_scaled_scores, scaling=_mul_scale)))),
    AttentionPattern(
        "eager_row_max", families="MiMo-V2-Flash's full-attention layers (eager_attention_forward without sinks: "
        "softmax(matmul(q, k^T) * scaling + mask less its row max))", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_row_max_shifted, partial(_scaled_scores, scaling=_mul_scale)))),
    AttentionPattern(
        "eager_soft_cap", families="Gemma 2 (eager_attention_forward with attn_logit_softcapping: "
        "cap * tanh(matmul(q, k^T) * scaling / cap))", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_scaled_scores, scaling=_mul_scale, soft_cap=True))),
    AttentionPattern(
        "eager_div_scale", families="Falcon (scores /= sqrt(head_dim)); BERT-era self-attention: BigBird, "
        "Canine, ConvBERT, CPM-Ant (matmul(q, k^T) / math.sqrt(head_size))", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_scaled_scores, scaling=_div_scale))),
    AttentionPattern(
        "eager_unscaled", families="T5-style attention, the scale folded into the query projection "
        "(matmul(q, k^T))", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=partial(_scaled_scores, scaling=_unscaled))),
    AttentionPattern(
        "eager_where_mask", families="GPT-Neo (GPTNeoSelfAttention: where(causal or local-window buffer, "
        "matmul(q, k^T), min) + mask, unscaled)", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scores_of=_where_scores)),
    AttentionPattern(
        "eager_baddbmm", families="BLOOM (BloomAttention: baddbmm(alibi, q, k^T, beta, alpha=inv_norm_factor) "
        "on [H, T, D] tensors, + mask; bmm(probs, v)); GPT-NeoX-Japanese (GPTNeoXJapaneseAttention._attn: "
        "baddbmm(zeros, q, k^T, alpha=1 / norm_factor) + mask; matmul(probs, v) on [1, H, T, D])",
        implementation="eager", anchors=SOFTMAX, match=partial(_eager_site, scores_of=_baddbmm_scores)),
    AttentionPattern(
        "eager_keep_mask", families="GPT-1 (openai-gpt, Attention._attn: matmul(q, k^T) / sqrt(head_dim) * b + "
        "-1e4 * (1 - b), b the causal buffer; k^T formed by split_heads' permute)", implementation="eager",
        anchors=SOFTMAX, match=partial(_eager_site, scores_of=_keep_masked_scores)),
    AttentionPattern(
        "eager_masked_fill", families="MPT (MptAttention: (matmul(q, k^T) * softmax_scale + position_bias)"
        ".masked_fill(mask, min)); XLM (MultiHeadAttention: matmul(q / sqrt(head_dim), k^T).masked_fill_(mask, "
        "min))", implementation="eager", anchors=SOFTMAX, match=partial(_eager_site, scores_of=_masked_fill_scores)),
    AttentionPattern(
        "eager_alibi_falcon", families="Falcon with alibi=True (FalconAttention: (matmul(q, k^T) + alibi) "
        "*= inv_norm_factor, + a mask that carries alibi / sqrt(head_dim) too)", implementation="eager",
        anchors=SOFTMAX, match=partial(_eager_site, scores_of=_falcon_alibi_scores)),
    AttentionPattern(
        "eager_einsum_bias", families="ProphetNet's main stream (ProphetNetNgramSelfAttention: "
        "einsum('bntc,bncs->bnts', q, k^T) + relative-position bias + mask, q scaled before; einsum(probs, v)): "
        "served if the bias is ALiBi",
        implementation="eager", anchors=SOFTMAX, match=partial(_eager_site, scores_of=_biased_scores)),
)
