"""The ``pagedpack`` ONNX functions (:mod:`pagedpack.lowering.onnx`) on their own, run by
onnxruntime's CPU provider.

Each function is called from a one-node model (``onnx.checker`` full check passes) and compared
with independent references: ``paged_attention`` with the explicit-mask fp32 attention of
``test_ops`` (GRID of lengths, block sizes, head dims and GQA ratios; fp16 within the error the
reference itself has in fp16; rows that see no key as zeros, as the PyTorch op gives),
``reshape_and_cache`` with a cache written token by token here, and the two chained as in a step
(packed steps drawn by hypothesis) with the reference on each sequence's whole K/V.
"""
import functools

import onnx
import onnxruntime
import pytest
import torch
from hypothesis import given, settings
from onnx import helper
from test_ops import GRID, PACKED_STEPS, make_batch, make_step, reference_attention, reference_paged_attention

from pagedpack.lowering.onnx import OPSET, PAGEDPACK_DOMAIN, paged_attention, reshape_and_cache

# The input whose dtype each function output has.
OUTPUT_LIKE = {"paged_attention": ["query"], "reshape_and_cache": ["key_cache", "value_cache"]}


# ---------------------------------------------------------------- one-node models


def function_model(function, inputs: dict, symbolic: bool, **attributes) -> onnx.ModelProto:
    """A model of one ``pagedpack.<function>`` node over graph inputs typed like ``inputs``
    (name -> numpy array; dims named ``<input>_<axis>`` if ``symbolic``, else concrete), with the
    FunctionProto in ``model.functions``; ``attributes`` go on the node."""
    proto = function.to_function_proto()

    def value_info(name, dtype, shape):
        dims = [f"{name}_{i}" for i in range(len(shape))] if symbolic else list(shape)
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype), dims)

    graph_inputs = [value_info(name, inputs[name].dtype, inputs[name].shape) for name in proto.input]
    graph_outputs = [helper.make_tensor_value_info(out, helper.np_dtype_to_tensor_dtype(inputs[like].dtype),
                                                   [f"{out}_{i}" for i in range(inputs[like].ndim)])
                     for out, like in zip(proto.output, OUTPUT_LIKE[proto.name])]
    node = helper.make_node(proto.name, list(proto.input), list(proto.output), domain=PAGEDPACK_DOMAIN.domain,
                            **attributes)
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
    """``function``'s outputs on ``inputs`` (name -> tensor; extra names ignored). Sessions are
    cached per dtypes (and shapes unless ``symbolic``) and attributes."""
    names = function.to_function_proto().input
    signature = tuple((n, inputs[n].dtype, tuple(inputs[n].shape)) for n in names)
    session = _session(function, signature, symbolic, tuple(sorted(attributes.items())))
    return [torch.from_numpy(out) for out in session.run(None, {n: inputs[n].numpy() for n in names})]


def onnx_attention(batch: dict, symbolic: bool = True) -> torch.Tensor:
    (out,) = run_function(paged_attention, batch, symbolic, scale=batch["scale"])
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


@pytest.mark.parametrize("seqs", [([127, 1], [513, 147]), ([3, 0, 1, 16], [20, 7, 1, 16])], ids=["long", "mixed"])
def test_paged_attention_fp16(seqs):
    """Error against the fp32 reference is within 2x what the reference itself loses in fp16."""
    batch = make_batch(*seqs, ratio=4, head_dim=128, dtype=torch.float16)
    out = onnx_attention(batch)
    assert out.dtype == torch.float16
    exact = reference_paged_attention(**batch)
    ref_error = (reference_paged_attention(**batch, dtype=torch.float16).float() - exact).abs().max()
    assert ref_error > 0
    assert (out.float() - exact).abs().max() <= 2 * ref_error


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


def check_step(seqs, slot_dtype=torch.int64, seed=0, **kw):
    """``reshape_and_cache`` then ``paged_attention`` on its output caches, vs the reference on
    each sequence's whole K/V (and the caches vs a plain token-by-token write)."""
    batch, write, full_kv = make_step(seqs, slot_dtype=slot_dtype, g=torch.Generator().manual_seed(seed), **kw)
    key_cache, value_cache = run_function(reshape_and_cache, dict(write, **batch))
    assert torch.equal(key_cache, written(batch["key_cache"], write["key"], write["slot_mapping"]))
    assert torch.equal(value_cache, written(batch["value_cache"], write["value"], write["slot_mapping"]))
    out = onnx_attention(dict(batch, key_cache=key_cache, value_cache=value_cache))
    cu = batch["cu_seqlens_q"].tolist()
    expected = torch.cat([reference_attention(batch["query"][cu[b]:cu[b + 1]], k, v, batch["scale"])
                          for b, (k, v) in enumerate(full_kv)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_step_prefill_decode_chunked_and_idle(slot_dtype):
    check_step([(0, 7), (2, 1), (5, 3), (30, 0), (12, 2)], slot_dtype, block_size=4)


@settings(max_examples=25, deadline=None)
@given(**PACKED_STEPS)
def test_packed_step_matches_reference(seqs, block_size, head_dim, ratio, slot_dtype, seed):
    """Prefill (0 cached), decode (q_len 1), chunked prefill and q_len 0 sequences, packed."""
    seqs = [(c, q) if c + q else (c, 1) for c, q in seqs]  # a sequence holds at least one token
    check_step(seqs, slot_dtype, seed, ratio=ratio, head_dim=head_dim, block_size=block_size, num_kv_heads=1)
