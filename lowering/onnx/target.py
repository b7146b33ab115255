"""The ``onnx`` target: the step program exported to ONNX in memory and run by onnxruntime.

What ``pagedpack export --format onnx`` writes and ``LLM.from_exported`` serves, without the
file: ``LLM(model, target="onnx")`` runs the same ONNX program on an onnxruntime CPU session
(:mod:`pagedpack.lowering.onnx.export`, attention as the ``pagedpack`` domain's standard-op functions).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedpack.host.devices import is_cpu
from pagedpack.lowering.onnx import export as onnx_format
from pagedpack.lowering.onnx.session import OnnxSessionStep, check_cache_dtypes
from pagedpack.lowering.targets import FileFormat, StepBounds, Target, TargetOptions
from pagedpack.step.contract import LoweredStep


@dataclass
class OnnxTarget(Target):
    """onnxruntime's CPU provider; float32 or float16 KV caches (they cross as NumPy arrays)."""

    name: str = "onnx"
    description: str = "the step program exported to ONNX and run by onnxruntime (CPU)"
    formats: tuple[FileFormat, ...] = (onnx_format.FORMAT,)

    def check_limits(self, rewritten, *, block_size: int, bounds: StepBounds) -> None:
        check_cache_dtypes(rewritten.kv_cache_specs)
        onnx_format.check_real_valued(rewritten)

    def lower(self, rewritten, options: TargetOptions, *, block_size: int, bounds: StepBounds,
              device: torch.device | str) -> LoweredStep:
        import onnxruntime

        if not is_cpu(device):
            raise ValueError(f"device: the 'onnx' target runs on onnxruntime's CPU provider, got {device!r}")
        model = onnx_format.onnx_program(rewritten).model
        session = onnxruntime.InferenceSession(_serialize(model), providers=["CPUExecutionProvider"])
        note = (f"onnx lowering: {len(rewritten.kv_cache_specs)} site(s) -> pagedpack-domain ONNX functions, "
                "onnxruntime CPU")
        return LoweredStep(OnnxSessionStep(session, rewritten.kv_cache_specs), rewritten.kv_cache_specs,
                           functional=True, note=note, standalone=True)


def _serialize(model) -> bytes:
    import onnx_ir

    return onnx_ir.to_proto(model).SerializeToString()
