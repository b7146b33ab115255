"""Compiler-style tests of the rewrite: which ops exist before and after, and what is refused."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedpack.models.capture import capture
from pagedpack.models.tiny import FAMILIES, tiny_model
from pagedpack.passes.attention_sites import find_attention_sites
from pagedpack.passes.pipeline import METADATA_INPUTS, UnsupportedModelError, rewrite

aten = torch.ops.aten
ATTENTION_OPS = {aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default,
                 aten._safe_softmax.default, aten.matmul.default, aten.bmm.default}


def _mask_only_nodes(graph) -> set[str]:
    """Names of the nodes whose every use ends in an attention mask argument."""
    masks = {s.mask for s in find_attention_sites(graph) if s.mask is not None}
    only = set(masks)
    for node in reversed(list(graph.nodes)):
        if node in only or node.op == "placeholder" or not node.users:
            continue
        if all(u in only for u in node.users):
            only.add(node)
    return {n.name for n in only}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rewrite_ops_before_and_after(family, attn):
    model = tiny_model(family, attn_implementation=attn, num_hidden_layers=3)
    captured = capture(model)
    mask_nodes = _mask_only_nodes(captured.graph_module.graph)
    assert mask_nodes, "the captured graph should build a mask"

    result = rewrite(captured)
    report, graph = result.report, result.graph_module.graph
    assert result.ok, report.format()
    assert report.num_found == report.num_rewritten == model.config.num_hidden_layers
    assert [s.layer for s in report.sites] == list(range(model.config.num_hidden_layers))

    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    assert not targets & ATTENTION_OPS
    assert report.ops_after["pagedpack.paged_attention.default"] == model.config.num_hidden_layers
    assert report.ops_after["pagedpack.reshape_and_cache.default"] == model.config.num_hidden_layers
    assert not mask_nodes & {n.name for n in graph.nodes}, "mask-building ops survived"
    assert not any(n.op == "call_module" for n in graph.nodes)

    # The cache holds the KV heads before repeat_kv, not the repeated ones.
    assert all(spec.num_kv_heads == model.config.num_key_value_heads for spec in result.kv_cache_specs)
    caches = [f"{kind}_cache_{i}" for i in range(model.config.num_hidden_layers) for kind in ("key", "value")]
    assert result.input_names == list(METADATA_INPUTS) + caches
    assert report.inputs_added == list(METADATA_INPUTS[1:]) + caches


def test_cache_spec_comes_from_the_graph():
    model = tiny_model("qwen2", num_attention_heads=8, num_key_value_heads=2, hidden_size=128,
                       dtype=torch.bfloat16)
    result = rewrite(capture(model))
    spec = result.kv_cache_specs[0]
    assert (spec.num_kv_heads, spec.key_head_size, spec.value_head_size, spec.dtype) == (2, 16, 16, torch.bfloat16)
    assert result.bytes_per_token == 2 * (2 * 2 * 16 * 2)  # layers * (K+V) * heads * head_dim * bytes


class _Bidirectional(torch.nn.Module):
    """SDPA with no mask and is_causal=False: an encoder-style site, not causal."""

    def __init__(self, dilated_mask: bool):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.dilated_mask = dilated_mask

    def forward(self, input_ids, position_ids, use_cache=False):
        x = torch.nn.functional.one_hot(input_ids, 16).float()
        q, k, v = self.proj(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = None
        if self.dilated_mask:  # every other earlier key: neither causal, nor a window, nor full
            i = torch.arange(q.shape[2])
            mask = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :]) % 2 == 0)
        return SimpleNamespace(logits=F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1))


@pytest.mark.parametrize("dilated, reason", [(False, "bidirectional"),
                                             (True, "neither causal, causal within a window or within chunks")])
def test_unsafe_sites_are_refused_and_left_unchanged(dilated, reason):
    captured = capture(_Bidirectional(dilated))
    before = captured.graph_module.code
    result = rewrite(captured)
    assert not result.ok
    assert reason in result.report.sites[0].reason
    assert result.graph_module.code == before
    with pytest.raises(UnsupportedModelError, match=reason):
        result.raise_if_refused()


def test_active_dropout_is_refused():
    model = tiny_model("llama", attn_implementation="eager", attention_dropout=0.5)
    model.train()
    report = rewrite(capture(model)).report
    assert report.refused and all("dropout" in s.reason for s in report.refused)
