"""The ``pagedpack`` ONNX functions (:mod:`pagedpack.lowering.onnx.functions`) on their own, run by
onnxruntime's CPU provider.

Each function is called from a one-node model (``onnx.checker`` full check passes) and compared
with independent references: ``paged_attention`` with the explicit-mask fp32 attention of
``test_ops`` (GRID of lengths, block sizes, head dims and GQA ratios; fp16 within the error the
reference itself has in fp16; rows that see no key as zeros, as the PyTorch op gives),
``reshape_and_cache`` with a cache written token by token here, and the two chained as in a step
(packed steps drawn by hypothesis) with the reference on each sequence's whole K/V.
"""
import functools
import warnings

import onnx
import onnxruntime
import pytest
import torch
from hypothesis import given, settings
from onnx import helper
from torch.fx.experimental.proxy_tensor import make_fx

from pagedpack.lowering.onnx.functions import (
    OPSET,
    PAGEDPACK_DOMAIN,
    functionalize_caches,
    optimize,
    paged_attention,
    reshape_and_cache,
    translation_table,
    unsupported_params,
)

from conftest import assert_within_own_error
from test_ops import (
    GRID,
    PACKED_STEPS,
    PARAM_GRID,
    PARAMS,
    grid_params,
    make_batch,
    make_params,
    make_step,
    reference_attention,
    reference_paged_attention,
)

# The input whose dtype each function output has.
OUTPUT_LIKE = {"paged_attention": ["query"], "reshape_and_cache": ["key_cache", "value_cache"]}


# ---------------------------------------------------------------- one-node models


def function_model(function, inputs: dict, symbolic: bool, **attributes) -> onnx.ModelProto:
    """A model of one ``pagedpack.<function>`` node over graph inputs typed like ``inputs``
    (name -> numpy array; dims named ``<input>_<axis>`` if ``symbolic``, else concrete), with the
    FunctionProto in ``model.functions``; ``attributes`` go on the node. A function input missing
    from ``inputs`` is left out of the node (an absent optional input)."""
    proto = function.to_function_proto()

    def value_info(name, dtype, shape):
        dims = [f"{name}_{i}" for i in range(len(shape))] if symbolic else list(shape)
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype), dims)

    graph_inputs = [value_info(name, inputs[name].dtype, inputs[name].shape) for name in proto.input if name in inputs]
    graph_outputs = [helper.make_tensor_value_info(out, helper.np_dtype_to_tensor_dtype(inputs[like].dtype),
                                                   [f"{out}_{i}" for i in range(inputs[like].ndim)])
                     for out, like in zip(proto.output, OUTPUT_LIKE[proto.name])]
    node = helper.make_node(proto.name, [name if name in inputs else "" for name in proto.input], list(proto.output),
                            domain=PAGEDPACK_DOMAIN.domain, **attributes)
    return helper.make_model(
        helper.make_graph([node], proto.name, graph_inputs, graph_outputs),
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(PAGEDPACK_DOMAIN.domain, 1)],
        functions=[proto])


@functools.cache
def _session(function, signature: tuple, symbolic: bool, attributes: tuple):
    examples = {name: torch.empty(shape, dtype=dtype).numpy() for name, dtype, shape in signature}
    model = function_model(function, examples, symbolic, **dict(attributes))
    onnx.checker.check_model(model, full_check=True)
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_function(function, inputs: dict, symbolic: bool = True, **attributes) -> list[torch.Tensor]:
    """``function``'s outputs on ``inputs`` (name -> tensor; extra names ignored, function inputs
    missing or None left absent). Sessions are cached per dtypes (and shapes unless ``symbolic``),
    the inputs present and attributes."""
    names = [n for n in function.to_function_proto().input if inputs.get(n) is not None]
    signature = tuple((n, inputs[n].dtype, tuple(inputs[n].shape)) for n in names)
    session = _session(function, signature, symbolic, tuple(sorted(attributes.items())))
    return [torch.from_numpy(out) for out in session.run(None, {n: inputs[n].numpy() for n in names})]


def onnx_attention(batch: dict, symbolic: bool = True, **params) -> torch.Tensor:
    """The ``paged_attention`` function on ``batch``; ``params`` (``paged_attention``'s keyword
    arguments) as the node's attributes and optional inputs."""
    attributes = {name: params[name] for name in ("sliding_window", "logits_soft_cap", "attention_chunk_size")
                  if name in params}
    inputs = dict(batch, **{name: params[name] for name in ("alibi_slopes", "sinks") if name in params})
    (out,) = run_function(paged_attention, inputs, symbolic, scale=batch["scale"], **attributes)
    return out


def written(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` with row ``t`` of ``rows`` (cast) at flat slot ``slots[t]``, unless -1."""
    out, block_size = cache.clone(), cache.shape[1]
    for row, slot in zip(rows, slots.tolist()):
        if slot != -1:
            out[slot // block_size, slot % block_size] = row.to(cache.dtype)
    return out


# ---------------------------------------------------------------- paged_attention

@pytest.mark.parametrize(("pair", "block_size", "head_dim", "ratio"),
                         [pytest.param(*case, id=f"q{case[0][0]}-kv{case[0][1]}-bs{case[1]}-d{case[2]}-gqa{case[3]}")
                          for case in GRID])
def test_paged_attention_matches_reference_fp32(pair, block_size, head_dim, ratio):
    q_len, kv_len = pair
    batch = make_batch([q_len], [kv_len], ratio=ratio, head_dim=head_dim, block_size=block_size)
    out = onnx_attention(batch, symbolic=False)
    assert out.shape == (q_len, 2 * ratio, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_paged_attention(**batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("case", "param_set"), PARAM_GRID,
                         ids=[f"q{p[0]}-kv{p[1]}-bs{bs}-d{d}-gqa{r}-{name}" for (p, bs, d, r), name in PARAM_GRID])
def test_paged_attention_with_params_matches_reference_fp32(case, param_set):
    """Every parameter (windows below, at and above kv_len, starting mid-block; soft cap; ALiBi;
    sinks; all together) over the GRID, against the explicit-mask reference of ``test_ops``."""
    (q_len, kv_len), block_size, head_dim, ratio = case
    batch = make_batch([q_len], [kv_len], ratio=ratio, head_dim=head_dim, block_size=block_size)
    params = grid_params(param_set, kv_len, block_size, 2 * ratio)
    out = onnx_attention(batch, **params)
    assert out.shape == (q_len, 2 * ratio, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_paged_attention(**batch, **params), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_params", [False, True], ids=["plain", "params"])
@pytest.mark.parametrize("seqs", [([127, 1], [513, 147]), ([3, 0, 1, 16], [20, 7, 1, 16])], ids=["long", "mixed"])
def test_paged_attention_fp16(seqs, with_params):
    """Error against the fp32 reference is within 2x what the reference itself loses in fp16."""
    batch = make_batch(*seqs, ratio=4, head_dim=128, dtype=torch.float16)
    params = make_params(8, window=11, soft_cap=30.0, alibi=True, sinks=True) if with_params else {}
    out = onnx_attention(batch, **params)
    assert out.dtype == torch.float16
    exact = reference_paged_attention(**batch, **params)
    low_precision = reference_paged_attention(**batch, dtype=torch.float16, **params)
    assert_within_own_error(out, low_precision, exact)
    seq_lens = batch["seq_lens"].clone()
    seq_lens[-1] -= 1  # the last sequence's newest key dropped: the rule must see it
    with pytest.raises(AssertionError):
        assert_within_own_error(onnx_attention(dict(batch, seq_lens=seq_lens), **params), low_precision, exact)


def test_value_head_dim_differs_from_key_head_dim():
    batch = make_batch([3, 1], [9, 4], block_size=4)
    batch["value_cache"] = torch.randn(*batch["value_cache"].shape[:-1], 32, generator=torch.Generator().manual_seed(1))
    out = onnx_attention(batch)
    assert out.shape == (4, 4, 32)
    torch.testing.assert_close(out, reference_paged_attention(**batch), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero(monkeypatch):
    """seq_lens < q_len: sequence 0 has q_len 4 over 2 keys (rows 0, 1 see no key), sequence 1
    no key at all; zeros there, as ``torch.ops.pagedpack.paged_attention`` gives."""
    monkeypatch.delenv("PAGEDPACK_VALIDATE", raising=False)
    batch = make_batch([4, 2], [2, 0])
    out = onnx_attention(batch)
    assert not out.isnan().any()
    assert (out[:2] == 0).all() and (out[4:] == 0).all()
    torch.testing.assert_close(out, torch.ops.pagedpack.paged_attention(**batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("param_set", ["window-w1", "sinks", "all"])
def test_fully_masked_rows_are_zero_with_params(param_set, monkeypatch):
    monkeypatch.delenv("PAGEDPACK_VALIDATE", raising=False)
    batch = make_batch([4, 2, 1], [2, 0, 0])
    params = grid_params(param_set, 2, 16, 4)
    out = onnx_attention(batch, **params)
    assert not out.isnan().any()
    assert (out[:2] == 0).all() and (out[4:] == 0).all()
    torch.testing.assert_close(out, torch.ops.pagedpack.paged_attention(**batch, **params), atol=1e-5, rtol=1e-5)


def test_no_query_rows():
    """Every sequence has q_len 0: the PyTorch op gives ``[0, H, D]``. (Regression: a Reshape
    with -1 in the function body failed on the empty query.)"""
    batch = make_batch([0, 0], [3, 5])
    assert onnx_attention(batch).shape == (0, 4, 64)


# ---------------------------------------------------------------- reshape_and_cache


SLOT_CASES = {"some-skipped": [2, 5], "all-skipped": list(range(8)), "none-skipped": []}


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("key_dtype", "cache_dtype"),
                         [(torch.float32, torch.float32), (torch.float32, torch.float16),
                          (torch.float16, torch.float16)])
@pytest.mark.parametrize("skipped", list(SLOT_CASES.values()), ids=list(SLOT_CASES))
def test_reshape_and_cache_writes_named_slots_only(skipped, key_dtype, cache_dtype, slot_dtype):
    num_blocks, block_size = 5, 4
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 8, 2, 16, generator=g).to(key_dtype)
    key_cache, value_cache = torch.randn(2, num_blocks, block_size, 2, 16, generator=g).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:8]
    slots[skipped] = -1
    inputs = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots.to(slot_dtype))
    key_out, value_out = run_function(reshape_and_cache, inputs)
    assert key_out.dtype == value_out.dtype == cache_dtype
    assert torch.equal(key_out, written(key_cache, key, slots))
    assert torch.equal(value_out, written(value_cache, value, slots))


def test_reshape_and_cache_no_tokens():
    cache = torch.randn(3, 4, 2, 8)
    empty = cache.new_zeros(0, 2, 8)
    outs = run_function(reshape_and_cache, dict(key=empty, value=empty, key_cache=cache, value_cache=cache,
                                                slot_mapping=torch.zeros(0, dtype=torch.int64)))
    assert all(torch.equal(out, cache) for out in outs)


# ---------------------------------------------------------------- the two chained, as in a step


def check_step(seqs, slot_dtype=torch.int64, seed=0, params=None, **kw):
    """``reshape_and_cache`` then ``paged_attention`` on its output caches, vs the reference on
    each sequence's whole K/V (and the caches vs a plain token-by-token write); ``params`` are
    ``make_params`` choices."""
    batch, write, full_kv = make_step(seqs, slot_dtype=slot_dtype, g=torch.Generator().manual_seed(seed), **kw)
    params = make_params(batch["query"].shape[1], seed=seed, **(params or {}))
    key_cache, value_cache = run_function(reshape_and_cache, dict(write, **batch))
    assert torch.equal(key_cache, written(batch["key_cache"], write["key"], write["slot_mapping"]))
    assert torch.equal(value_cache, written(batch["value_cache"], write["value"], write["slot_mapping"]))
    out = onnx_attention(dict(batch, key_cache=key_cache, value_cache=value_cache), **params)
    cu = batch["cu_seqlens_q"].tolist()
    expected = torch.cat([reference_attention(batch["query"][cu[b]:cu[b + 1]], k, v, batch["scale"], **params)
                          for b, (k, v) in enumerate(full_kv)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_step_prefill_decode_chunked_and_idle(slot_dtype):
    check_step([(0, 7), (2, 1), (5, 3), (30, 0), (12, 2)], slot_dtype, block_size=4)
    check_step([(0, 7), (2, 1), (5, 3), (30, 0), (12, 2)], slot_dtype, block_size=4,
               params=dict(window=6, soft_cap=9.0, alibi=True, sinks=True))


@settings(max_examples=25, deadline=None)
@given(**PACKED_STEPS, params=PARAMS)
def test_packed_step_matches_reference(seqs, block_size, head_dim, ratio, slot_dtype, seed, params):
    """Prefill (0 cached), decode (q_len 1), chunked prefill and q_len 0 sequences, packed, with
    random attention parameters."""
    seqs = [(c, q) if c + q else (c, 1) for c, q in seqs]  # a sequence holds at least one token
    check_step(seqs, slot_dtype, seed, params, ratio=ratio, head_dim=head_dim, block_size=block_size,
               num_kv_heads=1)


# ---------------------------------------------------------------- a step with parameters, exported


def _params_step(params):
    """A step function (cache write + attention with ``params``) over caches named like the step graph's."""
    def step(query, key, value, key_cache_0, value_cache_0, block_table, cu_seqlens_q, seq_lens, slot_mapping):
        torch.ops.pagedpack.reshape_and_cache(key, value, key_cache_0, value_cache_0, slot_mapping)
        return torch.ops.pagedpack.paged_attention(query, key_cache_0, value_cache_0, block_table, cu_seqlens_q,
                                                   seq_lens, 0.125, **params)
    return step


def _export_step(params, attention, dtype=torch.float32):
    """``functionalize_caches`` + ``torch.onnx.export`` with ``attention``'s translation, as the
    exporter does; returns the model proto and the example inputs (in the step's order)."""
    batch, write, full_kv = make_step([(0, 5), (6, 1), (9, 3)], block_size=4, dtype=dtype)
    args = (batch["query"], write["key"], write["value"], batch["key_cache"], batch["value_cache"],
            batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], write["slot_mapping"])
    gm = make_fx(_params_step(params))(*[a.clone() for a in args])
    functional = functionalize_caches(gm).eval()
    assert not [n for n in functional.graph.nodes if n.target is torch.ops.pagedpack.paged_attention.default]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # inside torch
        program = torch.onnx.export(functional, tuple(a.clone() for a in args), custom_translation_table=
                                    translation_table(attention), opset_version=OPSET, dynamo=True, optimize=False,
                                    verbose=False)
    optimize(program.model)
    return program.model_proto, args, batch, write, full_kv


def test_exported_step_carries_every_parameter():
    """The step graph's parameters reach the ``pagedpack.paged_attention`` node by name, and the
    exported model computes the reference (the caches come back written)."""
    params = make_params(4, window=3, soft_cap=7.5, alibi=True, sinks=True)
    model, args, batch, write, full_kv = _export_step(params, "pagedpack")
    (node,) = [n for n in model.graph.node if n.op_type == "paged_attention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"scale": 0.125, "sliding_window": 3, "logits_soft_cap": 7.5}
    assert all(node.input[6:8])  # alibi_slopes and sinks wired
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, key_cache, value_cache = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
    cu = batch["cu_seqlens_q"].tolist()
    expected = torch.cat([reference_attention(batch["query"][cu[b]:cu[b + 1]], k, v, 0.125, **params)
                          for b, (k, v) in enumerate(full_kv)])
    torch.testing.assert_close(torch.from_numpy(out), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.from_numpy(key_cache), written(batch["key_cache"], write["key"], write["slot_mapping"]))


def test_exported_step_without_parameters_has_none_on_the_node():
    model, *_ = _export_step({}, "pagedpack")
    (node,) = [n for n in model.graph.node if n.op_type == "paged_attention"]
    assert [a.name for a in node.attribute] == ["scale"] and not any(node.input[6:])


def test_com_microsoft_maps_window_soft_cap_and_sinks():
    """``local_window_size = window - 1`` (onnxruntime keeps that many keys before the row's own),
    ``softcap``, and the sinks as ``head_sink`` in the query's dtype."""
    params = make_params(4, window=3, soft_cap=7.5, sinks=True)
    model, *_ = _export_step(params, "com.microsoft", dtype=torch.float16)
    (node,) = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["local_window_size"], attrs["softcap"], attrs["is_causal"]) == (2, 7.5, 1)
    assert node.input[11], "head_sink not wired"
    plain, *_ = _export_step({}, "com.microsoft", dtype=torch.float16)
    (node,) = [n for n in plain.graph.node if n.op_type == "PagedAttention"]
    assert not {"local_window_size", "softcap"} & {a.name for a in node.attribute} and len(node.input) <= 11


@pytest.mark.parametrize("param, choice, message", [
    ("alibi_slopes", dict(alibi=True), "alibi_slopes: com.microsoft.PagedAttention's schema has no position-bias"),
    ("attention_chunk_size", dict(chunk=4), "attention_chunk_size: com.microsoft.PagedAttention's schema has no "
                                            "chunked local attention"),
])
def test_com_microsoft_refuses_what_its_schema_lacks_naming_it(param, choice, message):
    params = make_params(4, window=3, **choice)
    batch, write, _ = make_step([(0, 5)], block_size=4, dtype=torch.float16)
    args = (batch["query"], write["key"], write["value"], batch["key_cache"], batch["value_cache"],
            batch["block_table"], batch["cu_seqlens_q"], batch["seq_lens"], write["slot_mapping"])
    gm = make_fx(_params_step(params))(*args)
    (reason,) = unsupported_params(gm, "com.microsoft")
    assert param in reason and "attention='pagedpack'" in reason
    assert unsupported_params(gm, "pagedpack") == []
    with pytest.raises(Exception, match=message):
        _export_step(params, "com.microsoft", dtype=torch.float16)
