"""The ``no_attention_left`` pass: the post-condition of a rewrite.

After the rewrite no ``aten.scaled_dot_product_attention``, no softmax over an attention-shaped
score tensor and no one-sequence sparse-attention op of the capture (``indexer_topk``,
``sparse_attention``: :mod:`pagedpack.passes.sparse_attention`) may remain: each would attend or
select over the whole packed step, across sequences. A
survivor is a refused site, so the model is refused and the manager puts the graph back as captured.
"""
from __future__ import annotations

import torch

from pagedpack.passes.attention_sites import SOFTMAX, is_call, layer_index
from pagedpack.passes.find import is_attention_shaped, token_sizes
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.report import SiteRecord, op_name
from pagedpack.passes.sparse_attention import PROMPT_OPS

aten = torch.ops.aten


class NoAttentionLeft(Pass):
    """``no_attention_left``: refuse the model if attention survived the rewrite.

    Counts: matched = refused = surviving SDPA calls, attention-shaped softmaxes and capture-form DSA ops.
    """

    name = "no_attention_left"
    mutates = False

    def __call__(self, ctx: PassContext) -> PassResult:
        sizes = token_sizes(ctx.graph)
        left = [n for n in ctx.graph.nodes if is_call(n, aten.scaled_dot_product_attention.default, *PROMPT_OPS)
                or (is_call(n, *SOFTMAX) and is_attention_shaped(n, sizes))]
        for node in left:
            form = "softmax" if is_call(node, *SOFTMAX) else op_name(node.target)
            ctx.report.sites.append(SiteRecord(node.name, form, layer_index(node), reason=(
                f"{node.name} survived the rewrite (post-condition: no scaled_dot_product_attention, no "
                "attention-shaped softmax and no one-sequence sparse-attention op may remain)")))
        return PassResult(matched=len(left), refused=len(left))
