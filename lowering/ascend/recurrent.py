"""The ``ascend`` lowering of the recurrent ops (:mod:`pagedpack.kernels.recurrent`), as vllm-ascend runs
Qwen3-Next / Qwen3.5 gated DeltaNets: vllm-ascend main @ 182b75ea (2026-08-22),
``vllm_ascend/ops/gdn.py`` (``AscendGatedDeltaNetAttention._forward_core``).

Per site, over the whole packed step (``T`` rows, ``B`` sequences)::

    causal_conv1d_varlen(x [T, dim], weight [dim, width], bias, conv_state, state_indices, cu_seqlens_q,
                         has_initial_state, activation)
      -> _C_ascend.npu_causal_conv1d_custom(empty_like(x), x, weight.T [width, dim], conv_state, bias,
             query_start_loc_opt=cu_seqlens_q, cache_indices_opt=state_indices,
             initial_state_mode_opt=has_initial_state, num_accepted_tokens_opt=None,
             activation_mode=1 if silu else 0, pad_slot_id=-1, run_mode=0)
    gated_delta_rule_varlen(q, k, v, g, beta, ssm_state, state_indices, cu_seqlens_q, has_initial_state,
                            scale, use_qk_l2norm_in_kernel)
      -> initial = where(has_initial_state, ssm_state[state_indices], 0)       (vllm-ascend: clear_ssm_states)
         out, final = npu.npu_chunk_gated_delta_rule(l2norm(q), l2norm(k), v, beta=beta, initial_state=initial,
             actual_seq_lengths=diff(cu_seqlens_q), scale=scale, g=g.float())
         ssm_state[state_indices] = final

vllm-ascend splits a step by kind, and so does the lowering (two graphs, :class:`pagedpack.lowering.
ascend.graphs.RecurrentSteps` picks one per step): a step with a prefill runs the form above (the
conv with ``run_mode=0``, its decodes riding along as one-row sequences with ``initial_state_mode``
True; vllm-ascend calls ``npu_chunk_gated_delta_rule`` for its prefills when its probe call succeeds,
PR #12647, a Triton kernel otherwise, and splits the decodes of a mixed step off to the decode op,
which computes the same recurrence: here the chunk op takes every row); a decode-only step (every
sequence one row, continuing its state) runs the **decode form** (``decode=True``)::

      -> _C_ascend.npu_causal_conv1d_custom(..., initial_state_mode_opt=None, run_mode=1)
         out = _C_ascend.npu_recurrent_gated_delta_rule(l2norm(q), l2norm(k), v, ssm_state, beta=beta,
             scale=scale, actual_seq_lengths=[cu_seqlens_q[0], diff(cu_seqlens_q)...], ssm_state_indices=
             state_indices (a slot per row: one row a sequence), g=g.float())          (writes ssm_state)

State layouts are production's, not the reference ops': ``conv_state [slots, width - 1, dim]``
(vllm-ascend writes ``conv_state[idx, :state_len, :]``) and ``ssm_state [slots, N_v, D_v, D_k]``
(value-major, the layout ``npu_chunk_gated_delta_rule`` reads and writes); :func:`ascend_state_specs`
gives the runner these shapes. Slot ``-1`` is not taken (the runner's batch builder never emits it,
as for the cache slots). The ops' limits (:func:`violations`) are checked before anything is emitted.
Mamba's selective scan has no Ascend op in production (vllm-ascend has no Mamba scan kernel at all):
the target refuses it (:data:`MISSING_OPS`).
"""
from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch._ops import OpOverload
from torch.fx import Node

import pagedpack.kernels.recurrent  # noqa: F401  (registers torch.ops.pagedpack's recurrent ops)
from pagedpack.lowering.ascend.lower import AscendUnavailableError
from pagedpack.step.contract import StateSpec, state_input_names

aten = torch.ops.aten
VLLM_ASCEND = "vllm-ascend main @ 182b75ea (2026-08-22)"
CONV = torch.ops.pagedpack.causal_conv1d_varlen.default
GATED_DELTA_RULE = torch.ops.pagedpack.gated_delta_rule_varlen.default
# the recurrent ops the ascend target runs, and why it refuses the others
SUPPORTED_OPS = frozenset({"causal_conv1d_varlen", "gated_delta_rule_varlen"})
MISSING_OPS = {
    "selective_scan_varlen": f"production has no Ascend op for Mamba's selective scan / Mamba2's SSD ({VLLM_ASCEND}: "
                             "no scan kernel in csrc/ or vllm_ascend/ops/triton/mamba/, which holds the causal conv, "
                             "lightning attention and state post-processing only)",
    "lightning_attention_varlen": f"production runs MiniMax's lightning attention as a Triton kernel only "
                                  f"({VLLM_ASCEND}: vllm_ascend/ops/triton/mamba/), no registered op to lower to",
}
CHUNK_HEAD_DIM = 128  # npu_chunk_gated_delta_rule: D_k == D_v == 128 (vllm-ascend's probe of the op's constraints)
L2NORM_EPS = 1e-6  # FLA's l2norm_fwd, which vllm-ascend applies to q and k before the call


@dataclass(frozen=True)
class RecurrentOps:
    """The ops the recurrent sites are lowered to: the real ones (:func:`npu_recurrent_ops`) or the
    emulation (:func:`emulated_recurrent_ops`)."""

    causal_conv1d: OpOverload  # _C_ascend.npu_causal_conv1d_custom
    chunk_gated_delta_rule: OpOverload  # npu.npu_chunk_gated_delta_rule (steps with a prefill)
    recurrent_gated_delta_rule: OpOverload  # _C_ascend.npu_recurrent_gated_delta_rule (decode-only steps)


def npu_recurrent_ops() -> RecurrentOps:
    """vllm-ascend's ``torch.ops._C_ascend`` library (loaded by ``vllm_ascend.utils.enable_custom_op``)
    and torch_npu's op; :class:`~pagedpack.lowering.ascend.lower.AscendUnavailableError` naming
    vllm-ascend without it."""
    try:
        importlib.import_module("vllm_ascend.utils").enable_custom_op()
    except ImportError as err:
        raise AscendUnavailableError(f"the ascend target runs recurrent layers with vllm-ascend's custom ops "
                                     f"(torch.ops._C_ascend.npu_causal_conv1d_custom, npu_recurrent_gated_delta_rule);"
                                     f" install vllm-ascend ({err})") from None
    return RecurrentOps(torch.ops._C_ascend.npu_causal_conv1d_custom.default,
                        torch.ops.npu.npu_chunk_gated_delta_rule.default,
                        torch.ops._C_ascend.npu_recurrent_gated_delta_rule.default)


def emulated_recurrent_ops() -> RecurrentOps:
    """The same ops from :mod:`pagedpack.kernels.ascend_emulation`."""
    importlib.import_module("pagedpack.kernels.ascend_emulation")
    return RecurrentOps(torch.ops.pagedpack_C_ascend.npu_causal_conv1d_custom.default,
                        torch.ops.pagedpack_npu.npu_chunk_gated_delta_rule.default,
                        torch.ops.pagedpack_C_ascend.npu_recurrent_gated_delta_rule.default)


def ascend_state_specs(specs: list[StateSpec]) -> list[StateSpec]:
    """``specs`` in production's layouts: ``conv_state (dim, width - 1)`` -> ``(width - 1, dim)``,
    ``ssm_state (N_v, D_k, D_v)`` -> ``(N_v, D_v, D_k)``."""
    def swapped(spec: StateSpec) -> StateSpec:
        *lead, a, b = spec.shape
        return replace(spec, shape=(*lead, b, a))
    return [swapped(spec) for spec in specs]


def _sites(gm: torch.fx.GraphModule, specs: list[StateSpec]) -> list[tuple[Node, StateSpec]]:
    """Each conv / gated-delta-rule call with the state spec of the state input it reads."""
    by_name = dict(zip(state_input_names(specs), specs))
    return [(node, by_name[node.args[3 if node.target is CONV else 5].name]) for node in gm.graph.nodes
            if node.target in (CONV, GATED_DELTA_RULE)]


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, Node) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def violations(gm: torch.fx.GraphModule, specs: list[StateSpec]) -> list[str]:
    """Each site the Ascend ops cannot serve, naming its layer, the op and the limit."""
    out = []
    for node, spec in _sites(gm, specs):
        if node.target is CONV:
            x = _val(node.args[0])
            if x is not None and x.dtype not in (torch.float16, torch.bfloat16):
                out.append(f"{spec.layer}: npu_causal_conv1d_custom takes float16 or bfloat16, got "
                           f"{_name(x.dtype)} [csrc/moe/causal_conv1d/op_host/causal_conv1d_def.cpp]")
            continue
        q, v, g = (_val(node.args[i]) for i in (0, 2, 3))
        if g is not None and g.dim() == 3:
            out.append(f"{spec.layer}: a decay per key channel (Kimi Delta Attention): npu_chunk_gated_delta_rule "
                       "takes g [T, N_v]; production runs KDA in a Triton kernel (vllm_ascend/ops/triton/kda), "
                       "no registered op")
        if v is not None and v.dtype != torch.bfloat16:
            out.append(f"{spec.layer}: npu_chunk_gated_delta_rule takes bfloat16 query/key/value, got "
                       f"{_name(v.dtype)} [REG_OP(ChunkGatedDeltaRule)]")
        if spec.dtype != torch.bfloat16:
            out.append(f"{spec.layer}: npu_chunk_gated_delta_rule takes a bfloat16 initial_state, the state is "
                       f"{_name(spec.dtype)} [vllm_ascend/ops/gdn.py, _chunk_gated_delta_rule_fused]")
        if q is not None and v is not None and not q.shape[-1] == v.shape[-1] == CHUNK_HEAD_DIM:
            out.append(f"{spec.layer}: npu_chunk_gated_delta_rule needs D_k == D_v == {CHUNK_HEAD_DIM}, got "
                       f"{q.shape[-1]} and {v.shape[-1]} [vllm_ascend/ops/gdn.py, _probe_fused_chunk]")
    return out


def lower_recurrent(gm: torch.fx.GraphModule, specs: list[StateSpec], ops: RecurrentOps, *,
                    decode: bool = False) -> int:
    """Replace every conv / gated-delta-rule site of ``gm`` as the module docstring shows, in the form
    of steps with a prefill or (``decode``) of decode-only steps (the state inputs then hold
    :func:`ascend_state_specs` layouts); returns the number of sites. The caller has checked
    :func:`violations`."""
    sites = _sites(gm, specs)
    for node, _ in sites:
        with gm.graph.inserting_before(node):
            if node.target is CONV:
                out = _conv(gm.graph, node, ops, decode)
            else:
                out = (_decode_delta_rule if decode else _gated_delta_rule)(gm.graph, node, ops)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return len(sites)


def _call(graph: torch.fx.Graph, target, *args, **kwargs) -> Node:
    return graph.call_function(target, args, kwargs)


def _conv(graph: torch.fx.Graph, node: Node, ops: RecurrentOps, decode: bool) -> Node:
    x, weight, bias, conv_state, state_indices, cu_seqlens_q, has_initial_state, *rest = node.args
    activation = rest[0] if rest else node.kwargs.get("activation")
    weight_t = _call(graph, aten.t.default, weight)  # [width, dim]; the op makes it contiguous (AutoContiguous)
    return _call(graph, ops.causal_conv1d, _call(graph, aten.empty_like.default, x), x, weight_t, conv_state, bias,
                 cu_seqlens_q, state_indices, None if decode else has_initial_state, None,
                 int(activation == "silu"), -1, int(decode))


def _l2norm(graph: torch.fx.Graph, t: Node) -> Node:
    """FLA's ``l2norm_fwd``: ``t / sqrt(sum(t^2) + eps)`` over the last dim in fp32, back in ``t``'s dtype."""
    t32 = _call(graph, aten._to_copy.default, t, dtype=torch.float32)
    norm = _call(graph, aten.sum.dim_IntList, _call(graph, aten.mul.Tensor, t32, t32), [-1], True)
    scaled = _call(graph, aten.mul.Tensor, t32,
                   _call(graph, aten.rsqrt.default, _call(graph, aten.add.Tensor, norm, L2NORM_EPS)))
    return _call(graph, aten._to_copy.default, scaled, dtype=torch.bfloat16)


def _normed_qk(graph: torch.fx.Graph, node: Node) -> tuple[Node, Node]:
    q, k, *_ = node.args
    rest = node.args[10:]
    l2norm = rest[0] if rest else node.kwargs.get("use_qk_l2norm_in_kernel", False)
    return (_l2norm(graph, q), _l2norm(graph, k)) if l2norm else (q, k)


def _decode_delta_rule(graph: torch.fx.Graph, node: Node, ops: RecurrentOps) -> Node:
    _, _, v, g, beta, ssm_state, state_indices, cu_seqlens_q, _, scale, *_ = node.args
    q, k = _normed_qk(graph, node)
    lengths = _call(graph, aten.cat.default, [_call(graph, aten.slice.Tensor, cu_seqlens_q, 0, 0, 1),
                                              _call(graph, aten.diff.default, cu_seqlens_q)])  # [offset, len...]
    return _call(graph, ops.recurrent_gated_delta_rule, q, k, v, ssm_state,
                 beta=_call(graph, aten._to_copy.default, beta, dtype=torch.bfloat16), scale=float(scale),
                 actual_seq_lengths=lengths, ssm_state_indices=state_indices,
                 g=_call(graph, aten._to_copy.default, g, dtype=torch.float32))


def _gated_delta_rule(graph: torch.fx.Graph, node: Node, ops: RecurrentOps) -> Node:
    _, _, v, g, beta, ssm_state, state_indices, cu_seqlens_q, has_initial_state, scale, *_ = node.args
    q, k = _normed_qk(graph, node)
    slots = _call(graph, aten._to_copy.default, state_indices, dtype=torch.int64)
    gathered = _call(graph, aten.index_select.default, ssm_state, 0, slots)  # [B, N_v, D_v, D_k]
    fresh = _call(graph, aten.view.default, _call(graph, aten.logical_not.default, has_initial_state), [-1, 1, 1, 1])
    initial = _call(graph, aten.masked_fill.Scalar, gathered, fresh, 0.0)
    lengths = _call(graph, aten._to_copy.default, _call(graph, aten.diff.default, cu_seqlens_q), dtype=torch.int32)
    result = _call(graph, ops.chunk_gated_delta_rule, q, k, v, beta=_call(graph, aten._to_copy.default, beta,
                                                                          dtype=torch.bfloat16),
                   initial_state=initial, actual_seq_lengths=lengths, scale=float(scale),
                   g=_call(graph, aten._to_copy.default, g, dtype=torch.float32))
    final = _call(graph, operator.getitem, result, 1)
    _call(graph, aten.index_put_.default, ssm_state, [slots], final)
    return _call(graph, operator.getitem, result, 0)
