"""pagedpack: packed batches and paged KV caches for unmodified PyTorch causal LMs.

    from pagedpack import LLM, SamplingParams
    llm = LLM()                      # built-in tiny Llama; or a local HF dir / hub id
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

``import pagedpack`` registers the ``torch.ops.pagedpack.*`` ops (all a loaded ``.pt2``
program needs); the public names below are imported on first use, so that importing one part
(e.g. ``pagedpack.runtime``) does not import the others.
"""
import importlib
import importlib.metadata
import warnings

from pagedpack.kernels import lora as _lora  # noqa: F401  (registers the LoRA ops)
from pagedpack.kernels import ops as _ops  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.kernels import recurrent as _recurrent  # noqa: F401  (registers the recurrent ops)
from pagedpack.kernels import sparse_attention as _sparse_attention  # noqa: F401  (registers the DSA ops)
from pagedpack.kernels import varlen as _varlen  # noqa: F401  (registers torch.ops.pagedpack.varlen_attention)

# torch 2.13 deprecates constructing pytree's LeafSpec, and its own deepcopy of a GraphModule (the
# passes copy graphs) reconstructs one through copyreg: a warning no caller can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module="copyreg")

_PUBLIC = {
    "LLM": "pagedpack.llm",
    "AsyncLLM": "pagedpack.async_llm",
    "CompletionOutput": "pagedpack.runtime.outputs",
    "RequestOutput": "pagedpack.runtime.outputs",
    "EngineArgs": "pagedpack.engine_args",
    "SamplingParams": "pagedpack.runtime.sampling",
    "StructuredOutputsParams": "pagedpack.runtime.sampling_params",
    "LoRARequest": "pagedpack.runtime.lora",
    "rewrite": "pagedpack.passes.pipeline",
    "UnsupportedModelError": "pagedpack.step.contract",
    "load_exported": "pagedpack.compiler.program",
    "export_pt2": "pagedpack.lowering.reference.pt2",
    "export_onnx": "pagedpack.lowering.onnx.export",
    "register_target": "pagedpack.lowering.targets",
}
__all__ = list(_PUBLIC)
try:
    __version__ = importlib.metadata.version("pagedpack")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pagedpack' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
