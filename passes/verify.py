"""Check on a sample input what the structural match of a site assumes.

A pattern match says *where* attention is; these checks confirm *what* it computes before the
site is rewritten: the mask is exactly the causal mask (or lets every key through), and
``repeat_kv`` maps query head ``h`` to KV head ``h // num_rep``. A site that fails is refused,
never approximated.
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.passes.attention_sites import AttentionSite
from pagedpack.passes.report import PassReport, SiteRecord

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


def verify_sites(module: torch.fx.GraphModule, sites: list[AttentionSite], sample_inputs: tuple,
                 num_tokens: int, report: PassReport, also=lambda node: False) -> tuple[list, dict]:
    """Run ``sample_inputs`` (one sequence of ``num_tokens``) once, classify every site and record
    it in ``report``. Returns each site's kind (None if refused) and the sampled values (the
    sites' tensors and those of the nodes for which ``also(node)``)."""
    site_nodes = {n for s in sites for n in (s.mask, s.key, s.value, s.key_source, s.value_source)}
    values = sample_values(module, lambda n: n in site_nodes or also(n), sample_inputs) if sites else {}
    kinds = []
    for site in sites:
        kind, reason = classify_site(site, values, num_tokens) if site.refusal is None else (None, site.refusal)
        kinds.append(kind)
        report.sites.append(SiteRecord(site.name, site.form, site.layer, reason is None, reason))
    if not sites:
        report.notes.append("no attention site found")
    return kinds, values


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
            return None, f"{name} is not the KV heads repeated {site.num_rep}x (query head h -> KV head h // {site.num_rep})"
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
