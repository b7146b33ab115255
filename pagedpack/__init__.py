"""pagedpack: packed batches and paged KV caches for unmodified PyTorch causal LMs.

    from pagedpack import LLM, SamplingParams
    llm = LLM()                      # built-in tiny Llama; or a local HF dir / hub id
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""
from pagedpack.kernels import ops as _ops, varlen as _varlen  # noqa: F401  (register torch.ops.pagedpack.*)
from pagedpack.llm import LLM, CompletionOutput, RequestOutput
from pagedpack.passes.pipeline import UnsupportedModelError, rewrite
from pagedpack.runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "rewrite", "UnsupportedModelError"]
