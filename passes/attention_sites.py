"""Find the attention sites of a captured graph with the table of attention patterns.

:data:`ATTENTION_PATTERNS` names each form ``transformers`` emits under ``torch.export``, with the
model families it comes from and the attention implementation:
- ``sdpa``: ``aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=,
  enable_gqa=)``;
- ``eager_*``: ``matmul(q, k^T) -> [mul or div by a constant] -> [add mask] -> softmax(-1) ->
  [casts, dropout] -> matmul(., v)``.
In all, K and V may come through ``repeat_kv`` (``unsqueeze(2) -> expand -> reshape``); the site
records the pre-repeat tensors, which are what the paged KV cache stores.
Structural problems are recorded as a refusal reason on the site; nothing is changed here.
"""
from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.fx import Node

aten = torch.ops.aten
SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
PASS_THROUGH = frozenset({aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.alias.default,
                          aten.clone.default, aten.contiguous.default})
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


@dataclass
class AttentionSite:
    """One attention computation in the graph (all tensors ``[1, heads, T, head_dim]``)."""

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

    @property
    def sampled_nodes(self) -> tuple[Node | None, ...]:
        """The nodes whose values on a sample the verification checks (``mask`` may be None)."""
        return self.mask, self.key, self.value, self.key_source, self.value_source


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
    site = AttentionSite(
        name=node.name, form="sdpa", layer=layer_index(node), output=node,
        query=a["query"], key=a["key"], value=a["value"], key_source=key_src, value_source=value_src,
        num_rep=k_rep, mask=a["attn_mask"], is_causal=bool(a["is_causal"]),
        scale=node.kwargs.get("scale"),
    )
    if a["dropout_p"] != 0.0:
        site.refusal = f"dropout_p={a['dropout_p']} (attention dropout is active; put the model in eval mode)"
    elif k_rep != v_rep:
        site.refusal = f"K and V are repeated differently ({k_rep} vs {v_rep})"
    return site


def _eager_site(softmax: Node, scaling: Callable[[Node], tuple[Node, float] | None]) -> AttentionSite | None:
    """Match ``matmul(q, k^T) [scaling] [+ mask] -> softmax -> ... -> matmul(., v)``; None if no match.

    ``scaling(x)`` is ``(scores, scale)`` if ``x`` is the scores scaled that way, else None.
    """
    if softmax.args[1] not in (-1, 3):
        return None
    x, mask = softmax.args[0], None
    if is_call(x, aten.add.Tensor) and isinstance(x.args[1], Node):
        x, mask = x.args[0], x.args[1]
    scaled = scaling(x)
    if scaled is None:
        return None
    x, scale = scaled
    if not is_call(x, aten.matmul.default):
        return None
    query, key_t = x.args
    if not is_key_transpose(key_t):
        return None
    probs = _single_user_chain(softmax)
    if probs is None:
        return None
    out = next(iter(probs.users)) if len(probs.users) == 1 else None
    if out is None or not is_call(out, aten.matmul.default) or out.args[0] is not probs:
        return None
    key, value = key_t.args[0], out.args[1]
    key_src, k_rep = unrepeat_kv(key)
    value_src, v_rep = unrepeat_kv(value)
    site = AttentionSite(
        name=out.name, form="eager", layer=layer_index(out), output=out,
        query=query, key=key, value=value, key_source=key_src, value_source=value_src,
        num_rep=k_rep, mask=mask, is_causal=False, scale=scale,
    )
    if probs is not softmax and _has_active_dropout(softmax, probs):
        site.refusal = "attention dropout is active (put the model in eval mode)"
    elif k_rep != v_rep:
        site.refusal = f"K and V are repeated differently ({k_rep} vs {v_rep})"
    return site


def _mul_scale(x: Node) -> tuple[Node, float] | None:
    """``scores * s``, ``s`` a constant."""
    if is_call(x, aten.mul.Tensor, aten.mul.Scalar) and isinstance(x.args[1], (int, float)):
        return x.args[0], float(x.args[1])
    return None


def _div_scale(x: Node) -> tuple[Node, float] | None:
    """``scores / d``, ``d`` a constant."""
    if is_call(x, aten.div.Tensor, aten.div.Scalar) and isinstance(x.args[1], (int, float)):
        return x.args[0], 1.0 / float(x.args[1])
    return None


def _unscaled(x: Node) -> tuple[Node, float]:
    return x, 1.0


def is_key_transpose(node) -> bool:
    """``k.transpose(-2, -1)`` of a 4-D ``k`` (the ``k^T`` of ``q @ k^T``)."""
    return is_call(node, aten.transpose.int) and sorted(d % 4 for d in node.args[1:]) == [2, 3]


def _single_user_chain(node: Node) -> Node | None:
    """Follow casts and inactive dropout from the softmax to the node feeding ``@ v``."""
    while True:
        users = [u for u in node.users if not is_call(u, aten._assert_tensor_metadata.default)]
        if len(users) != 1:
            return node
        user = users[0]
        if user.target in PASS_THROUGH or is_call(user, aten.dropout.default):
            node = user
        else:
            return node


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
        "sdpa", families="every transformers model under attn_implementation='sdpa' (sdpa_attention_forward)",
        implementation="sdpa", anchors=frozenset({aten.scaled_dot_product_attention.default}), match=_sdpa_site),
    AttentionPattern(
        "eager_mul_scale", families="Llama, Mistral, Qwen2 and every model sharing their eager_attention_forward "
        "(matmul(q, k^T) * scaling)", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scaling=_mul_scale)),
    AttentionPattern(
        "eager_div_scale", families="BERT-era self-attention: BigBird, Canine, ConvBERT, CPM-Ant "
        "(matmul(q, k^T) / math.sqrt(head_size))", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scaling=_div_scale)),
    AttentionPattern(
        "eager_unscaled", families="T5-style attention, the scale folded into the query projection "
        "(matmul(q, k^T))", implementation="eager", anchors=SOFTMAX,
        match=partial(_eager_site, scaling=_unscaled)),
)
