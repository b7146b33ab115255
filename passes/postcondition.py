"""The ``no_attention_left`` pass: the post-condition of a rewrite.

After the rewrite no ``aten.scaled_dot_product_attention`` and no softmax over an attention-shaped
score tensor may remain: either would attend over the whole packed step, across sequences. A
survivor is a refused site, so the model is refused and the manager puts the graph back as captured.
"""
from __future__ import annotations

import torch

from pagedpack.passes.attention_sites import SOFTMAX, is_call, layer_index
from pagedpack.passes.find import is_attention_shaped, token_sizes
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.report import SiteRecord

aten = torch.ops.aten


class NoAttentionLeft(Pass):
    """``no_attention_left``: refuse the model if attention survived the rewrite.

    Counts: matched = refused = surviving SDPA calls and attention-shaped softmaxes.
    """

    name = "no_attention_left"
    mutates = False

    def __call__(self, ctx: PassContext) -> PassResult:
        sizes = token_sizes(ctx.graph)
        left = [n for n in ctx.graph.nodes if is_call(n, aten.scaled_dot_product_attention.default)
                or (is_call(n, *SOFTMAX) and is_attention_shaped(n, sizes))]
        for node in left:
            form = "sdpa" if node.target is aten.scaled_dot_product_attention.default else "softmax"
            ctx.report.sites.append(SiteRecord(node.name, form, layer_index(node), reason=(
                f"{node.name} survived the rewrite (post-condition: no scaled_dot_product_attention and no "
                "attention-shaped softmax may remain)")))
        return PassResult(matched=len(left), refused=len(left))
