"""An onnxruntime session in the place of the step graph (what ``LLM.from_exported`` runs for
an ONNX file written by ``pagedpack export --format onnx``)."""
from __future__ import annotations

import torch

from pagedpack.step.contract import METADATA_INPUTS, KVCacheSpec, cache_input_names

_ORT_TYPES = {torch.float32: "tensor(float)", torch.float16: "tensor(float16)"}  # NumPy has no bfloat16


def check_cache_dtypes(kv_cache_specs: list[KVCacheSpec]) -> None:
    """``ValueError`` unless every cache is float32 or float16 (what crosses to onnxruntime as NumPy)."""
    if any(spec.dtype not in _ORT_TYPES for spec in kv_cache_specs):
        raise ValueError(f"kv_cache_specs: expected float32 or float16 caches (they cross to onnxruntime as "
                         f"NumPy arrays), got {sorted({str(s.dtype) for s in kv_cache_specs})}; "
                         f"use the model in float16 or float32")


class OnnxSessionStep:
    """Calls ``session`` with the step signature and returns ``(logits, *updated caches)``.

    The ONNX program is functional: the caches are inputs ``key_cache_i`` / ``value_cache_i`` and
    come back as outputs ``key_cache_out_i`` / ``value_cache_out_i``, in the same order, which
    :class:`~pagedpack.runtime.model_runner.ModelRunner` keeps for the next step. Tensors cross as
    NumPy arrays sharing memory with the torch CPU tensors (float32 and float16 caches).

    Raises ``ValueError`` if the session's inputs are not the step signature for ``kv_cache_specs``
    (names, cache dtypes, ``[num_blocks, block_size, num_kv_heads, head_size]`` shapes), or for
    bfloat16 caches, which NumPy cannot hold.
    """

    def __init__(self, session, kv_cache_specs: list[KVCacheSpec]):
        self.session = session
        inputs = session.get_inputs()
        self.input_names = [i.name for i in inputs]
        expected = [*METADATA_INPUTS, *cache_input_names(len(kv_cache_specs))]
        if self.input_names != expected:
            raise ValueError(f"session: expected the inputs {expected}, got {self.input_names}")
        check_cache_dtypes(kv_cache_specs)
        caches = inputs[len(METADATA_INPUTS):]
        for spec, pair in zip(kv_cache_specs, zip(caches[::2], caches[1::2])):
            for cache, head_size in zip(pair, (spec.key_head_size, spec.value_head_size)):
                want = (_ORT_TYPES.get(spec.dtype), [spec.num_kv_heads, head_size])
                if (cache.type, list(cache.shape[2:])) != want:
                    raise ValueError(f"session: {cache.name}: expected {want[0]} [num_blocks, block_size, "
                                     f"{spec.num_kv_heads}, {head_size}] as the metadata says, "
                                     f"got {cache.type} {cache.shape}")
        self.output_names = [o.name for o in session.get_outputs()]

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self.input_names, tensors, strict=True)}
        return tuple(torch.from_numpy(out) for out in self.session.run(self.output_names, feeds))
