"""Runs the rewritten step graph over the paged KV caches it owns."""
from __future__ import annotations

from typing import Callable

import torch

from pagedpack.passes.pipeline import METADATA_INPUTS, RewrittenModel
from pagedpack.runtime.batch import BatchMetadata


class ModelRunner:
    """The step graph plus its per-layer KV caches.

    Caches are allocated once, ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer
    for K and for V, with the dtype and head shape the rewrite read off the captured graph.
    ``rewritten`` may also be a loaded export (:class:`pagedpack.export.ExportedStep`, same
    ``graph_module`` / ``kv_cache_specs``): a ``.pt2`` program updates the caches in place too;
    a functional one (ONNX) returns ``(logits, *updated caches)``, which replace the caches.
    """

    def __init__(self, rewritten: RewrittenModel, *, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", step: Callable | None = None):
        rewritten.raise_if_refused()
        # What runs a step: the step graph, or a compiled form of it (the ascend target on an NPU).
        self.graph_module = step or rewritten.graph_module
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.kv_caches: list[torch.Tensor] = []
        for spec in rewritten.kv_cache_specs:
            for shape in spec.cache_shapes(num_blocks, block_size):
                self.kv_caches.append(torch.zeros(shape, dtype=spec.dtype, device=self.device))
        self.kv_cache_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)

    @torch.inference_mode()
    def execute(self, batch: BatchMetadata) -> torch.Tensor:
        """Run one step; returns ``logits [B, vocab]`` (one row per sequence: its last token)."""
        inputs = batch.as_inputs()
        out = self.graph_module(*(inputs[name] for name in METADATA_INPUTS), *self.kv_caches)
        if isinstance(out, tuple):  # a functional program: this step's caches come back
            out, *self.kv_caches = out
        return out
