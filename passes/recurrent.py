"""The ``recurrent_layers`` pass: refuse models whose layers carry a recurrent state.

State-space layers (Mamba / Mamba2 mixers and the hybrids built on them: Jamba, Bamba, Zamba2,
Nemotron-H, Falcon-H1, Granite-MoE-hybrid), linear / lightning attention and gated delta nets
(MiniMax, Qwen3-Next, Kimi-Linear), short convolutions (LFM2) and RG-LRU blocks (RecurrentGemma)
keep a per-sequence state that a step carries to the next. pagedpack pages the KV of attention
only: such a state would have to be paged too, so these models are refused by name up front,
instead of by the sample check of ``sequence_independence`` (whose packed run they fail).
The layers are read off the module each node was traced in (``node.meta["nn_module_stack"]``).
"""
from __future__ import annotations

import re

from pagedpack.passes.manager import Pass, PassContext, PassResult

# Class names (transformers' modeling code) of layers that keep a recurrent state.
RECURRENT_CLASS = re.compile(r"Mamba|Mixer$|Ssm|SSM|LinearAttention|LightningAttention|DeltaNet|ShortConv"
                             r"|RecurrentBlock|Rglru|RgLru|Rwkv|RWKV")


class RecurrentLayers(Pass):
    """``recurrent_layers``: refuse the model if a node was traced inside a recurrent-state layer
    (:data:`RECURRENT_CLASS`); the note names the first such module and its class.

    Counts: matched = refused = 1 on such a model."""

    name = "recurrent_layers"
    mutates = False

    def __call__(self, ctx: PassContext) -> PassResult:
        found = recurrent_module(ctx.graph_module.graph.nodes)
        if found is None:
            return PassResult()
        path, cls = found
        ctx.report.notes.append(
            f"state-space / linear-attention layers ({path or 'the model'}: {cls}) keep a recurrent state "
            "from step to step: pagedpack pages attention KV only; hybrid and state-space models are not "
            "supported yet")
        return PassResult(matched=1, refused=1)


def recurrent_module(nodes) -> tuple[str, str] | None:
    """``(module path, class name)`` of the first module of :data:`RECURRENT_CLASS` that one of
    ``nodes`` was traced in, or None."""
    for node in nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            cls = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
            if RECURRENT_CLASS.search(cls):
                return path.removeprefix("model."), cls
    return None
