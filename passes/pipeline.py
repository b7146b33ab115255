"""The pagedpack rewrite: a captured single-sequence graph -> a packed, paged step graph.

Rewritten signature (all metadata as graph inputs, DESIGN.md terms)::

    forward(input_ids [T] int64, positions [T] int64, cu_seqlens_q [B+1] int32,
            seq_lens [B] int32, block_table [B, max_blocks_per_seq] int32,
            slot_mapping [T] int64, logits_indices [B] int64,
            key_cache_0, value_cache_0, ..., key_cache_{L-1}, value_cache_{L-1})
        -> logits [B, vocab]

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and are written in place.
If any site cannot be rewritten safely, nothing is changed and the report says why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from pagedpack.models.capture import CapturedModel
from pagedpack.passes.attention_sites import find_attention_sites
from pagedpack.passes.cleanup import eliminate_dead_code, strip_export_checks
from pagedpack.passes.logits import gather_logits
from pagedpack.passes.paged_attention import rewrite_site
from pagedpack.passes.report import PassReport, op_counts
from pagedpack.passes.verify import CAUSAL, verify_sites

aten = torch.ops.aten
METADATA_INPUTS = ("input_ids", "positions", "cu_seqlens_q", "seq_lens", "block_table",
                   "slot_mapping", "logits_indices")
_VERIFY_NUM_TOKENS = 7


def cache_input_names(num_layers: int, suffix: str = "") -> list[str]:
    """``key_cache_0, value_cache_0, key_cache_1, ...`` (with ``suffix``: ``key_cache_out_0``, ...)."""
    return [f"{kind}_cache{suffix}_{i}" for i in range(num_layers) for kind in ("key", "value")]


class UnsupportedModelError(ValueError):
    """The pass refused at least one site; ``report`` says which and why."""

    def __init__(self, report: PassReport):
        super().__init__("pagedpack cannot rewrite this model:\n" + report.format())
        self.report = report


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one layer's cache pair, read off the captured K/V tensors."""

    num_kv_heads: int
    key_head_size: int
    value_head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V for one token in this layer."""
        return self.num_kv_heads * (self.key_head_size + self.value_head_size) * self.dtype.itemsize

    def cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(key_cache shape, value_cache shape)`` in the NHD block layout."""
        return ((num_blocks, block_size, self.num_kv_heads, self.key_head_size),
                (num_blocks, block_size, self.num_kv_heads, self.value_head_size))


@dataclass
class RewrittenModel:
    """Result of :func:`rewrite`: the step graph (or the untouched capture if refused) and its report."""

    graph_module: torch.fx.GraphModule
    report: PassReport
    kv_cache_specs: list[KVCacheSpec] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.report.num_found > 0 and not self.report.refused

    @property
    def input_names(self) -> list[str]:
        return [n.target for n in self.graph_module.graph.nodes if n.op == "placeholder"]

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token takes over all layers."""
        return sum(spec.bytes_per_token for spec in self.kv_cache_specs)

    def raise_if_refused(self) -> None:
        if not self.ok:
            raise UnsupportedModelError(self.report)


def rewrite(captured: CapturedModel) -> RewrittenModel:
    """Rewrite every attention site of ``captured`` (see the module docstring for the result)."""
    gm = captured.graph_module
    graph = gm.graph
    report = PassReport(ops_before=op_counts(graph))
    sites = find_attention_sites(graph)
    placeholders = {n.target: n for n in graph.nodes if n.op == "placeholder"}

    n = min(_VERIFY_NUM_TOKENS, captured.example_num_tokens)
    device = next(gm.parameters()).device
    sample = (torch.zeros(1, n, dtype=torch.long, device=device), torch.arange(n, device=device)[None])
    kinds, _ = verify_sites(gm, sites, sample, n, report)
    for record, kind in zip(report.sites, kinds):
        if kind not in (None, CAUSAL):
            record.rewritten = False
            record.reason = "bidirectional attention (no causal mask): the paged KV cache serves causal LMs"
    missing = [p for p in ("input_ids", "position_ids") if p not in placeholders]
    if missing:
        report.notes.append(f"captured graph lacks inputs {missing}")
        for record in report.sites:
            record.rewritten, record.reason = False, f"captured graph lacks inputs {missing}"
    if not sites or report.refused:
        report.ops_after = report.ops_before
        return RewrittenModel(gm, report)

    removed = strip_export_checks(gm)
    report.notes.append(f"removed {removed} export guard/assert nodes")
    meta = _add_inputs(graph, placeholders, num_layers=len(sites))
    specs = []
    for i, site in enumerate(sites):
        rewrite_site(graph, site, key_cache=meta[f"key_cache_{i}"], value_cache=meta[f"value_cache_{i}"],
                     metadata=meta)
        specs.append(_cache_spec(site))
    report.notes.append("logits gathered " + gather_logits(graph, meta["logits_indices"]))
    eliminate_dead_code(gm)
    graph.lint()
    gm.recompile()
    report.inputs_added = [n for n in meta if n != "input_ids"]  # positions replaces position_ids
    report.ops_after = op_counts(graph)
    return RewrittenModel(gm, report, specs)


def _add_inputs(graph: torch.fx.Graph, old: dict, *, num_layers: int) -> dict[str, torch.fx.Node]:
    """Metadata and cache placeholders; the captured ``input_ids``/``position_ids`` become the
    packed ``input_ids [T]``/``positions [T]`` (viewed as ``[1, T]`` for the unchanged code)."""
    meta = {"input_ids": old["input_ids"], "positions": old["position_ids"]}
    meta["positions"]._rename("positions")
    meta["positions"].target = "positions"
    names = [*METADATA_INPUTS[2:], *cache_input_names(num_layers)]
    last = meta["positions"] if meta["positions"].next.op != "placeholder" else list(old.values())[-1]
    for name in names:
        with graph.inserting_after(last):
            last = meta[name] = graph.placeholder(name)
    for name in ("input_ids", "positions"):
        with graph.inserting_after(last):
            last = batch_one = graph.call_function(aten.unsqueeze.default, (meta[name], 0))
        meta[name].replace_all_uses_with(batch_one, delete_user_cb=lambda user, keep=batch_one: user is not keep)
    return meta


def _cache_spec(site) -> KVCacheSpec:
    key, value = site.key_source.meta["val"], site.value_source.meta["val"]
    return KVCacheSpec(num_kv_heads=key.shape[1], key_head_size=key.shape[-1],
                       value_head_size=value.shape[-1], dtype=key.dtype)
