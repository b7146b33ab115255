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
original but the loop, which is one pagedpack op (:data:`_FORWARD_SEAMS`). A sparse-attention (DSA)
layer (DeepSeek-V3.2, GLM-MoE-DSA: :data:`SPARSE_ATTENTION_SEAMS`) too: its indexer's top-k is folded
into a dense mask that no paged op can take, so the seam records the top-k and the attention over it
as the ops of :mod:`pagedpack.kernels.sparse_attention`, which the ``sparse_attention`` pass pages.
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import pagedpack.kernels.recurrent  # noqa: F401  (registers the seams' ops)
import pagedpack.kernels.sparse_attention  # noqa: F401  (registers the DSA seam's ops)
from pagedpack.models.recurrent import PAGED_RECURRENT_CLASS
from pagedpack.models.sparse import PAGED_INDEXERS


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


def _dsa_indexer(indexer: torch.nn.Module, hidden_states, q_resid, position_embeddings):
    """transformers' ``DeepseekV32Indexer.forward`` / ``GlmMoeDsaIndexer.forward`` (transformers 5.25) on
    one sequence without a cache: its lines up to the scores, the scoring and top-k as one
    ``indexer_topk`` -> int32 ``[1, S, index_topk]`` (-1 past a row's visible keys, where transformers
    takes ``min(index_topk, S)`` columns, the extra ones masked keys). The indexer's rotary embedding is
    its module's function :data:`~pagedpack.models.sparse.PAGED_INDEXERS` names."""
    module = sys.modules[type(indexer).__module__]
    rotary = getattr(module, PAGED_INDEXERS[type(indexer).__name__])
    seq_len = hidden_states.shape[1]
    rope, pass_dim = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(1, seq_len, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, pass_dim], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, pass_dim], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = rotary(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * indexer.n_heads ** -0.5
    return torch.ops.pagedpack.indexer_topk(q[0], weights[0], k[0], indexer.softmax_scale, indexer.index_topk)[None]


def _dsa_attention_seam(original: Callable) -> Callable:
    """transformers' ``DeepseekV32Attention.forward`` / ``GlmMoeDsaAttention.forward(hidden_states [B, S,
    hidden], position_embeddings, attention_mask, cache=None, position_ids=None, **kwargs)`` (transformers
    5.25; GLM's also takes ``prev_topk_indices`` and returns the top-k as a third output, which its
    "shared" layers, without an indexer, reuse): on one sequence without a cache under ``eager`` or
    ``sdpa``, its lines up to the expanded MLA key and value, then the indexer (:func:`_dsa_indexer`) and
    the attention over its top-k as one ``sparse_attention`` on ``[S, heads, dim]`` tensors, in place of
    the top-k mask folded into the attention mask and the attention interface; otherwise the original."""
    returns_topk = "prev_topk_indices" in inspect.signature(original).parameters

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, position_ids=None, **kwargs):
        prev_topk_indices = kwargs.pop("prev_topk_indices", None)
        if (cache is not None or kwargs.get("past_key_values") is not None or hidden_states.shape[0] != 1
                or self.config._attn_implementation not in ("eager", "sdpa")):
            extra = {"prev_topk_indices": prev_topk_indices} if returns_topk else {}
            return original(self, hidden_states, position_embeddings, attention_mask, cache=cache,
                            position_ids=position_ids, **extra, **kwargs)
        rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb_interleave
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_states = self.q_b_proj(q_resid).view(query_shape).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_a_layernorm(kv_pass).view(batch_size, 1, seq_length, self.kv_lora_rank)
        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        q_rot, k_rot = rotary(q_rot, k_rot, cos, sin)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states, value_states = self.expand_kv(k_pass, k_rot)

        if getattr(self, "indexer", None) is not None:
            topk_indices = _dsa_indexer(self.indexer, hidden_states, q_resid, position_embeddings)
        elif prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        else:
            topk_indices = prev_topk_indices
        attn_output = torch.ops.pagedpack.sparse_attention(
            query_states[0].transpose(0, 1), key_states[0].transpose(0, 1), value_states[0].transpose(0, 1),
            topk_indices[0], self.scaling)  # [S, heads, v_head_dim]
        attn_output = self.o_proj(attn_output.reshape(batch_size, seq_length, -1))
        return (attn_output, None, topk_indices) if returns_topk else (attn_output, None)

    return forward


# the modeling modules' function names and their seams
_SEAMS: dict[str, Callable[[Callable], Callable]] = {"torch_chunk_gated_delta_rule": _gated_delta_rule_seam,
                                                     "chunk_kimi_delta_attention": _gated_delta_rule_seam,
                                                     "mamba2_chunk_scan": _ssd_seam,
                                                     "mamba_selective_scan": _selective_scan_seam}
# the paged layer classes (by name) whose recurrence is inline in their own forward, and its seam
_FORWARD_SEAMS: dict[str, Callable[[Callable], Callable]] = {"MiniMaxLightningAttention": _lightning_attention_seam}
# the sparse-attention (DSA) layer classes of the paged indexers (pagedpack.models.sparse), whose ``forward``
# is replaced the same way
SPARSE_ATTENTION_SEAMS: dict[str, Callable[[Callable], Callable]] = {"DeepseekV32Attention": _dsa_attention_seam,
                                                                     "GlmMoeDsaAttention": _dsa_attention_seam}
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
    forward_seams = {**_FORWARD_SEAMS, **SPARSE_ATTENTION_SEAMS}
    layers |= {type(m) for m in model.modules() if type(m).__name__ in SPARSE_ATTENTION_SEAMS}
    patches += [(cls, "forward", vars(cls)["forward"], forward_seams[cls.__name__]) for cls in layers
                if cls.__name__ in forward_seams and "forward" in vars(cls)]
    try:
        for owner, name, original, seam in patches:
            setattr(owner, name, seam(original))
        yield
    finally:
        for owner, name, original, _ in patches:
            setattr(owner, name, original)
