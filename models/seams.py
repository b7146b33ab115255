"""transformers' kernel seams, through which pagedpack's capture records a recurrent layer's scan as one node.

transformers' modeling code calls a recurrent layer's kernels by module-level names (the functions
``use_kernelized_func`` lists, which ``kernels`` may replace). Their torch fallbacks loop over
chunks whose count depends on the sequence length, which ``torch.export`` cannot capture for a
dynamic number of tokens. While :func:`kernel_seams` is active, those names in the modeling modules
of the model's paged recurrent layers (:data:`pagedpack.models.recurrent.PAGED_RECURRENT_CLASS`)
call a pagedpack op with the same semantics instead, for the form a prompt takes without a cache
(no initial state, no final state); any other call goes to the original function. The layer's
causal conv1d needs no seam: its fallback (``conv1d(padding=width - 1)[..., :T]``) captures as is.
A layer whose recurrence is inline in its ``forward`` (MiniMax's lightning attention: a Python loop
over blocks) has its class's ``forward`` replaced instead, by one that computes every line of the
original but the loop, which is one pagedpack op (:data:`_FORWARD_SEAMS`).
"""
from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import pagedpack.kernels.recurrent  # noqa: F401  (registers the seams' ops)
from pagedpack.models.recurrent import PAGED_RECURRENT_CLASS


def _gated_delta_rule_seam(original: Callable) -> Callable:
    """transformers' ``torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs)`` ->
    ``(out [B, T, num_v_heads, v_head_dim], final state or None)``, its scale ``k_head_dim ** -0.5``;
    also ``chunk_kimi_delta_attention`` (the same arguments, ``g`` per key channel)."""

    def seam(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None:
            return original(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)
        out = torch.ops.pagedpack.chunk_gated_delta_rule(query, key, value, g, beta, query.shape[-1] ** -0.5,
                                                         use_qk_l2norm_in_kernel)
        return out, None

    return seam


def _dt_limit(low: float, high: float) -> tuple[float, float | None]:
    return float(low), (None if math.isinf(high) else float(high))


def _ssd_seam(original: Callable) -> Callable:
    """transformers' ``mamba2_chunk_scan(hidden_states [B, T, H, P], dt [B, T, H], A [H], B, C [B, T,
    G, N], chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False, dt_limit=(0, inf),
    return_final_states=False, **kwargs)`` (Mamba2's SSD) -> ``[B, T, H, P]`` in fp32, as it computes."""

    def seam(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        if initial_states is not None or return_final_states or kwargs.get("z") is not None:
            return original(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus,
                            dt_limit, return_final_states, **kwargs)
        return torch.ops.pagedpack.chunk_selective_scan(hidden_states.float(), dt, A, B, C, D, dt_bias, dt_softplus,
                                                        *_dt_limit(*dt_limit))

    return seam


def _selective_scan_seam(original: Callable) -> Callable:
    """transformers' ``mamba_selective_scan(hidden_states [B, D, T], dt [B, D, T], A [D, N], B, C [B, N,
    T], D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False, **kwargs)``
    (Mamba's, mamba_ssm's ``selective_scan_fn`` layout) -> ``[B, D, T]``, times ``silu(z)`` if given."""

    def seam(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):
        if return_last_state:
            return original(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, **kwargs)
        out = torch.ops.pagedpack.chunk_selective_scan(
            hidden_states.transpose(1, 2)[..., None], dt.transpose(1, 2), A, B.transpose(1, 2)[:, :, None],
            C.transpose(1, 2)[:, :, None], D, delta_bias, delta_softplus)
        out = out[..., 0].transpose(1, 2)
        return out if z is None else out * F.silu(z)

    return seam


def _lightning_attention_seam(original: Callable) -> Callable:
    """transformers' ``MiniMaxLightningAttention.forward(hidden_states [B, T, hidden], position_embeddings,
    attention_mask, cache=None, **kwargs) -> (out [B, T, hidden], final state)`` (modeling_minimax,
    transformers 5.25): without a cache (a prompt), its lines with the loop over blocks (the
    ``attn_weights_inter is None`` branch and its ``torch.cat``) as one ``chunk_lightning_attention``
    on the ``[B, T, H, D]`` q, k, v before their transposes (the ``transpose(1, 2)`` after the loop
    undoes them); the final state is not returned (None). With a cache, the original."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        if cache is not None or kwargs.get("past_key_values") is not None:
            return original(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        apply_mask_to_padding_states = sys.modules[type(self).__module__].apply_mask_to_padding_states
        batch_size, seq_len, _ = hidden_states.shape

        qkv_states = self.act_fn(self.qkv_proj(hidden_states))
        qkv_states = apply_mask_to_padding_states(qkv_states, attention_mask)
        qkv_states = qkv_states.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)

        query_states, key_states, value_states = torch.split(qkv_states, self.head_dim, dim=3)
        attn_output = torch.ops.pagedpack.chunk_lightning_attention(query_states, key_states, value_states,
                                                                     self.slope_rate.reshape(-1))

        attn_output = attn_output.reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)
        attn_output = self.norm(attn_output)
        attn_output = F.sigmoid(self.output_gate(hidden_states)) * attn_output
        attn_output = self.out_proj(attn_output)
        return attn_output, None

    return forward


# the modeling modules' function names and their seams
_SEAMS: dict[str, Callable[[Callable], Callable]] = {"torch_chunk_gated_delta_rule": _gated_delta_rule_seam,
                                                     "chunk_kimi_delta_attention": _gated_delta_rule_seam,
                                                     "mamba2_chunk_scan": _ssd_seam,
                                                     "mamba_selective_scan": _selective_scan_seam}
# the paged layer classes (by name) whose recurrence is inline in their own forward, and its seam
_FORWARD_SEAMS: dict[str, Callable[[Callable], Callable]] = {"MiniMaxLightningAttention": _lightning_attention_seam}
_PATCHING = threading.Lock()  # one capture at a time patches (a second would restore the first's seam)


@contextmanager
def kernel_seams(model: torch.nn.Module) -> Iterator[None]:
    """Route the seams of :data:`_SEAMS` in the modeling modules of ``model``'s paged recurrent
    layers, and the ``forward`` of its layer classes in :data:`_FORWARD_SEAMS`, to pagedpack's ops
    for the duration of the block (the originals are restored after)."""
    with _PATCHING, _patched(model):
        yield


@contextmanager
def _patched(model: torch.nn.Module) -> Iterator[None]:
    layers = {type(m) for m in model.modules() if PAGED_RECURRENT_CLASS.search(type(m).__name__)}
    modules = {sys.modules[cls.__module__] for cls in layers}
    patches = [(module, name, getattr(module, name), _SEAMS[name]) for module in modules for name in _SEAMS
               if hasattr(module, name)]
    patches += [(cls, "forward", vars(cls)["forward"], _FORWARD_SEAMS[cls.__name__]) for cls in layers
                if cls.__name__ in _FORWARD_SEAMS and "forward" in vars(cls)]
    try:
        for owner, name, original, seam in patches:
            setattr(owner, name, seam(original))
        yield
    finally:
        for owner, name, original, _ in patches:
            setattr(owner, name, original)
