"""transformers' kernel seams, through which pagedpack's capture records a recurrent layer's scan as one node.

transformers' modeling code calls a recurrent layer's kernels by module-level names (the functions
``use_kernelized_func`` lists, which ``kernels`` may replace). Their torch fallbacks loop over
chunks whose count depends on the sequence length, which ``torch.export`` cannot capture for a
dynamic number of tokens. While :func:`kernel_seams` is active, those names in the modeling modules
of the model's paged recurrent layers (:data:`pagedpack.models.recurrent.PAGED_RECURRENT_CLASS`)
call a pagedpack op with the same semantics instead, for the form a prompt takes without a cache
(no initial state, no final state); any other call goes to the original function. The layer's
causal conv1d needs no seam: its fallback (``conv1d(padding=width - 1)[..., :T]``) captures as is.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import pagedpack.kernels.recurrent  # noqa: F401  (registers torch.ops.pagedpack.chunk_gated_delta_rule)
from pagedpack.models.recurrent import PAGED_RECURRENT_CLASS


def _gated_delta_rule_seam(original: Callable) -> Callable:
    """transformers' ``torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs)`` ->
    ``(out [B, T, num_v_heads, v_head_dim], final state or None)``, its scale ``k_head_dim ** -0.5``."""

    def seam(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None:
            return original(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)
        out = torch.ops.pagedpack.chunk_gated_delta_rule(query, key, value, g, beta, query.shape[-1] ** -0.5,
                                                         use_qk_l2norm_in_kernel)
        return out, None

    return seam


# the modeling modules' function names and their seams
_SEAMS: dict[str, Callable[[Callable], Callable]] = {"torch_chunk_gated_delta_rule": _gated_delta_rule_seam}
_PATCHING = threading.Lock()  # one capture at a time patches (a second would restore the first's seam)


@contextmanager
def kernel_seams(model: torch.nn.Module) -> Iterator[None]:
    """Route the seams of :data:`_SEAMS` in the modeling modules of ``model``'s paged recurrent
    layers to pagedpack's ops for the duration of the block (the originals are restored after)."""
    with _PATCHING, _patched(model):
        yield


@contextmanager
def _patched(model: torch.nn.Module) -> Iterator[None]:
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if PAGED_RECURRENT_CLASS.search(type(m).__name__)}
    originals = [(module, name, getattr(module, name)) for module in modules for name in _SEAMS
                 if hasattr(module, name)]
    try:
        for module, name, original in originals:
            setattr(module, name, _SEAMS[name](original))
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
