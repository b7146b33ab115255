"""The ``reference`` target: the rewritten graph as the passes left it, lowered on the CPU to
prepacked oneDNN linears and direct native kernel calls (:mod:`pagedpack.lowering.reference.cpu`);
it writes and serves ``.pt2`` exports (:mod:`.pt2`) and tensor-parallel manifests of them (:mod:`.tp`),
lowered the same way."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedpack.lowering.reference import pt2, tp
from pagedpack.lowering.reference.cpu import cpu_step
from pagedpack.lowering.targets import RECURRENT_OPS, FileFormat, StepBounds, Target, TargetOptions
from pagedpack.step.contract import LoweredStep


@dataclass
class ReferenceTarget(Target):
    """The project's ops, run as the rewrite left them (any device PyTorch runs); on the CPU the
    linears of a copy run on prepacked oneDNN weights (:meth:`lower`)."""

    name: str = "reference"
    description: str = ("the project's ops (pagedpack::reshape_and_cache, paged_attention), any device; native CPU "
                        "kernels on CPU")
    serves_pt2: bool = True
    formats: tuple[FileFormat, ...] = (pt2.FORMAT, tp.MANIFEST)
    supports_tensor_parallel: bool = True
    recurrent_ops: frozenset[str] = frozenset(RECURRENT_OPS)
    sparse_attention: bool = True
    supports_lora: bool = True

    def check_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
        """Every ``kv_cache_dtype``: the ops round keys and values to a floating cache's dtype, or quantize
        them into a scaled one, as they write them, and compute attention in fp32 from whatever the cache
        holds (:mod:`pagedpack.kernels.ops`); the CPU lowering drops a loaded program's input guards."""

    def lower(self, rewritten, options: TargetOptions, *, block_size: int, bounds: StepBounds,
              device: torch.device | str) -> LoweredStep:
        """``rewritten`` as it is, except on the CPU: there a copy of its graph with prepacked
        oneDNN linears and direct native kernel calls; the rewritten graph itself, which
        ``LLM.export`` writes, stays as it is."""
        program, note = cpu_step(rewritten.graph_module, rewritten.kv_cache_specs, device, bounds.max_model_len,
                                 rewritten.state_specs, rewritten.lora_specs)
        specs = {"state_specs": rewritten.state_specs, "lora_specs": rewritten.lora_specs}
        if program is rewritten.graph_module:
            return LoweredStep(rewritten, rewritten.kv_cache_specs, note=note, **specs)
        return LoweredStep(program, rewritten.kv_cache_specs, note=note, standalone=True, **specs)

    def load_exported(self, path: str, fmt: FileFormat, *, trust_file: bool, device: torch.device | str,
                      max_model_len: int | None, rank: int = 0) -> LoweredStep:
        """A ``.pt2`` export (:func:`.pt2.load_pt2`) or a manifest's rank file, lowered as after a capture."""
        step = super().load_exported(path, fmt, trust_file=trust_file, device=device, max_model_len=max_model_len,
                                     rank=rank)
        limit = max_model_len or step.description.max_model_len
        step.run, note = cpu_step(step.run, step.kv_cache_specs, device, limit, step.state_specs, step.lora_specs)
        step.note = "; ".join(filter(None, (step.note, note)))
        return step
