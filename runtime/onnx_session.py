"""An onnxruntime session in the place of the step graph (what ``LLM.from_exported`` runs for
an ONNX file written by ``pagedpack export --format onnx``)."""
from __future__ import annotations

import torch


class OnnxSessionStep:
    """Calls ``session`` with the step signature and returns ``(logits, *updated caches)``.

    The ONNX program is functional: the caches are inputs ``key_cache_i`` / ``value_cache_i`` and
    come back as outputs ``key_cache_out_i`` / ``value_cache_out_i``, in the same order, which
    :class:`~pagedpack.runtime.model_runner.ModelRunner` keeps for the next step. Tensors cross as
    NumPy arrays sharing memory with the torch CPU tensors (float32 and float16 caches).
    """

    def __init__(self, session, input_names: list[str]):
        self.session = session
        got = [i.name for i in session.get_inputs()]
        if got != list(input_names):
            raise ValueError(f"session: expected the inputs {list(input_names)}, got {got}")
        self.input_names = got
        self.output_names = [o.name for o in session.get_outputs()]

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self.input_names, tensors, strict=True)}
        return tuple(torch.from_numpy(out) for out in self.session.run(self.output_names, feeds))
