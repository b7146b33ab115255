"""Layers that keep a recurrent state from step to step, and which of them pagedpack serves.

State-space layers (Mamba / Mamba2 mixers and the hybrids built on them: Jamba, Bamba, Zamba2,
Nemotron-H, Falcon-H1, Granite-MoE-hybrid), linear / lightning attention and gated delta nets
(MiniMax, Qwen3-Next, Kimi-Linear), short convolutions (LFM2), RG-LRU blocks (RecurrentGemma) and
RWKV keep a per-sequence state that each step carries to the next. They are known by their class
names in transformers' modeling code. pagedpack pages the state of the layers in
:data:`PAGED_RECURRENT_CLASS` (a state slot per sequence, :mod:`pagedpack.passes.recurrent_state`):
short convolutions (LFM2), whose only sequence mixing is a causal depthwise conv; gated DeltaNets
(Qwen3-Next, Qwen3.5, OLMo-Hybrid) and Kimi Delta Attention: a causal conv and the gated delta rule;
Mamba and Mamba2 mixers (and the hybrids built on them): a causal conv and the selective scan / SSD;
MiniMax's lightning attention: a linear attention with a decay per head; the scans captured through
transformers' kernel seams (:mod:`pagedpack.models.seams`). The others (RG-LRU, RWKV, xLSTM) are
refused by name, as are DeepSeek-V4's KV compressors, whose open window is a state of the same kind.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

# (KimiLinearAttention is Kimi-Linear's full-attention (MLA) layer, despite its name)
RECURRENT_CLASS = re.compile(r"(Mixer|MambaLayer|(?<!^Kimi)LinearAttention|DeltaAttention|LightningAttention|DeltaNet"
                             r"|ShortConv|RecurrentBlock|Rglru|RgLru|RwkvSelfAttention|LSTM|xLSTMLayer|Compressor)$")
# DeepSeek-V4's KV compressors (DeepseekV4HCACompressor, DeepseekV4CSACompressor): each window of
# ``compress_rate`` tokens pooled into one KV entry, a sequence's open window carried to its next call
_COMPRESSOR = re.compile(r"Compressor$")


# the recurrent layers whose state pagedpack pages, by class-name ending, with the sites each holds
# (passes/recurrent_state.py: a causal conv1d and the scan the capture's seam records, models/seams.py)
PAGED_LAYERS = {"ShortConv": ("conv1d",), "GatedDeltaNet": ("conv1d", "gated_delta_rule"),
                "DeltaAttention": ("conv1d", "gated_delta_rule"),
                "Glm5NextTextLinearAttention": ("conv1d", "gated_delta_rule"),
                "Mixer": ("conv1d", "selective_scan"), "MambaLayer": ("conv1d", "selective_scan"),
                "MiniMaxLightningAttention": ("lightning_attention",)}
PAGED_RECURRENT_CLASS = re.compile(f"({'|'.join(PAGED_LAYERS)})$")


def first_recurrent(modules: Iterable[tuple[str, object]], *, paged: bool = False) -> tuple[str, str] | None:
    """``(path, class name)`` of the first of ``modules`` (``(path, class or qualified class
    name)`` pairs, outer modules first) whose class is one of :data:`RECURRENT_CLASS` and holds no
    other such module (the layer, not ``MambaModel`` around it), or None. With ``paged``, the
    layers of :data:`PAGED_RECURRENT_CLASS` are left out (their state is paged)."""
    found = {}
    for path, kind in modules:
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        if RECURRENT_CLASS.search(cls) and not (paged and PAGED_RECURRENT_CLASS.search(cls)):
            found.setdefault(path, cls)
    inner = [p for p in found if not any(q.startswith(f"{p}.") or (not p and q) for q in found)]
    return (inner[0], found[inner[0]]) if inner else None


def recurrent_refusal(path: str, cls: str) -> str:
    """Why a model with the recurrent layer ``path`` (of class ``cls``) is refused, in one line."""
    if _COMPRESSOR.search(cls):
        return (f"a compressed-attention layer ({path or 'the model'}: {cls}) keeps a state pagedpack does not page "
                "yet: the tokens of each sequence's open compression window and the KV entries pooled from its "
                "closed ones, which its attention reads beside a sliding window")
    where = f"a recurrent layer ({path or 'the model'}: {cls}) keeps a state"
    if PAGED_RECURRENT_CLASS.search(cls):  # refused where no state is paged: the torch.compile backend
        return (f"{where}: the torch.compile backend does not page it (Dynamo captures outside pagedpack's kernel "
                "seams); LLM and serve do")
    return (f"{where} of a form pagedpack does not page yet (no seam for its kernels; it pages short convs, gated "
            "delta rules, Mamba scans and lightning attention)")


def paged_layer(node) -> tuple[str, str] | None:
    """``(path, class name)`` of the innermost paged recurrent layer an FX ``node`` was traced in (its
    ``nn_module_stack``), or None."""
    for path, kind in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        if PAGED_RECURRENT_CLASS.search(cls):
            return path.removeprefix("model."), cls
    return None
