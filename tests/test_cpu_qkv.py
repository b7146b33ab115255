"""An attention layer's QKV split, rotary embedding and cache write in one native call
(``lowering/reference/cpu_qkv.py``, ``pagedpack_cpu::rope_qkv_and_cache`` in
``kernels/csrc/rotary_cpu.cpp``) and the view chains read as index maps (``passes/view_chains.py``):
the kernel against ``transformers``' ``apply_rotary_pos_emb`` (bit for bit in bf16 / fp16) and an
fp64 rotary written here, its cache rows against the values it was given, its refusals; which
layers are fused; greedy tokens equal to the unmodified model's."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedpack.kernels.native import native_ops
from pagedpack.passes.view_chains import collapse_view_chains, evaluate_views, index_tensor

from test_families import assert_cpu_lowering_keeps_greedy_tokens

needs_native = pytest.mark.skipif(native_ops() is None, reason="no native CPU kernels (no C++ compiler)")
BLOCK_SIZE = 4


def _rope64(x, cos, sin):
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * cos.double() + torch.cat([-x2, x1], -1) * sin.double()


@needs_native
@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 19), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       head_dim=st.sampled_from([2, 6, 16, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       batched=st.booleans(), extra=st.integers(0, 5), skipped=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_rope_qkv_and_cache_rotates_q_and_k_and_writes_k_and_v(tokens, kv_heads, group, head_dim, dtype, batched,
                                                                extra, skipped, seed):
    """q and k rotated as transformers rotates them (bit for bit in bf16 / fp16; fp32 within an fp64
    rotary's rounding), k and v in their slots, slots of -1 and every other cache row untouched;
    the projection ``[T, N]`` or ``[1, T, N]``, with ``extra`` columns after v."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    width = (heads + 2 * kv_heads) * head_dim + extra
    qkv = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
    angles = torch.randn(tokens, head_dim, generator=g) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    num_blocks = -(-tokens // BLOCK_SIZE) + 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:tokens]
    slots[torch.randperm(tokens, generator=g)[:skipped]] = -1
    caches = [torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    key_cache, value_cache = (c.clone() for c in caches)

    query = native_ops().rope_qkv_and_cache(
        qkv[None] if batched else qkv, 0, heads * head_dim, (heads + kv_heads) * head_dim, heads, kv_heads, head_dim,
        cos[None, None] if batched else cos, sin[None, None] if batched else sin, key_cache, value_cache, slots)

    q, k, v = (qkv[:, a:b].view(tokens, -1, head_dim) for a, b in (
        (0, heads * head_dim), (heads * head_dim, (heads + kv_heads) * head_dim),
        ((heads + kv_heads) * head_dim, (heads + 2 * kv_heads) * head_dim)))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    want_q, want_k = (w[0].transpose(0, 1) for w in (want_q, want_k))
    assert query.shape == (tokens, heads, head_dim) and query.dtype == dtype and query.is_contiguous()
    if dtype == torch.float32:  # the graph's muls and add may fuse into an FMA here: an ulp or so
        torch.testing.assert_close(query.double(), _rope64(q, cos[:, None], sin[:, None]), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(query, want_q)
    written = slots >= 0
    for cache, before, rows in ((key_cache, caches[0], want_k), (value_cache, caches[1], v)):
        flat, expected = cache.view(-1, kv_heads, head_dim), before.clone().view(-1, kv_heads, head_dim)
        expected[slots[written]] = rows[written]
        torch.testing.assert_close(flat, expected, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if
                                   dtype == torch.float32 else 0)


@needs_native
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                                (torch.bfloat16, torch.int8), (torch.float16, torch.float8_e4m3fn)])
def test_another_cache_dtype_is_written_as_reshape_and_cache_writes_it(dtype, cache_dtype):
    """A cache of another dtype than qkv's (converted, or quantized with its scale) holds what
    ``reshape_and_cache`` writes for transformers' rotated k and for v, byte for byte (bf16 / fp16
    activations: the rotation itself is exact there)."""
    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.randn(tokens, head_dim, generator=g) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([5, -1, 0, 9, 3, 14, 2])
    scaled = cache_dtype in (torch.int8, torch.float8_e4m3fn)
    shape = (4, BLOCK_SIZE, kv_heads, head_dim + (4 if scaled else 0))
    got = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    want = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    query = native_ops().rope_qkv_and_cache(qkv, 0, heads * head_dim, (heads + kv_heads) * head_dim, heads,
                                            kv_heads, head_dim, cos, sin, *got, slots)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (x.reshape(tokens, -1, head_dim).transpose(0, 1)[None] for x in (q, k, v))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    native_ops().reshape_and_cache(want_k[0].transpose(0, 1), v[0].transpose(0, 1), *want, slots)
    assert torch.equal(query, want_q[0].transpose(0, 1))
    for cache, expected in zip(got, want):
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def _call(qkv=None, offsets=(0, 32, 48), heads=(2, 1, 16), cos=None, slots=None, dtype=torch.float32):
    qkv = torch.randn(3, 64, dtype=dtype) if qkv is None else qkv
    cos = torch.randn(3, 16, dtype=dtype) if cos is None else cos
    caches = [torch.zeros(4, BLOCK_SIZE, 1, 16, dtype=dtype) for _ in range(2)]
    slots = torch.tensor([0, 1, 2]) if slots is None else slots
    return native_ops().rope_qkv_and_cache(qkv, *offsets, *heads, cos, cos, *caches, slots)


@needs_native
@pytest.mark.parametrize("change, names", [
    (dict(qkv=torch.randn(3, 64, dtype=torch.float64)), "qkv, cos, sin"),
    (dict(cos=torch.randn(3, 16, dtype=torch.bfloat16)), "qkv, cos, sin"),
    (dict(offsets=(0, 32, 56)), "offset 56"),
    (dict(offsets=(-1, 32, 48)), "offset -1"),
    (dict(heads=(2, 1, 15)), "head_dim"),
    (dict(qkv=torch.randn(64, 3).t()), "contiguous last dimension"),
    (dict(slots=torch.tensor([0, 1])), "expected 2 rows"),
    (dict(cos=torch.randn(2, 16)), "cos"),
    (dict(slots=torch.tensor([0, 1, 99])), "slot_mapping"),
    (dict(slots=torch.tensor([0, -2, 1], dtype=torch.int32)), "slot_mapping"),  # through reshape_and_cache
])
def test_rope_qkv_and_cache_refusals_name_the_argument(change, names):
    with pytest.raises(ValueError, match=names):
        _call(**change)


class _Views(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x):  # x [T, 4, 6]
        y = x.transpose(0, 1).unsqueeze(0)  # [1, 4, T, 6]
        if self.form == "regroup":  # back to token-major: the elements in x's own order
            return y.transpose(1, 2).reshape(1, x.shape[0], -1)
        return y.reshape(1, 4 * x.shape[0], 6)  # head-major: a different order


@pytest.mark.parametrize("form, collapsed", [("regroup", 1), ("reorder", 0)])
def test_a_view_chain_is_collapsed_only_when_it_keeps_the_order(form, collapsed):
    x = torch.randn(5, 4, 6)
    gm = torch.export.export(_Views(form), (x,), dynamic_shapes=({0: torch.export.Dim("T")},)).module()
    expected = gm(x)
    assert collapse_view_chains(gm) == collapsed
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "reshape" in str(n.target)]
    if collapsed:
        assert len([n for n in gm.graph.nodes if n.op == "call_function" and "transpose" in str(n.target)]) == 0
        assert calls and calls[-1].args[0].op == "placeholder"
    other = torch.randn(2, 4, 6)  # another token count: the collapsed chain reads T from its input
    assert torch.equal(gm(x), expected) and torch.equal(gm(other), _Views(form)(other))


def test_a_chain_is_read_as_the_elements_it_selects():
    x = torch.randn(5, 12)
    graph = torch.fx.Graph()
    source = graph.placeholder("x")
    source.meta["val"] = x
    sliced = graph.call_function(torch.ops.aten.slice.Tensor, (source, 1, 4, 8))
    viewed = graph.call_function(torch.ops.aten.view.default, (sliced, [5, 2, 2]))
    picked = evaluate_views(viewed, source, index_tensor(source))
    assert torch.equal(picked, torch.arange(60).view(5, 12)[:, 4:8].reshape(5, 2, 2))
    other = graph.placeholder("y")
    assert evaluate_views(viewed, other, index_tensor(source)) is None  # not reached from `other`


# family: layers fused (2 layers each); Qwen3 and Gemma-3 norm q and k before their rotary, Phi
# and GPT-NeoX rotate part of each head, Cohere's rotary is interleaved, GPT-2 has none.
FUSED = {"llama": 2, "mistral": 2, "qwen2": 2, "gemma": 2, "mixtral": 2, "qwen3": 0, "gemma3": 0, "gpt_neox": 0,
         "cohere": 0, "gpt2": 0}


@pytest.mark.parametrize("family", FUSED)
def test_fused_qkv_steps_generate_the_unmodified_models_tokens(family):
    expected = FUSED[family] if native_ops() is not None else 0
    assert_cpu_lowering_keeps_greedy_tokens(family, f"{expected} QKV splits with their rotary embedding", seed=8)
