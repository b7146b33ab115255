"""Check on a sample input what the structural match of a site assumes.

A pattern match says *where* attention is; these checks confirm *what* it computes before the
site is rewritten: the mask is exactly the causal mask (or lets every key through), and
``repeat_kv`` maps query head ``h`` to KV head ``h // num_rep``. A site that fails is refused,
never approximated.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.fx import Node

from pagedpack.passes.attention_sites import AttentionSite
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.report import SiteRecord

CAUSAL, BIDIRECTIONAL = "causal", "bidirectional"


class _Recorder(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, wanted):
        super().__init__(module)
        self.wanted, self.values = wanted, {}

    def run_node(self, node):
        value = super().run_node(node)
        if self.wanted(node):
            self.values[node] = value
        return value


def sample_values(module: torch.fx.GraphModule, wanted, inputs: tuple) -> dict:
    """Run ``module`` on ``inputs`` and keep the values of the nodes for which ``wanted(node)``."""
    recorder = _Recorder(module, wanted)
    with torch.no_grad():
        recorder.run(*inputs)
    return recorder.values


class VerifyAttention(Pass):
    """``verify_attention``: check every site on ``ctx.sample_inputs`` and record it in the report.

    A site is refused for a structural problem found by its match, a failed check, or (with
    ``causal_only``) bidirectional attention. Fills ``ctx.records``, ``ctx.kinds`` (:data:`CAUSAL`,
    :data:`BIDIRECTIONAL`, or None if refused) and ``ctx.values`` (the sites' sampled tensors and
    those of the nodes for which ``also(node, ctx.num_tokens)``). Counts: matched = sites that pass,
    refused = sites refused.
    """

    name = "verify_attention"
    mutates = False

    def __init__(self, *, causal_only: bool, also: Callable[[Node, int], bool] = lambda node, num_tokens: False):
        self.causal_only, self.also = causal_only, also

    def __call__(self, ctx: PassContext) -> PassResult:
        site_nodes = {n for s in ctx.sites for n in s.sampled_nodes}
        ctx.values = sample_values(ctx.graph_module, lambda n: n in site_nodes or self.also(n, ctx.num_tokens),
                                   ctx.sample_inputs)
        for site in ctx.sites:
            kind, reason = (None, site.refusal) if site.refusal else classify_site(site, ctx.values, ctx.num_tokens)
            if kind == BIDIRECTIONAL and self.causal_only:
                kind, reason = None, "bidirectional attention (no causal mask): the paged KV cache serves causal LMs"
            ctx.kinds.append(kind)
            ctx.records.append(SiteRecord(site.name, site.form, site.layer, reason=reason))
        ctx.report.sites += ctx.records
        refused = ctx.kinds.count(None)
        return PassResult(matched=len(ctx.sites) - refused, refused=refused)


def classify_site(site: AttentionSite, values: dict, num_tokens: int) -> tuple[str | None, str | None]:
    """``(kind, None)`` with kind :data:`CAUSAL` or :data:`BIDIRECTIONAL`, or ``(None, refusal)``."""
    kind = CAUSAL if site.is_causal else BIDIRECTIONAL
    if site.mask is not None:
        kind, reason = _mask_kind(values[site.mask], num_tokens)
        if reason:
            return None, reason
    for name, seen, source in (("key", site.key, site.key_source), ("value", site.value, site.value_source)):
        src = values[source]
        if src.dim() != 4 or src.shape[0] != 1 or src.shape[2] != num_tokens:
            return None, (f"{name} before repeat has shape {tuple(src.shape)}, expected "
                          f"[1, kv_heads, T={num_tokens}, head_dim]")
        if not torch.equal(values[seen], src.repeat_interleave(site.num_rep, dim=1)):
            return None, (f"{name} is not the KV heads repeated {site.num_rep}x "
                          f"(query head h -> KV head h // {site.num_rep})")
    return kind, None


def _mask_kind(mask: torch.Tensor, n: int) -> tuple[str | None, str | None]:
    if mask.shape[-2:] != (n, n):
        return None, f"attention mask has shape {tuple(mask.shape)}, expected [..., {n}, {n}] at T={n}"
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        blocked = mask[~allowed]
        if blocked.numel() and bool((blocked > -1e4).any()):
            return None, "additive attention mask has entries that are neither 0 nor a large negative"
    if bool(allowed.all()):
        return BIDIRECTIONAL, None
    if bool((allowed == torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()).all()):
        return CAUSAL, None
    return None, f"attention mask is neither causal nor full (checked at T={n})"
