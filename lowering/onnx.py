"""The ``onnx`` lowering: the step graph -> an ONNX model that onnxruntime runs as is.

ONNX has no in-place update, so each attention site's ``reshape_and_cache`` + ``paged_attention``
pair first becomes one functional ``pagedpack::paged_attention_functional`` call
(:func:`functionalize_caches`): the KV caches are model inputs ``key_cache_i`` / ``value_cache_i``
*and* outputs ``key_cache_out_i`` / ``value_cache_out_i``. ``torch.onnx.export`` then translates
that op with one of two tables (:data:`ATTENTION_TARGETS`):

``"pagedpack"`` (default, runs on any onnxruntime provider)
    two calls of ONNX functions in the ``pagedpack`` domain, whose bodies are standard ops
    (opset :data:`OPSET`) and travel inside the model::

        key_cache_out, value_cache_out = pagedpack.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        out = pagedpack.paged_attention<scale>(query, key_cache_out, value_cache_out, block_table,
                                               cu_seqlens_q, seq_lens)

    ``reshape_and_cache`` scatters rows to ``slot_mapping`` (``-1`` skipped); ``paged_attention``
    gathers each sequence's blocks through ``block_table``, pads the packed queries per sequence,
    and applies an explicit bottom-right causal mask built from ``seq_lens`` and the per-sequence
    query lengths ``cu_seqlens_q[1:] - cu_seqlens_q[:-1]`` (the semantics of
    :func:`pagedpack.kernels.ops.paged_attention`).

``"com.microsoft"``
    one ``com.microsoft.PagedAttention`` node per site (onnxruntime's contrib op, CUDA provider
    only), which writes the caches itself. Its schema takes float16/bfloat16 only, int32
    metadata and ``past_seqlens = seq_lens - q_lens``; see :func:`_ort_translation`.
"""
from __future__ import annotations

import copy
import operator
from typing import TypeVar, Union

import onnx
import onnx_ir as ir
import onnxscript
import onnxscript.optimizer
import torch
import torch.fx
from onnxscript import BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64
from onnxscript import opset20 as op

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack.*)

OPSET = 20  # the default-domain opset of the exported model and of the function bodies
PAGEDPACK_DOMAIN = onnxscript.values.Opset("pagedpack", 1)
MICROSOFT_DOMAIN = onnxscript.values.Opset("com.microsoft", 1)
_ops = torch.ops.pagedpack
# Type parameters of the functions' signatures (the exporter reads the outputs off them).
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16, DOUBLE])
TCache = TypeVar("TCache", bound=Union[FLOAT, FLOAT16, BFLOAT16, DOUBLE])
TIndex = TypeVar("TIndex", bound=Union[INT32, INT64])


def functionalize_caches(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the step graph where each ``reshape_and_cache`` + ``paged_attention`` pair on
    the same caches is one ``paged_attention_functional`` call, and the updated caches are
    appended to the outputs: ``(logits, key_cache_out_0, value_cache_out_0, ...)`` in the
    order of the cache inputs. Raises ``ValueError`` if a cache write has no matching read."""
    gm = copy.deepcopy(graph_module)
    graph = gm.graph
    cache_inputs = [n for n in graph.nodes if n.op == "placeholder" and "_cache_" in n.target]
    new_caches: dict[torch.fx.Node, torch.fx.Node] = {}
    for write in [n for n in graph.nodes if n.target is _ops.reshape_and_cache.default]:
        key, value, key_cache, value_cache, slot_mapping = write.args
        reads = [u for u in key_cache.users if u.target is _ops.paged_attention.default and u.args[1] is key_cache]
        if len(reads) != 1:
            raise ValueError(f"graph: expected one paged_attention reading {key_cache.target}, got {len(reads)}")
        read = reads[0]
        query, _, _, block_table, cu_seqlens_q, seq_lens, scale = read.args
        with graph.inserting_before(read):
            fused = graph.call_function(_ops.paged_attention_functional.default,
                                        (query, key, value, key_cache, value_cache, block_table,
                                         cu_seqlens_q, seq_lens, slot_mapping, scale))
            out, new_caches[key_cache], new_caches[value_cache] = (
                graph.call_function(operator.getitem, (fused, i)) for i in range(3))
        read.replace_all_uses_with(out)
        graph.erase_node(read)
        graph.erase_node(write)
    output = next(n for n in graph.nodes if n.op == "output")
    (logits,) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    output.args = ((logits, *(new_caches[c] for c in cache_inputs)),)
    graph.lint()
    gm.recompile()
    return gm


# --- the pagedpack domain: functions with standard-op bodies -------------------------------

@onnxscript.script(PAGEDPACK_DOMAIN, default_opset=op)
def reshape_and_cache(key: TFloat, value: TFloat, key_cache: TCache, value_cache: TCache,
                      slot_mapping: TIndex) -> tuple[TCache, TCache]:
    """Rows ``t`` of ``key [T, Hkv, D]`` / ``value`` written to slot ``slot_mapping[t]`` of the
    ``[num_blocks, block_size, Hkv, D]`` caches (``-1``: not written); returns the new caches."""
    write = op.GreaterOrEqual(slot_mapping, op.CastLike(op.Constant(value_int=0), slot_mapping))
    slots = op.Cast(op.Compress(slot_mapping, write, axis=0), to=INT64.dtype)
    # (block, offset) pairs [W, 2]: ScatterND writes [Hkv, D] rows of the 4-D caches directly.
    block_size = op.Shape(key_cache, start=1, end=2)
    index = op.Concat(op.Unsqueeze(op.Div(slots, block_size), op.Constant(value_ints=[1])),
                      op.Unsqueeze(op.Mod(slots, block_size), op.Constant(value_ints=[1])), axis=1)
    key_cache_out = op.ScatterND(key_cache, index, op.CastLike(op.Compress(key, write, axis=0), key_cache))
    value_cache_out = op.ScatterND(value_cache, index, op.CastLike(op.Compress(value, write, axis=0), value_cache))
    return key_cache_out, value_cache_out


@onnxscript.script(PAGEDPACK_DOMAIN, default_opset=op)
def paged_attention(query: TFloat, key_cache: TCache, value_cache: TCache, block_table: TIndex,
                    cu_seqlens_q: TIndex, seq_lens: TIndex, scale: float) -> TFloat:
    """Causal attention of packed ``query [T, H, D]`` over the paged caches; ``[T, H, D_v]``.

    Queries are scattered to ``[B, max_q_len, H, D]``; keys and values of each sequence are
    gathered through ``block_table`` to ``[B, max_blocks_per_seq * block_size, Hkv, D]``; row
    ``i`` of sequence ``b`` sees keys ``j <= seq_lens[b] - q_len[b] + i`` (bottom-right).
    Scores and softmax in fp32; a row that sees no key gives zeros. Grouped-query attention by
    broadcasting the ``H / Hkv`` query heads of a group against their KV head."""
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    minus_one = op.Constant(value_ints=[-1])
    cu = op.Cast(cu_seqlens_q, to=INT64.dtype)
    kv_lens = op.Cast(seq_lens, to=INT64.dtype)
    ends = op.Slice(cu, one, op.Constant(value_ints=[9223372036854775807]))
    starts = op.Slice(cu, zero, minus_one)
    q_lens = op.Sub(ends, starts)  # [B]

    # Token t of the packed row is row i(t) of sequence s(t).
    tokens = op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(query, start=0, end=1), zero),
                      op.Constant(value_int=1))
    seq_of_token = op.ReduceSum(
        op.Cast(op.GreaterOrEqual(op.Unsqueeze(tokens, one), op.Unsqueeze(ends, zero)), to=INT64.dtype),
        one, keepdims=0)
    row_of_token = op.Sub(tokens, op.Gather(starts, seq_of_token))
    index = op.Concat(op.Unsqueeze(seq_of_token, one), op.Unsqueeze(row_of_token, one), axis=1)  # [T, 2]

    num_seqs = op.Shape(seq_lens)
    max_q_len = op.ReduceMax(q_lens, zero, keepdims=1)  # [1]
    num_heads = op.Shape(query, start=1, end=2)
    head_dim = op.Shape(query, start=2, end=3)
    num_kv_heads = op.Shape(key_cache, start=2, end=3)
    group = op.Div(num_heads, num_kv_heads)
    kv_len = op.Mul(op.Shape(block_table, start=1, end=2), op.Shape(key_cache, start=1, end=2))  # L
    # (Shapes spelled out, no -1: Reshape cannot infer a dim of an empty tensor.)
    padded_shape = op.Concat(num_seqs, max_q_len, op.Shape(query, start=1), axis=0)
    padded = op.ScatterND(op.CastLike(op.ConstantOfShape(padded_shape), query), index, query)
    # [B, Hkv, G, max_q_len, D] in fp32
    grouped = op.Reshape(padded, op.Concat(num_seqs, max_q_len, num_kv_heads, group, head_dim, axis=0))
    q = op.Cast(op.Transpose(grouped, perm=[0, 2, 3, 1, 4]), to=FLOAT.dtype)

    # [B, Hkv, 1, L, D]: each sequence's L = max_blocks_per_seq * block_size cache rows, in token order
    k = op.Gather(key_cache, block_table, axis=0)
    k = op.Reshape(k, op.Concat(num_seqs, kv_len, op.Shape(key_cache, start=2), axis=0))
    k = op.Cast(op.Unsqueeze(op.Transpose(k, perm=[0, 2, 1, 3]), op.Constant(value_ints=[2])), to=FLOAT.dtype)
    v = op.Gather(value_cache, block_table, axis=0)
    v = op.Reshape(v, op.Concat(num_seqs, kv_len, op.Shape(value_cache, start=2), axis=0))
    v = op.Cast(op.Unsqueeze(op.Transpose(v, perm=[0, 2, 1, 3]), op.Constant(value_ints=[2])), to=FLOAT.dtype)

    scores = op.Mul(op.MatMul(q, op.Transpose(k, perm=[0, 1, 2, 4, 3])), op.Cast(scale, to=FLOAT.dtype))
    # visible[b, i, j] = j <= seq_lens[b] - q_lens[b] + i
    rows = op.Range(op.Constant(value_int=0), op.Squeeze(max_q_len, zero), op.Constant(value_int=1))
    cols = op.Range(op.Constant(value_int=0), op.Squeeze(kv_len, zero), op.Constant(value_int=1))
    last_visible = op.Add(op.Unsqueeze(op.Sub(kv_lens, q_lens), one), op.Unsqueeze(rows, zero))  # [B, max_q_len]
    visible = op.LessOrEqual(op.Unsqueeze(cols, op.Constant(value_ints=[0, 1])),
                             op.Unsqueeze(last_visible, op.Constant(value_ints=[2])))
    visible = op.Unsqueeze(visible, op.Constant(value_ints=[1, 2]))  # [B, 1, 1, max_q_len, L]
    bias = op.Where(visible, op.Constant(value_float=0.0), op.Constant(value_float=float("-inf")))
    out = op.MatMul(op.Softmax(op.Add(scores, bias), axis=-1), v)  # [B, Hkv, G, max_q_len, D_v]
    # A row that sees no key (softmax of all -inf is NaN) gives zeros.
    sees_a_key = op.ReduceMax(op.Cast(visible, to=INT64.dtype), op.Constant(value_ints=[-1]), keepdims=1)
    out = op.CastLike(op.Where(op.Cast(sees_a_key, to=BOOL.dtype), out, op.Constant(value_float=0.0)), query)
    out = op.Transpose(out, perm=[0, 3, 1, 2, 4])
    out = op.Reshape(out, op.Concat(num_seqs, max_q_len, num_heads, op.Shape(value_cache, start=3), axis=0))
    return op.GatherND(out, index)


FUNCTIONS = (reshape_and_cache, paged_attention)
_ANY_TENSOR = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "int32", "int64")]
_ATTR_TYPES = {float: onnx.defs.OpSchema.AttrType.FLOAT, int: onnx.defs.OpSchema.AttrType.INT}


def _node_op(opset: onnxscript.values.Opset, name: str, inputs: list[str], outputs: list[str],
             attributes: dict[str, type], optional: tuple[str, ...] = ()) -> onnxscript.values.Op:
    """An op whose call records one plain ``<domain>.<name>`` node with these inputs (in this
    order; ``optional`` ones may be None), outputs and attributes; any tensor type."""
    option = onnx.defs.OpSchema.FormalParameterOption
    schema = onnx.defs.OpSchema(
        name, opset.domain, opset.version,
        inputs=[onnx.defs.OpSchema.FormalParameter(n, f"T{i}", param_option=option.Optional if n in optional
                                                   else option.Single) for i, n in enumerate(inputs)],
        outputs=[onnx.defs.OpSchema.FormalParameter(n, f"O{i}") for i, n in enumerate(outputs)],
        type_constraints=[(f"T{i}", _ANY_TENSOR, "") for i in range(len(inputs))]
        + [(f"O{i}", _ANY_TENSOR, "") for i in range(len(outputs))],
        attributes=[onnx.defs.OpSchema.Attribute(n, _ATTR_TYPES[t], required=False) for n, t in attributes.items()],
    )
    return onnxscript.values.Op(opset, name, schema)


def _call_function_op(function: onnxscript.OnnxFunction) -> onnxscript.values.Op:
    """Records a plain ``pagedpack.<name>`` node, for which :func:`add_functions` later supplies
    ``function`` as the model-local definition. (Calling the OnnxFunction directly records the
    same node, but ``torch.onnx.export``'s opset conversion then inlines it.)"""
    ir_function = function.function_ir
    return _node_op(PAGEDPACK_DOMAIN, function.name, [v.name for v in ir_function.inputs],
                    [v.name for v in ir_function.outputs], dict.fromkeys(ir_function.attributes, float))


_CALL_RESHAPE_AND_CACHE, _CALL_PAGED_ATTENTION = (_call_function_op(f) for f in FUNCTIONS)


def _pagedpack_translation(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                           slot_mapping, scale: float):
    key_cache_out, value_cache_out = _CALL_RESHAPE_AND_CACHE(key, value, key_cache, value_cache, slot_mapping)
    out = _CALL_PAGED_ATTENTION(query, key_cache_out, value_cache_out, block_table, cu_seqlens_q, seq_lens,
                                scale=scale)
    return out, key_cache_out, value_cache_out


def optimize(model: ir.Model) -> None:
    """Fold constants and drop dead code (onnxscript's optimizer, without inlining), then
    :func:`add_functions`; in place."""
    onnxscript.optimizer.optimize_ir(model, inline=False)
    add_functions(model)


def add_functions(model: ir.Model) -> None:
    """Give ``model`` the definitions of the ``pagedpack`` functions its nodes call."""
    used = {node.op_type for node in model.graph.all_nodes() if node.domain == PAGEDPACK_DOMAIN.domain}
    for function in FUNCTIONS:
        if function.name in used:
            definition = ir.serde.deserialize_function(function.to_function_proto())
            model.functions[definition.identifier()] = definition
    if used:
        model.opset_imports[PAGEDPACK_DOMAIN.domain] = PAGEDPACK_DOMAIN.version


# --- com.microsoft.PagedAttention ------------------------------------------------------------

# Inputs in the positions of onnxruntime's schema (contrib_defs, PagedAttention, since version 1).
ORT_PAGED_ATTENTION_INPUTS = ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
                              "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping"]
ORT_FLOAT_TYPES = (torch.float16, torch.bfloat16)  # its type constraint T (and T_CACHE without quantisation)
_ORT_PAGED_ATTENTION = _node_op(
    MICROSOFT_DOMAIN, "PagedAttention", ORT_PAGED_ATTENTION_INPUTS, ["output", "key_cache_out", "value_cache_out"],
    {"num_heads": int, "kv_num_heads": int, "scale": float, "is_causal": int},
    optional=("key", "value", "value_cache", "cos_cache", "sin_cache", "slot_mapping"))


def _ort_translation(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                     slot_mapping, scale: float):
    """One ``com.microsoft.PagedAttention`` node, which writes this step's keys and values
    (to ``slot_mapping``) and attends: activations as ``[T, heads * head_dim]``, metadata int32,
    ``past_seqlens = seq_lens - q_lens``, ``is_causal=1`` (bottom-right, as pagedpack's op)."""
    num_heads, head_dim, head_dim_v = query.shape[1], query.shape[2], value_cache.shape[3]
    num_kv_heads = key_cache.shape[2]
    cu = op.Cast(cu_seqlens_q, to=INT32.dtype)
    q_lens = op.Sub(op.Slice(cu, op.Constant(value_ints=[1]), op.Constant(value_ints=[2**31 - 1])),
                    op.Slice(cu, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])))
    out, key_cache_out, value_cache_out = _ORT_PAGED_ATTENTION(
        op.Reshape(query, op.Constant(value_ints=[0, num_heads * head_dim])),
        op.Reshape(key, op.Constant(value_ints=[0, num_kv_heads * head_dim])),
        op.Reshape(value, op.Constant(value_ints=[0, num_kv_heads * head_dim_v])), key_cache, value_cache, cu,
        op.Sub(op.Cast(seq_lens, to=INT32.dtype), q_lens), op.Cast(block_table, to=INT32.dtype), None, None,
        op.Cast(slot_mapping, to=INT32.dtype),
        num_heads=num_heads, kv_num_heads=num_kv_heads, scale=scale, is_causal=1)
    out = op.Reshape(out, op.Constant(value_ints=[0, num_heads, head_dim_v]))
    return out, key_cache_out, value_cache_out


ATTENTION_TARGETS = {
    "pagedpack": _pagedpack_translation,
    "com.microsoft": _ort_translation,
}


def translation_table(attention: str) -> dict:
    """``custom_translation_table`` for ``torch.onnx.export``; ``ValueError`` for an unknown target."""
    if not isinstance(attention, str) or attention not in ATTENTION_TARGETS:
        raise ValueError(f"attention: expected one of {list(ATTENTION_TARGETS)}, got {attention!r}")
    return {_ops.paged_attention_functional.default: ATTENTION_TARGETS[attention]}
