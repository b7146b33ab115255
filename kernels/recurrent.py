"""The recurrent ops: the layers of hybrid and state-space models over packed varlen tokens, each
sequence reading and writing its own **state slot** (vLLM's and FLA's contract for them).

* ``causal_conv1d_varlen``: the causal depthwise conv1d over the sequence (Mamba, Mamba2, the
  gated DeltaNet's q/k/v conv, LFM2's short conv); semantics of vLLM's / Dao-AILab's
  ``causal_conv1d_fn`` with ``query_start_loc``, ``cache_indices`` and ``has_initial_state``.
* ``gated_delta_rule_varlen``: the gated delta rule (Qwen3-Next, Qwen3.5; Kimi-Linear's per-channel decay); semantics
  of FLA's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` with ``cu_seqlens``,
  the initial states gathered and the final states scattered by ``ssm_state_indices`` (vLLM).
* ``selective_scan_varlen``: the selective state-space scan of Mamba (``A [H, N]``,
  mamba_ssm's ``selective_scan_fn``) and Mamba2's SSD (``A [H]``, ``mamba_chunk_scan_combined``).
* ``lightning_attention_varlen``: MiniMax's lightning attention, linear attention with a decay per
  head (vLLM's ``lightning_attention`` / ``linear_decode_forward_triton``); the gated delta rule's
  kernel without its delta term.

Common arguments (``B`` sequences, ``T`` packed tokens, ``S`` state slots):

* ``cu_seqlens_q``: int32 ``[B+1]``, sequence ``b`` owns token rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
* ``state_indices``: int32 ``[B]``, the slot of sequence ``b`` in the state tensor, or -1 (vLLM's
  ``PAD_SLOT_ID``): the sequence starts from zeros and its state is not written.
* ``has_initial_state``: bool ``[B]``, False when the sequence starts here (its slot may hold a
  former occupant's state: it is read as zeros).

The state tensors are updated in place: after the call, slot ``state_indices[b]`` holds the state
after sequence ``b``'s last token. The outputs come back in the input's dtype, the states in the
state's dtype. Arguments and metadata values are checked on every call, except inside the
runner's step (:func:`pagedpack.kernels.validation.checked_step`: the KV manager made the
metadata), where the native kernels check only what their memory safety needs (the slots and the
offsets, always). On the CPU, fp32 and bf16 activations and states run the native kernels
(``kernels/csrc/recurrent_cpu.cpp``, fp32 accumulation, in parallel over sequences and heads) when
they build; otherwise the reference kernels here run, in fp32 (fp64 inputs stay fp64), one sequence
at a time and token by token: they define the semantics the native ones are checked against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.native import native_ops
from pagedpack.kernels.ops import _check_dtype, _check_rank, _require
from pagedpack.kernels.validation import arguments_checked

CONV_ACTIVATIONS = (None, "silu")
_INDEX_DTYPES = (torch.int32,)


def _check_ranks(op: str, **tensors: tuple[Tensor, str]) -> None:
    """``_check_rank`` of each ``name=(tensor, layout)``."""
    for arg, (t, layout) in tensors.items():
        _check_rank(op, arg, t, layout)


def _check_varlen(op: str, state: Tensor, state_indices: Tensor, cu_seqlens_q: Tensor, has_initial_state: Tensor,
                  **floats: Tensor | None) -> None:
    """Shape and dtype checks of the arguments every recurrent op shares, and that ``floats`` (the
    op's data arguments by name) are floating point; the metadata's values are checked where they
    are read (:func:`_sequences`)."""
    for arg, t in floats.items():
        if t is not None:
            _require(t.is_floating_point(), op, arg, "a floating-point tensor", str(t.dtype).removeprefix("torch."))
    _check_ranks(op, cu_seqlens_q=(cu_seqlens_q, "[B+1]"), state_indices=(state_indices, "[B]"),
                 has_initial_state=(has_initial_state, "[B]"))
    _check_dtype(op, "cu_seqlens_q", cu_seqlens_q, _INDEX_DTYPES)
    _check_dtype(op, "state_indices", state_indices, _INDEX_DTYPES)
    _check_dtype(op, "has_initial_state", has_initial_state, (torch.bool,))
    num_seqs = cu_seqlens_q.shape[0] - 1
    for arg, t in (("state_indices", state_indices), ("has_initial_state", has_initial_state)):
        _require(t.shape[0] == num_seqs, op, arg, f"B={num_seqs} entries (cu_seqlens_q has B+1)", t.shape[0])
    _require(state.dim() >= 2, op, "state", "a tensor [num_slots, ...]", f"shape {tuple(state.shape)}")


def _sequences(cu_seqlens_q: Tensor, state_indices: Tensor, has_initial_state: Tensor, op: str, tokens: int,
               num_slots: int):
    """``(start, end, slot or -1, has_initial_state)`` per sequence, after checking the values."""
    cu, slots, initial = cu_seqlens_q.tolist(), state_indices.tolist(), has_initial_state.tolist()
    _require(cu[0] == 0 and cu[-1] == tokens and all(a <= b for a, b in zip(cu, cu[1:])), op, "cu_seqlens_q",
             f"non-decreasing offsets from 0 to T={tokens}", cu)
    _require(all(-1 <= s < num_slots for s in slots), op, "state_indices", f"slots in [0, {num_slots}) or -1", slots)
    used = [s for s in slots if s >= 0]
    _require(len(used) == len(set(used)), op, "state_indices", "each slot at most once", slots)
    return [(cu[b], cu[b + 1], slots[b], bool(initial[b]) and slots[b] >= 0) for b in range(len(slots))]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(*tensors: Tensor):
    """``torch.ops.pagedpack_cpu`` when the native kernels take these activations and state (CPU, fp32
    or bf16, the library built), else None."""
    if not is_cpu(tensors[0]) or any(t.dtype not in _NATIVE_DTYPES for t in tensors):
        return None
    return native_ops()


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- causal depthwise conv1d


def _check_conv(x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, activation: str | None) -> None:
    op = "causal_conv1d_varlen"
    _check_ranks(op, x=(x, "[T, dim]"), weight=(weight, "[dim, width]"),
                 conv_state=(conv_state, "[num_slots, dim, width - 1]"))
    dim, width = weight.shape
    _require(x.shape[1] == dim, op, "x", f"dim={dim} columns like weight", x.shape[1])
    _require(width >= 2, op, "weight", "a kernel width >= 2", width)
    _require(tuple(conv_state.shape[1:]) == (dim, width - 1), op, "conv_state",
             f"[num_slots, {dim}, {width - 1}]", f"shape {tuple(conv_state.shape)}")
    if bias is not None:
        _require(tuple(bias.shape) == (dim,), op, "bias", f"shape ({dim},)", f"shape {tuple(bias.shape)}")
    _require(activation in CONV_ACTIVATIONS, op, "activation", f"one of {CONV_ACTIVATIONS}", repr(activation))


@torch.library.custom_op("pagedpack::causal_conv1d_varlen", mutates_args=("conv_state",))
def causal_conv1d_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, state_indices: Tensor,
                         cu_seqlens_q: Tensor, has_initial_state: Tensor, activation: str | None = None) -> Tensor:
    """Causal depthwise conv1d of each packed sequence, continuing from its conv state.

    ``out[t, c] = bias[c] + sum_j weight[c, j] * window[t + j, c]``, where a sequence's window is
    its conv state (the ``width - 1`` inputs before its first token; zeros without an initial
    state) followed by its tokens; ``activation="silu"`` applies SiLU to the result. Afterwards
    the slot holds the window's last ``width - 1`` inputs.

    Args:
        x: ``[T, dim]`` (token-major; vLLM's kernel takes the transpose ``[dim, T]``).
        weight: ``[dim, width]`` (an ``nn.Conv1d(groups=dim)`` weight ``[dim, 1, width]`` squeezed).
        bias: ``[dim]`` or None.
        conv_state: ``[num_slots, dim, width - 1]``, mutated.
        state_indices, cu_seqlens_q, has_initial_state: as in the module docstring.
        activation: None or ``"silu"``.

    Returns:
        ``[T, dim]`` in ``x``'s dtype.

    Raises:
        ValueError: a shape, dtype or metadata value that does not fit (naming the argument).
    """
    checked = arguments_checked()
    if not checked:
        _check_conv(x, weight, bias, conv_state, activation)
        _check_varlen("causal_conv1d_varlen", conv_state, state_indices, cu_seqlens_q, has_initial_state, x=x,
                      weight=weight, bias=bias, conv_state=conv_state)
    native = _native(x, conv_state)
    if native is None or not checked:
        sequences = _sequences(cu_seqlens_q, state_indices, has_initial_state, "causal_conv1d_varlen", x.shape[0],
                               conv_state.shape[0])
    if native is not None:
        return native.causal_conv1d_varlen(x, weight, bias, conv_state, state_indices, cu_seqlens_q,
                                           has_initial_state, activation == "silu")
    dtype = _compute_dtype(x)
    dim, width = weight.shape
    w = weight.to(dtype)[:, None, :]
    b = None if bias is None else bias.to(dtype)
    out = torch.empty_like(x)
    for start, end, slot, initial in sequences:
        state = conv_state[slot].to(dtype) if initial else x.new_zeros(dim, width - 1, dtype=dtype)
        window = torch.cat([state, x[start:end].to(dtype).T], dim=1)  # [dim, width - 1 + L]
        y = F.conv1d(window[None], w, b, groups=dim)[0]  # [dim, L]
        out[start:end] = (F.silu(y) if activation == "silu" else y).T.to(x.dtype)
        if slot >= 0:
            conv_state[slot] = window[:, window.shape[1] - (width - 1):].to(conv_state.dtype)
    return out


@causal_conv1d_varlen.register_fake
def _(x, weight, bias, conv_state, state_indices, cu_seqlens_q, has_initial_state, activation=None):
    _check_conv(x, weight, bias, conv_state, activation)
    _check_varlen("causal_conv1d_varlen", conv_state, state_indices, cu_seqlens_q, has_initial_state, x=x,
                  weight=weight, bias=bias, conv_state=conv_state)
    return torch.empty_like(x)


# ---------------------------------------------------------------- gated delta rule


def _check_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor) -> None:
    op = "gated_delta_rule_varlen"
    _check_ranks(op, q=(q, "[T, num_k_heads, k_head_dim]"), k=(k, "[T, num_k_heads, k_head_dim]"),
                 v=(v, "[T, num_v_heads, v_head_dim]"), beta=(beta, "[T, num_v_heads]"),
                 ssm_state=(ssm_state, "[num_slots, num_v_heads, k_head_dim, v_head_dim]"))
    tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    _require(tuple(k.shape) == tuple(q.shape), op, "k", f"shape {tuple(q.shape)} like q", f"shape {tuple(k.shape)}")
    _require(v.shape[0] == tokens, op, "v", f"T={tokens} rows like q", v.shape[0])
    _require(num_k_heads > 0 and num_v_heads % num_k_heads == 0, op, "v",
             f"num_v_heads a multiple of num_k_heads={num_k_heads}", num_v_heads)
    _require(tuple(beta.shape) == (tokens, num_v_heads), op, "beta", f"shape ({tokens}, {num_v_heads})",
             f"shape {tuple(beta.shape)}")
    _require(tuple(g.shape) in ((tokens, num_v_heads), (tokens, num_v_heads, k_dim)), op, "g",
             f"shape ({tokens}, {num_v_heads}) or ({tokens}, {num_v_heads}, {k_dim})", f"shape {tuple(g.shape)}")
    _require(tuple(ssm_state.shape[1:]) == (num_v_heads, k_dim, v_dim), op, "ssm_state",
             f"[num_slots, {num_v_heads}, {k_dim}, {v_dim}]", f"shape {tuple(ssm_state.shape)}")


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """FLA's ``l2norm`` (transformers' ``l2norm``): ``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@torch.library.custom_op("pagedpack::gated_delta_rule_varlen", mutates_args=("ssm_state",))
def gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor,
                            state_indices: Tensor, cu_seqlens_q: Tensor, has_initial_state: Tensor, scale: float,
                            use_qk_l2norm_in_kernel: bool = False) -> Tensor:
    """The gated delta rule of each packed sequence, continuing from its state.

    Per token, per value head (query and key heads serve ``num_v_heads // num_k_heads``
    consecutive value heads): ``S = S * exp(g)``; ``S = S + k (beta (v - k^T S))^T``;
    ``o = (scale q)^T S``, with ``S`` the ``[k_head_dim, v_head_dim]`` state, after ``q`` and ``k``
    are L2-normalised if ``use_qk_l2norm_in_kernel``. A ``g`` per key channel decays each row of
    ``S`` by its own factor (Kimi Delta Attention: FLA's ``chunk_kda``).

    Args:
        q, k: ``[T, num_k_heads, k_head_dim]``.
        v: ``[T, num_v_heads, v_head_dim]``.
        g: ``[T, num_v_heads]`` or ``[T, num_v_heads, k_head_dim]``, the log of the decay (``<= 0``).
        beta: ``[T, num_v_heads]``, the write strength.
        ssm_state: ``[num_slots, num_v_heads, k_head_dim, v_head_dim]``, mutated.
        state_indices, cu_seqlens_q, has_initial_state: as in the module docstring.
        scale: the query scale (FLA's default ``k_head_dim ** -0.5``).

    Returns:
        ``[T, num_v_heads, v_head_dim]`` in ``v``'s dtype.
    """
    if not arguments_checked():
        _check_delta_rule(q, k, v, g, beta, ssm_state)
        _check_varlen("gated_delta_rule_varlen", ssm_state, state_indices, cu_seqlens_q, has_initial_state, q=q, k=k,
                      v=v, g=g, beta=beta, ssm_state=ssm_state)
    return _decayed_scan("gated_delta_rule_varlen", q, k, v, g, beta, ssm_state, state_indices, cu_seqlens_q,
                         has_initial_state, scale, use_qk_l2norm_in_kernel, delta_rule=True)


def _decayed_scan(op: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_state: Tensor,
                  state_indices: Tensor, cu_seqlens_q: Tensor, has_initial_state: Tensor, scale: float, l2norm: bool,
                  delta_rule: bool) -> Tensor:
    """The recurrence of :func:`gated_delta_rule_varlen` (``delta_rule``) and of
    :func:`lightning_attention_varlen` (not: ``S = S * exp(g) + k (beta v)^T``), after ``op``'s
    checks: the native kernel (one, with the flag) or the reference loop here."""
    checked = arguments_checked()
    native = _native(v, ssm_state) if q.dtype == k.dtype == v.dtype else None
    if native is None or not checked:
        sequences = _sequences(cu_seqlens_q, state_indices, has_initial_state, op, v.shape[0], ssm_state.shape[0])
    if native is not None:
        return native.gated_delta_rule_varlen(q, k, v, g, beta, ssm_state, state_indices, cu_seqlens_q,
                                              has_initial_state, scale, l2norm, delta_rule)
    dtype = _compute_dtype(v)
    group = v.shape[1] // q.shape[1]
    q, k = (t.to(dtype).repeat_interleave(group, dim=1) for t in (q, k))
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    decay, write = g.to(dtype).exp(), beta.to(dtype)
    out = torch.empty_like(v)
    for start, end, slot, initial in sequences:
        state = ssm_state[slot].to(dtype) if initial else v.new_zeros(ssm_state.shape[1:], dtype=dtype)
        for t in range(start, end):
            state = state * (decay[t, :, None, None] if decay.dim() == 2 else decay[t, :, :, None])
            value = v[t].to(dtype)
            if delta_rule:
                value = value - torch.einsum("hk,hkv->hv", k[t], state)
            state = state + k[t, :, :, None] * (value * write[t, :, None])[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], state).to(v.dtype)
        if slot >= 0:
            ssm_state[slot] = state.to(ssm_state.dtype)
    return out


@gated_delta_rule_varlen.register_fake
def _(q, k, v, g, beta, ssm_state, state_indices, cu_seqlens_q, has_initial_state, scale,
      use_qk_l2norm_in_kernel=False):
    _check_delta_rule(q, k, v, g, beta, ssm_state)
    _check_varlen("gated_delta_rule_varlen", ssm_state, state_indices, cu_seqlens_q, has_initial_state, q=q, k=k, v=v,
                  g=g, beta=beta, ssm_state=ssm_state)
    return torch.empty_like(v)


def _fresh_sequences(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(state_indices, cu_seqlens_q, has_initial_state)`` for the rows of ``t [batch, T, ...]`` as
    ``batch`` sequences of ``T`` tokens, each from a zero state and none written back (slot -1: the
    capture ops' one-slot scratch state is read as zeros, never written)."""
    batch, tokens = t.shape[:2]
    return (torch.full((batch,), -1, dtype=torch.int32, device=t.device),
            torch.arange(batch + 1, dtype=torch.int32, device=t.device) * tokens,
            torch.zeros(batch, dtype=torch.bool, device=t.device))


@torch.library.custom_op("pagedpack::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                           use_qk_l2norm_in_kernel: bool = False) -> Tensor:
    """The gated delta rule of ``B`` sequences of ``T`` tokens each, every one from a zero state, its
    final state dropped: FLA's ``chunk_gated_delta_rule`` without ``initial_state`` and
    ``cu_seqlens``, as a gated DeltaNet layer calls it on a prompt. It is the capture's single node for
    the layer's scan (:mod:`pagedpack.models.seams`), which the ``recurrent_state`` pass rewrites to
    :func:`gated_delta_rule_varlen`.

    Args: ``q, k [B, T, num_k_heads, k_head_dim]``, ``v [B, T, num_v_heads, v_head_dim]``,
    ``g [B, T, num_v_heads (, k_head_dim)]``, ``beta [B, T, num_v_heads]``, ``scale`` and ``use_qk_l2norm_in_kernel`` as
    :func:`gated_delta_rule_varlen`'s. Returns ``[B, T, num_v_heads, v_head_dim]`` in ``v``'s dtype.
    """
    _check_ranks("chunk_gated_delta_rule", q=(q, "[B, T, num_k_heads, k_head_dim]"),
                 v=(v, "[B, T, num_v_heads, v_head_dim]"))
    scratch = v.new_zeros((1, v.shape[2], q.shape[3], v.shape[3]))
    out = gated_delta_rule_varlen(*(t.flatten(0, 1) for t in (q, k, v, g, beta)), scratch,
                                  *_fresh_sequences(v), scale, use_qk_l2norm_in_kernel)
    return out.unflatten(0, v.shape[:2])


@chunk_gated_delta_rule.register_fake
def _(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel=False):
    return torch.empty_like(v)


# ---------------------------------------------------------------- lightning attention (MiniMax)


def _check_lightning(q: Tensor, k: Tensor, v: Tensor, slope_rate: Tensor, ssm_state: Tensor) -> None:
    op = "lightning_attention_varlen"
    _check_ranks(op, q=(q, "[T, num_heads, head_dim]"), k=(k, "[T, num_heads, head_dim]"),
                 v=(v, "[T, num_heads, v_head_dim]"), slope_rate=(slope_rate, "[num_heads]"),
                 ssm_state=(ssm_state, "[num_slots, num_heads, head_dim, v_head_dim]"))
    tokens, heads, dim = q.shape
    _require(tuple(k.shape) == tuple(q.shape), op, "k", f"shape {tuple(q.shape)} like q", f"shape {tuple(k.shape)}")
    _require(tuple(v.shape[:2]) == (tokens, heads), op, "v", f"[{tokens}, {heads}, v_head_dim] like q",
             f"shape {tuple(v.shape)}")
    _require(tuple(slope_rate.shape) == (heads,), op, "slope_rate", f"shape ({heads},)",
             f"shape {tuple(slope_rate.shape)}")
    _require(tuple(ssm_state.shape[1:]) == (heads, dim, v.shape[2]), op, "ssm_state",
             f"[num_slots, {heads}, {dim}, {v.shape[2]}]", f"shape {tuple(ssm_state.shape)}")


@torch.library.custom_op("pagedpack::lightning_attention_varlen", mutates_args=("ssm_state",))
def lightning_attention_varlen(q: Tensor, k: Tensor, v: Tensor, slope_rate: Tensor, ssm_state: Tensor,
                               state_indices: Tensor, cu_seqlens_q: Tensor, has_initial_state: Tensor) -> Tensor:
    """MiniMax's lightning attention of each packed sequence, continuing from its state.

    Per token and head ``h``: ``S = exp(-slope_rate[h]) S + k v^T``; ``o = q^T S`` (no softmax,
    no scale), ``S`` the ``[head_dim, v_head_dim]`` state: transformers' ``MiniMaxLightningAttention``
    (its decode path token by token; its prefill computes the same blockwise with ``query_decay``,
    ``key_decay`` and ``diagonal_decay``) and vLLM's ``lightning_attention`` (prefill, ``kv_history``)
    and ``linear_decode_forward_triton`` (decode, ``slot_idx``). It runs the gated delta rule's
    kernel without the delta term (``g = -slope_rate``, ``beta = 1``, scale 1).

    Args:
        q, k: ``[T, num_heads, head_dim]``.
        v: ``[T, num_heads, v_head_dim]``.
        slope_rate: ``[num_heads]``, the decay rate (``> 0``; transformers' ``slope_rate`` buffer
            ``[num_heads, 1, 1]`` flattened).
        ssm_state: ``[num_slots, num_heads, head_dim, v_head_dim]``, mutated.
        state_indices, cu_seqlens_q, has_initial_state: as in the module docstring.

    Returns:
        ``[T, num_heads, v_head_dim]`` in ``v``'s dtype.
    """
    if not arguments_checked():
        _check_lightning(q, k, v, slope_rate, ssm_state)
        _check_varlen("lightning_attention_varlen", ssm_state, state_indices, cu_seqlens_q, has_initial_state, q=q,
                      k=k, v=v, slope_rate=slope_rate, ssm_state=ssm_state)
    tokens, heads = v.shape[:2]
    return _decayed_scan("lightning_attention_varlen", q, k, v, (-slope_rate).expand(tokens, heads),
                         v.new_ones(tokens, heads), ssm_state, state_indices, cu_seqlens_q, has_initial_state, 1.0,
                         False, delta_rule=False)


@lightning_attention_varlen.register_fake
def _(q, k, v, slope_rate, ssm_state, state_indices, cu_seqlens_q, has_initial_state):
    _check_lightning(q, k, v, slope_rate, ssm_state)
    _check_varlen("lightning_attention_varlen", ssm_state, state_indices, cu_seqlens_q, has_initial_state, q=q, k=k,
                  v=v, slope_rate=slope_rate, ssm_state=ssm_state)
    return torch.empty_like(v)


@torch.library.custom_op("pagedpack::chunk_lightning_attention", mutates_args=())
def chunk_lightning_attention(q: Tensor, k: Tensor, v: Tensor, slope_rate: Tensor) -> Tensor:
    """Lightning attention of ``B`` sequences of ``T`` tokens each, every one from a zero state, its
    final state dropped: ``MiniMaxLightningAttention.forward``'s loop over blocks on a prompt without
    a cache, the capture's single node for it (:mod:`pagedpack.models.seams`), which the
    ``recurrent_state`` pass rewrites to :func:`lightning_attention_varlen`.

    Args: ``q, k [B, T, num_heads, head_dim]``, ``v [B, T, num_heads, v_head_dim]``, ``slope_rate
    [num_heads]``. Returns ``[B, T, num_heads, v_head_dim]`` in ``v``'s dtype.
    """
    _check_ranks("chunk_lightning_attention", q=(q, "[B, T, num_heads, head_dim]"),
                 v=(v, "[B, T, num_heads, v_head_dim]"))
    scratch = v.new_zeros((1, v.shape[2], q.shape[3], v.shape[3]))
    out = lightning_attention_varlen(*(t.flatten(0, 1) for t in (q, k, v)), slope_rate, scratch,
                                     *_fresh_sequences(v))
    return out.unflatten(0, v.shape[:2])


@chunk_lightning_attention.register_fake
def _(q, k, v, slope_rate):
    return torch.empty_like(v)


# ---------------------------------------------------------------- selective scan (Mamba, Mamba2's SSD)


def _check_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
                ssm_state: Tensor) -> None:
    op = "selective_scan_varlen"
    _check_ranks(op, x=(x, "[T, num_heads, head_dim]"), dt=(dt, "[T, num_heads]"), B=(B, "[T, n_groups, d_state]"),
                 C=(C, "[T, n_groups, d_state]"), ssm_state=(ssm_state, "[num_slots, num_heads, head_dim, d_state]"))
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    _require(tuple(dt.shape) == (tokens, heads), op, "dt", f"shape ({tokens}, {heads})", f"shape {tuple(dt.shape)}")
    _require(A.dim() in (1, 2) and A.shape[0] == heads and (A.dim() == 1 or A.shape[1] == d_state), op, "A",
             f"shape ({heads},) (Mamba2) or ({heads}, {d_state}) (Mamba)", f"shape {tuple(A.shape)}")
    _require(B.shape[0] == tokens and groups > 0 and heads % groups == 0, op, "B",
             f"[{tokens}, n_groups, d_state] with num_heads={heads} a multiple of n_groups", f"shape {tuple(B.shape)}")
    _require(tuple(C.shape) == tuple(B.shape), op, "C", f"shape {tuple(B.shape)} like B", f"shape {tuple(C.shape)}")
    for arg, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _require(tuple(t.shape) == (heads,), op, arg, f"shape ({heads},)", f"shape {tuple(t.shape)}")
    _require(tuple(ssm_state.shape[1:]) == (heads, head_dim, d_state), op, "ssm_state",
             f"[num_slots, {heads}, {head_dim}, {d_state}]", f"shape {tuple(ssm_state.shape)}")


@torch.library.custom_op("pagedpack::selective_scan_varlen", mutates_args=("ssm_state",))
def selective_scan_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                          dt_bias: Tensor | None, ssm_state: Tensor, state_indices: Tensor, cu_seqlens_q: Tensor,
                          has_initial_state: Tensor, dt_softplus: bool = False, dt_min: float = 0.0,
                          dt_max: float | None = None) -> Tensor:
    """The selective state-space scan of each packed sequence, continuing from its state.

    Per token and head ``h`` (of group ``g = h // (num_heads // n_groups)``):
    ``dt' = clamp(softplus?(dt + dt_bias), dt_min, dt_max)`` (``dt_max=None``: no upper bound);
    ``h_state = exp(dt' A[h]) h_state + dt' x ⊗ B[g]``; ``y = h_state C[g] + D[h] x``.
    Mamba (mamba_ssm's ``selective_scan_fn``) is ``num_heads = d_inner``, ``head_dim = 1``,
    ``A [d_inner, d_state]``; Mamba2's SSD (``mamba_chunk_scan_combined``) is ``A [num_heads]``,
    one decay per head.

    Args:
        x: ``[T, num_heads, head_dim]``.
        dt: ``[T, num_heads]``, the time step before ``dt_bias`` / softplus / the clamp.
        A: ``[num_heads]`` or ``[num_heads, d_state]`` (negative).
        B, C: ``[T, n_groups, d_state]``.
        D: ``[num_heads]`` or None (the skip connection).
        dt_bias: ``[num_heads]`` or None.
        ssm_state: ``[num_slots, num_heads, head_dim, d_state]``, mutated.
        state_indices, cu_seqlens_q, has_initial_state: as in the module docstring.

    Returns:
        ``[T, num_heads, head_dim]`` in ``x``'s dtype.
    """
    checked = arguments_checked()
    if not checked:
        _check_scan(x, dt, A, B, C, D, dt_bias, ssm_state)
        _check_varlen("selective_scan_varlen", ssm_state, state_indices, cu_seqlens_q, has_initial_state, x=x, dt=dt,
                      A=A, B=B, C=C, D=D, dt_bias=dt_bias, ssm_state=ssm_state)
    native = _native(x, ssm_state)
    if native is None or not checked:
        sequences = _sequences(cu_seqlens_q, state_indices, has_initial_state, "selective_scan_varlen", x.shape[0],
                               ssm_state.shape[0])
    if native is not None:
        return native.selective_scan_varlen(x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, cu_seqlens_q,
                                            has_initial_state, dt_softplus, dt_min, dt_max)
    dtype = _compute_dtype(x)
    heads, groups = x.shape[1], B.shape[1]
    step = dt.to(dtype) + (0 if dt_bias is None else dt_bias.to(dtype))
    step = (F.softplus(step) if dt_softplus else step).clamp(dt_min, dt_max)  # [T, H]
    decay_rate = (A.to(dtype) if A.dim() == 2 else A.to(dtype)[:, None].expand(heads, B.shape[2]))  # [H, N]
    B, C = (t.to(dtype).repeat_interleave(heads // groups, dim=1) for t in (B, C))  # [T, H, N]
    xs = x.to(dtype)
    out = torch.empty_like(x)
    for start, end, slot, initial in sequences:
        state = ssm_state[slot].to(dtype) if initial else x.new_zeros(ssm_state.shape[1:], dtype=dtype)  # [H, P, N]
        for t in range(start, end):
            decay = torch.exp(step[t, :, None] * decay_rate)  # [H, N]
            state = state * decay[:, None, :] + (step[t, :, None] * xs[t])[:, :, None] * B[t, :, None, :]
            y = (state * C[t, :, None, :]).sum(-1)  # [H, P]
            out[t] = (y if D is None else y + D.to(dtype)[:, None] * xs[t]).to(x.dtype)
        if slot >= 0:
            ssm_state[slot] = state.to(ssm_state.dtype)
    return out


@selective_scan_varlen.register_fake
def _(x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, cu_seqlens_q, has_initial_state, dt_softplus=False,
      dt_min=0.0, dt_max=None):
    _check_scan(x, dt, A, B, C, D, dt_bias, ssm_state)
    _check_varlen("selective_scan_varlen", ssm_state, state_indices, cu_seqlens_q, has_initial_state, x=x, dt=dt,
                  A=A, B=B, C=C, D=D, dt_bias=dt_bias, ssm_state=ssm_state)
    return torch.empty_like(x)


@torch.library.custom_op("pagedpack::chunk_selective_scan", mutates_args=())
def chunk_selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                         dt_bias: Tensor | None, dt_softplus: bool = False, dt_min: float = 0.0,
                         dt_max: float | None = None) -> Tensor:
    """The selective scan of ``batch`` sequences of ``T`` tokens each, every one from a zero state, its
    final state dropped (mamba_ssm's ``mamba_chunk_scan_combined`` / ``selective_scan_fn`` on a
    prompt): the capture's single node for a Mamba or Mamba2 layer's scan
    (:mod:`pagedpack.models.seams`), which the ``recurrent_state`` pass rewrites to
    :func:`selective_scan_varlen`.

    Args: ``x [batch, T, num_heads, head_dim]``, ``dt [batch, T, num_heads]``,
    ``B, C [batch, T, n_groups, d_state]``, the rest as :func:`selective_scan_varlen`'s. Returns
    ``[batch, T, num_heads, head_dim]`` in ``x``'s dtype.
    """
    _check_ranks("chunk_selective_scan", x=(x, "[batch, T, num_heads, head_dim]"),
                 B=(B, "[batch, T, n_groups, d_state]"))
    scratch = x.new_zeros((1, *x.shape[2:], B.shape[3]))
    out = selective_scan_varlen(*(t.flatten(0, 1) for t in (x, dt)), A, *(t.flatten(0, 1) for t in (B, C)), D,
                                dt_bias, scratch, *_fresh_sequences(x), dt_softplus, dt_min, dt_max)
    return out.unflatten(0, x.shape[:2])


@chunk_selective_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, dt_softplus=False, dt_min=0.0, dt_max=None):
    return torch.empty_like(x)

