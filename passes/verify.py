"""Check on a sample input what the structural match of a site assumes.

A pattern match says *where* attention is; these checks confirm *what* it computes before the
site is rewritten: the mask is exactly the causal mask, and ``repeat_kv`` maps query head ``h``
to KV head ``h // num_rep``. A site that fails is refused, never approximated.
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.passes.attention_sites import AttentionSite


class _Recorder(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, wanted: set[torch.fx.Node]):
        super().__init__(module)
        self.wanted, self.values = wanted, {}

    def run_node(self, node):
        value = super().run_node(node)
        if node in self.wanted:
            self.values[node] = value
        return value


def sample_values(module: torch.fx.GraphModule, nodes, num_tokens: int) -> dict:
    """Run ``module`` (the captured graph) on one sequence of ``num_tokens`` and keep ``nodes``' values."""
    device = next(iter(module.parameters())).device
    input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
    position_ids = torch.arange(num_tokens, device=device)[None]
    recorder = _Recorder(module, {n for n in nodes if n is not None})
    with torch.no_grad():
        recorder.run(input_ids, position_ids)
    return recorder.values


def verify_site(site: AttentionSite, values: dict, num_tokens: int) -> str | None:
    """The refusal reason for ``site`` given sampled ``values``, or None if it is safe to rewrite."""
    if site.mask is None and not site.is_causal:
        return "no mask and is_causal=False: bidirectional attention, not causal"
    if site.mask is not None:
        reason = _mask_reason(values[site.mask], num_tokens)
        if reason:
            return reason
    for name, seen, source in (("key", site.key, site.key_source), ("value", site.value, site.value_source)):
        src = values[source]
        if src.dim() != 4 or src.shape[0] != 1 or src.shape[2] != num_tokens:
            return f"{name} before repeat has shape {tuple(src.shape)}, expected [1, kv_heads, T={num_tokens}, head_dim]"
        if not torch.equal(values[seen], src.repeat_interleave(site.num_rep, dim=1)):
            return f"{name} is not the KV heads repeated {site.num_rep}x (query head h -> KV head h // {site.num_rep})"
    return None


def _mask_reason(mask: torch.Tensor, n: int) -> str | None:
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    if mask.shape[-2:] != (n, n):
        return f"attention mask has shape {tuple(mask.shape)}, expected [..., {n}, {n}] at T={n}"
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        blocked = mask[~allowed]
        if blocked.numel() and bool((blocked > -1e4).any()):
            return "additive attention mask has entries that are neither 0 nor a large negative"
    if not bool((allowed == causal).all()):
        return f"attention mask is not the causal mask (checked at T={n})"
    return None
