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
        out = pagedpack.paged_attention<scale, sliding_window?, logits_soft_cap?, attention_chunk_size?>(
            query, key_cache_out, value_cache_out, block_table, cu_seqlens_q, seq_lens, alibi_slopes?, sinks?)

    ``reshape_and_cache`` scatters rows to ``slot_mapping`` (``-1`` skipped); ``paged_attention``
    gathers each sequence's blocks through ``block_table``, pads the packed queries per sequence,
    and applies an explicit bottom-right causal mask built from ``seq_lens`` and the per-sequence
    query lengths ``cu_seqlens_q[1:] - cu_seqlens_q[:-1]`` (the semantics of
    :func:`pagedpack.kernels.ops.paged_attention`). The attention parameters
    (:class:`pagedpack.kernels.attention_params.AttentionParams`) are attributes and optional
    inputs of the node: a parameter that is None is absent from it.

``"com.microsoft"``
    one ``com.microsoft.PagedAttention`` node per site (onnxruntime's contrib op, CUDA provider
    only), which writes the caches itself. Its schema takes float16/bfloat16 only, int32
    metadata and ``past_seqlens = seq_lens - q_lens``; a sliding window, a soft cap and sinks map
    to its ``local_window_size``, ``softcap`` and ``head_sink``, ALiBi and attention chunks are refused
    (the schema has neither); see :func:`_ort_translation`.
"""
from __future__ import annotations

import copy
import operator
from typing import Optional, TypeVar, Union

import onnx
import onnx_ir as ir
import onnxscript
import onnxscript.optimizer
import torch
import torch.fx
from onnxscript import BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64
from onnxscript import opset20 as op

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.kernels.attention_params import AttentionParams, op_arguments

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
    order of the cache inputs. The later reads of a written pair (layers sharing its cache,
    :mod:`pagedpack.passes.kv_sharing`) stay ``paged_attention`` calls, on the updated caches.
    Raises ``ValueError`` if a cache write has no read after it."""
    gm = copy.deepcopy(graph_module)
    graph = gm.graph
    cache_inputs = [n for n in graph.nodes if n.op == "placeholder" and "_cache_" in n.target]
    order = {node: i for i, node in enumerate(graph.nodes)}
    new_caches: dict[torch.fx.Node, torch.fx.Node] = {}
    for write in [n for n in graph.nodes if n.target is _ops.reshape_and_cache.default]:
        cache_write = op_arguments(write)
        key_cache, value_cache = cache_write["key_cache"], cache_write["value_cache"]
        reads = sorted((u for u in key_cache.users if u.target is _ops.paged_attention.default
                        and op_arguments(u)["key_cache"] is key_cache), key=order.__getitem__)
        if not reads or order[reads[0]] < order[write]:
            raise ValueError(f"graph: expected the paged_attention calls reading {key_cache.target} after its write")
        read, *sharing = reads
        attend = op_arguments(read)
        with graph.inserting_before(read):
            fused = graph.call_function(
                _ops.paged_attention_functional.default,
                (attend["query"], cache_write["key"], cache_write["value"], key_cache, value_cache,
                 attend["block_table"], attend["cu_seqlens_q"], attend["seq_lens"], cache_write["slot_mapping"]),
                AttentionParams.from_node(read).op_kwargs())
            out, new_caches[key_cache], new_caches[value_cache] = (
                graph.call_function(operator.getitem, (fused, i)) for i in range(3))
        read.replace_all_uses_with(out)
        graph.erase_node(read)
        graph.erase_node(write)
        for later in sharing:
            later.replace_input_with(key_cache, new_caches[key_cache])
            later.replace_input_with(value_cache, new_caches[value_cache])
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
                    cu_seqlens_q: TIndex, seq_lens: TIndex, scale: float, alibi_slopes: Optional[FLOAT] = None,
                    sinks: Optional[FLOAT] = None, sliding_window: int = 0, logits_soft_cap: float = 0.0,
                    attention_chunk_size: int = 0) -> TFloat:
    """Causal attention of packed ``query [T, H, D]`` over the paged caches; ``[T, H, D_v]``.

    Queries are scattered to ``[B, max_q_len, H, D]``; keys and values of each sequence are
    gathered through ``block_table`` to ``[B, max_blocks_per_seq * block_size, Hkv, D]``; row
    ``i`` of sequence ``b`` (position ``p = seq_lens[b] - q_len[b] + i``) sees keys ``j <= p``
    (bottom-right). Scores and softmax in fp32; a row that sees no key gives zeros. Grouped-query
    attention by broadcasting the ``H / Hkv`` query heads of a group against their KV head.

    Attention parameters (absent = not applied): attribute ``sliding_window`` (``w >= 1``; 0, the
    default, is none) also masks keys ``j <= p - w``; attribute ``attention_chunk_size`` (``c >= 1``;
    0 is none) keeps keys with ``j // c == p // c`` only; attribute ``logits_soft_cap`` (``> 0``; 0.0,
    the default, is none) gives ``cap * tanh(scores / cap)``; optional input ``alibi_slopes``
    (float ``[H]``) adds ``slope * (j - p)``; optional input ``sinks`` (float ``[H]``) joins the
    softmax denominator, applied as ``softmax(s) * sigmoid(logsumexp(s) - sink)`` (equal to
    softmax over ``[s, sink]`` without the sink column). An absent optional input cannot be read
    inside a function, so it is tested with ``OptionalHasElement`` and its values come through
    ``Gemm``'s optional bias ``C`` (zeros when absent)."""
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
    cap = op.Constant(value_float=logits_soft_cap)
    if op.Greater(cap, op.Constant(value_float=0.0)):
        capped = op.Mul(op.Tanh(op.Div(scores, cap)), cap)
    else:
        capped = op.Identity(scores)
    # offset[b, i, j] = j - p(b, i), p = seq_lens[b] - q_lens[b] + i: the key's position relative to the row's
    rows = op.Range(op.Constant(value_int=0), op.Squeeze(max_q_len, zero), op.Constant(value_int=1))
    cols = op.Range(op.Constant(value_int=0), op.Squeeze(kv_len, zero), op.Constant(value_int=1))
    last_visible = op.Add(op.Unsqueeze(op.Sub(kv_lens, q_lens), one), op.Unsqueeze(rows, zero))  # [B, max_q_len]
    key_pos = op.Unsqueeze(cols, op.Constant(value_ints=[0, 1]))  # [1, 1, L]
    query_pos = op.Unsqueeze(last_visible, op.Constant(value_ints=[2]))  # [B, max_q_len, 1]
    offset = op.Sub(key_pos, query_pos)  # [B, max_q_len, L]
    window = op.Constant(value_int=sliding_window)
    in_window = op.Or(op.LessOrEqual(window, op.Constant(value_int=0)), op.Greater(offset, op.Neg(window)))
    chunk = op.Constant(value_int=attention_chunk_size)
    chunk_or_one = op.Max(chunk, op.Constant(value_int=1))
    same_chunk = op.Equal(op.Div(key_pos, chunk_or_one), op.Div(query_pos, chunk_or_one))
    in_chunk = op.Or(op.LessOrEqual(chunk, op.Constant(value_int=0)), same_chunk)
    visible = op.And(op.And(op.LessOrEqual(offset, op.Constant(value_int=0)), in_window), in_chunk)
    visible = op.Unsqueeze(visible, op.Constant(value_ints=[1, 2]))  # [B, 1, 1, max_q_len, L]
    # Per-head values [1, Hkv, G, 1, 1] of the optional inputs (zeros where absent).
    head_shape = op.Concat(one, num_kv_heads, group, one, one, axis=0)
    no_values = op.Reshape(op.Constant(value_floats=[0.0]), op.Constant(value_ints=[1, 1]))
    all_heads = op.ConstantOfShape(op.Concat(one, num_heads, axis=0))  # [1, H] zeros, Gemm's B
    if op.OptionalHasElement(alibi_slopes):
        slopes = op.Reshape(op.Gemm(no_values, all_heads, alibi_slopes), head_shape)
        biased = op.Add(capped, op.Mul(slopes, op.Cast(op.Unsqueeze(offset, op.Constant(value_ints=[1, 2])),
                                                         to=FLOAT.dtype)))
    else:
        biased = op.Identity(capped)
    bias = op.Where(visible, op.Constant(value_float=0.0), op.Constant(value_float=float("-inf")))
    masked = op.Add(biased, bias)
    out = op.MatMul(op.Softmax(masked, axis=-1), v)  # [B, Hkv, G, max_q_len, D_v]
    if op.OptionalHasElement(sinks):
        sink = op.Reshape(op.Gemm(no_values, all_heads, sinks), head_shape)
        row_max = op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1)
        lse = op.Add(op.Log(op.ReduceSum(op.Exp(op.Sub(masked, row_max)), op.Constant(value_ints=[-1]),
                                         keepdims=1)), row_max)
        with_sink = op.Mul(out, op.Sigmoid(op.Sub(lse, sink)))
    else:
        with_sink = op.Identity(out)
    out = with_sink
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
    attribute_types = {ir.AttributeType.FLOAT: float, ir.AttributeType.INT: int}
    return _node_op(PAGEDPACK_DOMAIN, function.name, [v.name for v in ir_function.inputs],
                    [v.name for v in ir_function.outputs],
                    {name: attribute_types[a.type] for name, a in ir_function.attributes.items()},
                    optional=FUNCTION_OPTIONAL_INPUTS)


FUNCTION_OPTIONAL_INPUTS = ("alibi_slopes", "sinks")  # inputs of the functions that may be absent
_CALL_RESHAPE_AND_CACHE, _CALL_PAGED_ATTENTION = (_call_function_op(f) for f in FUNCTIONS)


def _pagedpack_translation(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                           slot_mapping, scale: float, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                           sinks=None, attention_chunk_size=None):
    """The two ``pagedpack`` function calls; the attention parameters by name (the exporter calls
    this with the node's arguments as the op's schema names them), each absent when None."""
    key_cache_out, value_cache_out = _CALL_RESHAPE_AND_CACHE(key, value, key_cache, value_cache, slot_mapping)
    out = _pagedpack_read_translation(query, key_cache_out, value_cache_out, block_table, cu_seqlens_q, seq_lens,
                                      scale, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    return out, key_cache_out, value_cache_out


def _pagedpack_read_translation(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale: float,
                                sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None,
                                attention_chunk_size=None):
    """The ``pagedpack.paged_attention`` call alone: a site reading caches an earlier site wrote in this
    step (KV sharing, :func:`functionalize_caches`), or the read of :func:`_pagedpack_translation`."""
    params = AttentionParams(scale, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    attributes = {}
    if params.sliding_window is not None:
        attributes["sliding_window"] = int(params.sliding_window)
    if params.logits_soft_cap is not None:
        attributes["logits_soft_cap"] = float(params.logits_soft_cap)
    if params.attention_chunk_size is not None:
        attributes["attention_chunk_size"] = int(params.attention_chunk_size)
    per_head = [None if t is None else op.Cast(t, to=FLOAT.dtype) for t in (params.alibi_slopes, params.sinks)]
    return _CALL_PAGED_ATTENTION(query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                                 *per_head, scale=params.scale, **attributes)


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
                              "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink"]
ORT_FLOAT_TYPES = (torch.float16, torch.bfloat16)  # its type constraint T (and T_CACHE without quantisation)
_ORT_PAGED_ATTENTION = _node_op(
    MICROSOFT_DOMAIN, "PagedAttention", ORT_PAGED_ATTENTION_INPUTS, ["output", "key_cache_out", "value_cache_out"],
    {"num_heads": int, "kv_num_heads": int, "scale": float, "is_causal": int, "local_window_size": int,
     "softcap": float},
    optional=("key", "value", "value_cache", "cos_cache", "sin_cache", "slot_mapping", "head_sink"))


def ort_unsupported(params: AttentionParams) -> list[str]:
    """The attention parameters ``com.microsoft.PagedAttention`` cannot express, each with why."""
    lacking = {"alibi_slopes": "position-bias input", "attention_chunk_size": "chunked local attention"}
    return [f"{name}: com.microsoft.PagedAttention's schema has no {what} (its only score modifications are "
            f"local_window_size, softcap and head_sink); use attention='pagedpack'"
            for name, what in lacking.items() if getattr(params, name) is not None]


def ort_attributes(params: AttentionParams) -> dict[str, float | int]:
    """``com.microsoft.PagedAttention`` attributes for ``params`` (None: the attribute is absent).

    ``local_window_size`` counts the keys *before* the row's own one (onnxruntime's GQA/PagedAttention
    kernels keep ``local_window_size + 1`` keys, FlashAttention's ``window_size_left``), so a window
    of ``w`` keys is ``w - 1``; ``softcap`` is ``cap * tanh(scores / cap)`` on the scaled scores, as
    ours. Raises ``ValueError`` naming a parameter the schema cannot express (:func:`ort_unsupported`)."""
    refused = ort_unsupported(params)
    if refused:
        raise ValueError("; ".join(refused))
    attributes = {}
    if params.sliding_window is not None:
        attributes["local_window_size"] = int(params.sliding_window) - 1
    if params.logits_soft_cap is not None:
        attributes["softcap"] = float(params.logits_soft_cap)
    return attributes


def _ort_translation(query, key, value, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
                     slot_mapping, scale: float, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                     sinks=None, attention_chunk_size=None):
    """One ``com.microsoft.PagedAttention`` node, which writes this step's keys and values
    (to ``slot_mapping``) and attends: activations as ``[T, heads * head_dim]``, metadata int32,
    ``past_seqlens = seq_lens - q_lens``, ``is_causal=1`` (bottom-right, as pagedpack's op).
    Parameters by name (:func:`ort_attributes`); ``sinks`` become ``head_sink`` in the query's dtype
    (the schema's type T)."""
    params = AttentionParams(scale, sliding_window, logits_soft_cap, alibi_slopes, sinks, attention_chunk_size)
    attributes = ort_attributes(params)
    num_heads, head_dim, head_dim_v = query.shape[1], query.shape[2], value_cache.shape[3]
    num_kv_heads = key_cache.shape[2]
    cu = op.Cast(cu_seqlens_q, to=INT32.dtype)
    q_lens = op.Sub(op.Slice(cu, op.Constant(value_ints=[1]), op.Constant(value_ints=[2**31 - 1])),
                    op.Slice(cu, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])))
    head_sink = None if params.sinks is None else op.CastLike(params.sinks, query)
    out, key_cache_out, value_cache_out = _ORT_PAGED_ATTENTION(
        op.Reshape(query, op.Constant(value_ints=[0, num_heads * head_dim])),
        op.Reshape(key, op.Constant(value_ints=[0, num_kv_heads * head_dim])),
        op.Reshape(value, op.Constant(value_ints=[0, num_kv_heads * head_dim_v])), key_cache, value_cache, cu,
        op.Sub(op.Cast(seq_lens, to=INT32.dtype), q_lens), op.Cast(block_table, to=INT32.dtype), None, None,
        op.Cast(slot_mapping, to=INT32.dtype), head_sink,
        num_heads=num_heads, kv_num_heads=num_kv_heads, scale=params.scale, is_causal=1, **attributes)
    out = op.Reshape(out, op.Constant(value_ints=[0, num_heads, head_dim_v]))
    return out, key_cache_out, value_cache_out


def unsupported_params(graph_module: torch.fx.GraphModule, attention: str) -> list[str]:
    """What the ``attention`` lowering cannot translate in ``graph_module`` (a step graph, in-place or
    functionalised), one line per site and parameter; empty when all can be. An exporter calls this
    before ``torch.onnx.export`` to refuse with a plain ``ValueError`` (the translation raises too,
    but inside the exporter's own error)."""
    if attention != "com.microsoft":
        return []
    sites = [n for n in graph_module.graph.nodes
             if n.target in (_ops.paged_attention.default, _ops.paged_attention_functional.default)]
    written = {op_arguments(n)["key_cache"] for n in graph_module.graph.nodes
               if n.target is _ops.reshape_and_cache.default}
    seen, unsupported = set(), []
    for i, node in enumerate(sites):
        reasons = ort_unsupported(AttentionParams.from_node(node))
        cache = op_arguments(node)["key_cache"]
        if node.target is _ops.paged_attention.default and (cache in seen or cache not in written):
            reasons.append("reads a KV cache an earlier site wrote (KV sharing), and com.microsoft.PagedAttention "
                           "always writes the step's keys and values itself; use attention='pagedpack'")
        seen.add(cache)
        unsupported += [f"attention site {i} ({node.name}): {reason}" for reason in reasons]
    return unsupported


ATTENTION_TARGETS = {
    "pagedpack": _pagedpack_translation,
    "com.microsoft": _ort_translation,
}


def translation_table(attention: str) -> dict:
    """``custom_translation_table`` for ``torch.onnx.export``; ``ValueError`` for an unknown target."""
    if not isinstance(attention, str) or attention not in ATTENTION_TARGETS:
        raise ValueError(f"attention: expected one of {list(ATTENTION_TARGETS)}, got {attention!r}")
    table = {_ops.paged_attention_functional.default: ATTENTION_TARGETS[attention]}
    if attention == "pagedpack":  # a read alone (KV sharing); com.microsoft's is refused (unsupported_params)
        table[_ops.paged_attention.default] = _pagedpack_read_translation
    return table
