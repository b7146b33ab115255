"""Sparse-attention (DSA) layers: a lightning indexer picks each query's top-k keys, and which of them
pagedpack pages.

DeepSeek-V3.2's indexer and the models built after it (GLM-MoE-DSA, DeepSeek-V4, HY-V4, Dots3, AXK2,
Mistral-Large-4, MiniMax-M3, Qwen4-Exp, ...) are ``...Indexer`` modules in transformers' modeling code.
Their top-k is folded into the attention mask, which is causal as long as a prompt is no longer than the
top-k: served as dense attention such a model is exact up to there and wrong past it. pagedpack pages the
indexers of :data:`PAGED_INDEXERS` (their layers captured through :mod:`pagedpack.models.seams`, rewritten
by :mod:`pagedpack.passes.sparse_attention`) and refuses the others by name before export.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

INDEXER_CLASS = re.compile(r"Indexer$")
# the indexers pagedpack pages, by class name, with the rotary embedding function of their modeling module
# (DeepSeek-V3.2's indexer rotates half-split, unlike its MLA; GLM-MoE-DSA's interleaved)
PAGED_INDEXERS = {"DeepseekV32Indexer": "apply_rotary_pos_emb", "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave"}


def first_indexer(modules: Iterable[tuple[str, object]], *, paged: bool = False) -> tuple[str, str] | None:
    """``(path, class name)`` of the first of ``modules`` (``(path, class or qualified class name)``
    pairs) whose class is an indexer (:data:`INDEXER_CLASS`), or None; with ``paged``, those of
    :data:`PAGED_INDEXERS` are left out."""
    for path, kind in modules:
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        if INDEXER_CLASS.search(cls) and not (paged and cls in PAGED_INDEXERS):
            return path, cls
    return None


def indexer_refusal(path: str, cls: str) -> str:
    """Why a model with the indexer ``path`` (of class ``cls``) is refused, in one line."""
    where = f"a sparse-attention indexer ({path}: {cls}) selects each query's top-k keys"
    if cls in PAGED_INDEXERS:  # refused where it is not paged: the torch.compile backend
        return (f"{where}: the torch.compile backend does not page it (Dynamo captures outside pagedpack's seams); "
                "LLM and serve do")
    return (f"{where} in a form pagedpack does not page yet (it pages DeepSeek-V3.2's and GLM-MoE-DSA's); served as "
            "dense attention, it would be wrong past its top-k")
