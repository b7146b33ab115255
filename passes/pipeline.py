"""The pagedpack rewrite: a captured single-sequence graph -> a packed, paged step graph.

Rewritten signature (all metadata as graph inputs, docs/design.md terms)::

    forward(input_ids [T] int64, positions [T] int64, cu_seqlens_q [B+1] int32,
            seq_lens [B] int32, block_table [B, max_blocks_per_seq] int32,
            slot_mapping [T] int64, logits_indices [B] int64,
            key_cache_0, value_cache_0, ..., key_cache_{C-1}, value_cache_{C-1}
            [, state_indices [B] int32, has_initial_state [B] bool, conv_state_0, ...])
        -> logits [B, vocab]

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and are written in place, one pair
per attention site that owns one (``C``: sites reading an earlier site's cache, :mod:`pagedpack.passes.kv_sharing`,
have none); a sparse-attention layer's take two pairs, its K/V and its indexer's keys
(:mod:`pagedpack.passes.sparse_attention`); the state inputs come with paged recurrent layers
(:mod:`pagedpack.passes.recurrent_state`).
The rewrite is :data:`STEP_PIPELINE`, run by :class:`~pagedpack.passes.manager.PassManager`. If any
site cannot be rewritten safely, nothing is changed and the report says why.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from pagedpack.models.capture import CapturedModel
from pagedpack.passes.cleanup import EliminateDeadCode, StripExportChecks
from pagedpack.passes.find import FindAttention
from pagedpack.passes.independence import SequenceIndependence
from pagedpack.passes.kv_sharing import ShareKVCache
from pagedpack.passes.linear_merge import MergeLinears
from pagedpack.passes.logits import GatherLogits
from pagedpack.passes.manager import Pass, PassContext, PassManager, PassResult
from pagedpack.passes.paged_attention import PagedAttention
from pagedpack.passes.positions import PositionsInput, maybe_positions
from pagedpack.passes.postcondition import NoAttentionLeft
from pagedpack.passes.recurrent import RecurrentLayers
from pagedpack.passes.recurrent_state import PagedRecurrentState
from pagedpack.passes.report import PassReport
from pagedpack.passes.sparse_attention import PagedSparseAttention
from pagedpack.passes.verify import VerifyAttention
from pagedpack.step.contract import (
    METADATA_INPUTS,
    KVCacheSpec,
    LoRASpec,
    StateSpec,
    UnsupportedModelError,
    bytes_per_token,
    cache_input_names,
)

aten = torch.ops.aten
_VERIFY_NUM_TOKENS = 7


@dataclass
class RewrittenModel:
    """Result of :func:`rewrite`: the step graph (or the untouched capture if refused) and its report.

    A :class:`pagedpack.step.contract.StepProgram` once :attr:`ok`."""

    graph_module: torch.fx.GraphModule
    report: PassReport
    kv_cache_specs: list[KVCacheSpec] = field(default_factory=list)
    state_specs: list[StateSpec] = field(default_factory=list)  # recurrent states, after the KV caches
    lora_specs: list[LoRASpec] = field(default_factory=list)  # LoRA-augmented linears (passes/lora.py), last

    @property
    def ok(self) -> bool:
        return self.report.ok

    @property
    def input_names(self) -> list[str]:
        return [n.target for n in self.graph_module.graph.nodes if n.op == "placeholder"]

    functional = False  # a StepProgram that writes the caches in place

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token takes over all owned caches."""
        return bytes_per_token(self.kv_cache_specs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run one step (:mod:`pagedpack.step.contract`); refused models have no step signature."""
        return self.graph_module(*inputs)

    def raise_if_refused(self) -> None:
        if not self.ok:
            raise UnsupportedModelError(self.report.format(), self.report)


class AddStepInputs(Pass):
    """``step_inputs``: the step's metadata and cache inputs (module docstring); the captured
    ``input_ids``/``position_ids`` become the packed ``input_ids [T]``/``positions [T]`` (viewed as
    ``[1, T]`` for the unchanged code), one cache pair per site that owns a cache (``ctx.cache_owners``).
    Fills ``ctx.inputs``. Refuses every site if the captured
    graph lacks those inputs. Counts: matched = rewritten = inputs added or renamed."""

    name = "step_inputs"
    requires = ("sites", "records", "cache_owners")
    provides = ("inputs",)

    def __call__(self, ctx: PassContext) -> PassResult:
        graph, report = ctx.graph, ctx.report
        old = {n.target: n for n in graph.nodes if n.op == "placeholder"}
        missing = [p for p in ("input_ids", "position_ids") if p not in old]
        if missing:
            report.notes.append(f"captured graph lacks inputs {missing}")
            for record in ctx.records:
                record.reason = f"captured graph lacks inputs {missing}"
            return PassResult(refused=len(ctx.records))
        ctx.inputs = meta = {"input_ids": old["input_ids"], "positions": old["position_ids"]}
        meta["positions"]._rename("positions")
        meta["positions"].target = "positions"
        names = [*METADATA_INPUTS[2:], *cache_input_names(len(set(ctx.cache_owners)))]
        last = meta["positions"] if meta["positions"].next.op != "placeholder" else list(old.values())[-1]
        for name in names:
            with graph.inserting_after(last):
                last = meta[name] = graph.placeholder(name)
        for name in ("input_ids", "positions"):
            with graph.inserting_after(last):
                last = batch_one = graph.call_function(aten.unsqueeze.default, (meta[name], 0))
            meta[name].replace_all_uses_with(batch_one, delete_user_cb=lambda user, keep=batch_one: user is not keep)
        report.inputs_added = [n for n in meta if n != "input_ids"]  # positions replaces position_ids
        return PassResult(matched=len(report.inputs_added), rewritten=len(report.inputs_added))


STEP_PIPELINE: tuple[Pass, ...] = (
    RecurrentLayers(paged=True), FindAttention(), VerifyAttention(causal_only=True, also=maybe_positions),
    StripExportChecks(), ShareKVCache(), AddStepInputs(), PositionsInput(), PagedAttention(), PagedSparseAttention(),
    PagedRecurrentState(), GatherLogits(), EliminateDeadCode(), NoAttentionLeft(),
    MergeLinears(), SequenceIndependence(),
)


# Where user passes go by default: after the paged rewrite and the merged linears, before the check
# that the packed step keeps its sequences apart (which so checks them too).
EXTRA_PASSES_AFTER = "merge_linears"


def step_pipeline(extra_passes: Sequence[Pass] = (), after: str = EXTRA_PASSES_AFTER) -> tuple[Pass, ...]:
    """:data:`STEP_PIPELINE` with ``extra_passes`` (user passes, :class:`~pagedpack.passes.manager.Pass`
    instances) inserted after the pass named ``after``; ``ValueError`` for an unknown name."""
    names = [p.name for p in STEP_PIPELINE]
    if after not in names:
        raise ValueError(f"after: expected the name of a pass of the step pipeline {names}, got {after!r}")
    index = names.index(after) + 1
    return (*STEP_PIPELINE[:index], *extra_passes, *STEP_PIPELINE[index:])


def rewrite(captured: CapturedModel, extra_passes: Sequence[Pass] = (), after: str = EXTRA_PASSES_AFTER
            ) -> RewrittenModel:
    """Rewrite every attention site of ``captured`` with :data:`STEP_PIPELINE`, plus ``extra_passes``
    after the pass ``after`` (:func:`step_pipeline`; the manager checks their ``requires``); see the
    module docstring for the result. A refused model comes back untouched, its report saying why.
    ``ValueError`` for an unknown ``after`` or a pipeline whose order is wrong."""
    manager = PassManager(step_pipeline(extra_passes, after))
    gm = captured.graph_module
    n = min(_VERIFY_NUM_TOKENS, captured.example_num_tokens)
    ctx = PassContext(gm, PassReport(), captured.sample(n), n,
                      reference=torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)),
                      make_sample=captured.sample, window_hint=captured.window_hint)
    done = manager.run(ctx)
    return RewrittenModel(gm, ctx.report, ctx.kv_cache_specs if done else [], ctx.state_specs if done else [])
