"""The recurrent ops (kernels/recurrent.py) against references written here or taken from
``transformers``: each packed sequence, fed in chunks whose state travels through its slot, gives
what the whole sequence gives in one piece from zeros."""
import pytest
import torch
import torch.nn.functional as F
import transformers.models.mamba.modeling_mamba as mamba
import transformers.models.mamba2.modeling_mamba2 as mamba2
import transformers.models.minimax.modeling_minimax as minimax
import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Mamba2Config, MambaConfig, MiniMaxConfig, Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

import pagedpack  # noqa: F401  (registers the ops)
from pagedpack.kernels import recurrent
from pagedpack.models.seams import kernel_seams

DIM, WIDTH = 6, 4
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 8, 5
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 3, 2, 6


def conv_reference(x, weight, bias):
    """``nn.Conv1d(groups=dim, padding=width - 1)`` over the whole ``[L, dim]`` sequence, cut to its
    first L outputs (transformers' no-cache path), then SiLU."""
    y = F.conv1d(x.T[None], weight[:, None, :], bias, padding=weight.shape[1] - 1, groups=weight.shape[0])
    return F.silu(y[0, :, :x.shape[0]].T)


def scan_reference(x, dt, A, B, C, D):
    """The selective scan in its quadratic (attention-like) form, every state materialised by the
    sum over earlier tokens: ``y_t = sum_{s<=t} (C_t . (exp(sum_{s<r<=t} dt_r A) ⊙ B_s)) dt_s x_s + D x_t``."""
    L, H, _ = x.shape
    rate = A if A.dim() == 2 else A[:, None].expand(H, B.shape[-1])
    B, C = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (B, C))
    cum = torch.cumsum(dt, 0)  # [L, H]
    y = torch.zeros_like(x)
    for t in range(L):
        for s in range(t + 1):
            decay = torch.exp((cum[t] - cum[s])[:, None] * rate)  # [H, N]
            weight = (C[t] * decay * B[s]).sum(-1) * dt[s]  # [H]
            y[t] += weight[:, None] * x[s]
    return y + D[:, None] * x


def lightning_reference(q, k, v, slope_rate):
    """Lightning attention of one ``[L, H, D]`` sequence in its quadratic form, from the definition
    ``S_t = exp(-slope) S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t``: ``o_t = sum_{s<=t} exp(-slope (t - s))
    (q_t . k_s) v_s``; the state after the last token ``sum_s exp(-slope (L - 1 - s)) k_s v_s^T``."""
    age = torch.arange(q.shape[0])[:, None] - torch.arange(q.shape[0])[None, :]  # t - s
    decay = torch.where(age >= 0, torch.exp(-slope_rate[:, None, None] * age.clamp(min=0)), 0.0)  # [H, L, L]
    out = torch.einsum("hts,thd,shd,she->the", decay, q, k, v)
    final = torch.einsum("hs,shd,she->hde", decay[:, -1], k, v)
    return out, final


def run_in_chunks(sequences, splits, state, slots, call):
    """Feed each sequence (a dict of per-token tensors, tokens first) in ``splits`` steps, all
    sequences packed together per step; ``call(step_inputs, state, slots, cu, initial)`` runs the op.
    Returns each sequence's outputs, concatenated over its chunks."""
    outputs = [[] for _ in sequences]
    done = [0] * len(sequences)
    for step in range(max(len(s) for s in splits)):
        active = [i for i, s in enumerate(splits) if step < len(s)]
        lengths = [splits[i][step] for i in active]
        inputs = {name: torch.cat([sequences[i][name][done[i]:done[i] + n] for i, n in zip(active, lengths)])
                  for name in sequences[0]}
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        initial = torch.tensor([done[i] > 0 for i in active])
        out = call(inputs, state, torch.tensor([slots[i] for i in active], dtype=torch.int32), cu, initial)
        for j, i in enumerate(active):
            outputs[i].append(out[cu[j]:cu[j + 1]])
            done[i] += lengths[j]
    return [torch.cat(o) for o in outputs]


def chunking(length, pieces):
    """``length`` tokens cut at ``pieces`` (those inside the sequence) into chunk lengths."""
    cuts = sorted({min(length, max(1, p)) for p in pieces if p < length})
    bounds = [0, *cuts, length]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a] or [length]


@st.composite
def batches(draw, max_seqs=4, max_len=12):
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    splits = [chunking(n, draw(st.lists(st.integers(1, max_len), max_size=3))) for n in lengths]
    slots = draw(st.permutations(range(max_seqs + 2)))[:len(lengths)]
    return lengths, splits, slots


def _garbage_state(shape, dtype=torch.float64):
    return torch.randn(shape, dtype=dtype) * 100  # a former occupant's: has_initial_state=False must not read it


@settings(max_examples=12, deadline=None)
@given(batches())
def test_causal_conv1d_in_chunks_equals_the_whole_sequence(batch):
    lengths, splits, slots = batch
    g = torch.Generator().manual_seed(len(lengths))
    weight = torch.randn(DIM, WIDTH, generator=g, dtype=torch.float64)
    bias = torch.randn(DIM, generator=g, dtype=torch.float64)
    seqs = [{"x": torch.randn(n, DIM, generator=g, dtype=torch.float64)} for n in lengths]
    state = _garbage_state((max(slots) + 2, DIM, WIDTH - 1))
    outs = run_in_chunks(seqs, splits, state, slots, lambda i, s, idx, cu, init: (
        torch.ops.pagedpack.causal_conv1d_varlen(i["x"], weight, bias, s, idx, cu, init, "silu")))
    for seq, out, slot in zip(seqs, outs, slots):
        torch.testing.assert_close(out, conv_reference(seq["x"], weight, bias))
        tail = torch.cat([torch.zeros(DIM, WIDTH - 1, dtype=torch.float64), seq["x"].T], 1)[:, -(WIDTH - 1):]
        torch.testing.assert_close(state[slot], tail)  # the last width - 1 inputs, zeros before the first


@settings(max_examples=8, deadline=None)
@given(batches(), st.booleans())
def test_gated_delta_rule_in_chunks_equals_transformers_chunked_form(batch, l2norm):
    lengths, splits, slots = batch
    g = torch.Generator().manual_seed(sum(lengths))
    seqs = [{"q": torch.randn(n, K_HEADS, K_DIM, generator=g, dtype=torch.float64),
             "k": torch.randn(n, K_HEADS, K_DIM, generator=g, dtype=torch.float64) * 0.3,
             "v": torch.randn(n, V_HEADS, V_DIM, generator=g, dtype=torch.float64),
             "g": -torch.rand(n, V_HEADS, generator=g, dtype=torch.float64),
             "beta": torch.rand(n, V_HEADS, generator=g, dtype=torch.float64)} for n in lengths]
    state = _garbage_state((max(slots) + 2, V_HEADS, K_DIM, V_DIM))
    scale = K_DIM ** -0.5
    outs = run_in_chunks(seqs, splits, state, slots, lambda i, s, idx, cu, init: (
        torch.ops.pagedpack.gated_delta_rule_varlen(i["q"], i["k"], i["v"], i["g"], i["beta"], s, idx, cu, init,
                                                    scale, l2norm)))
    for seq, out, slot in zip(seqs, outs, slots):
        expected, final = torch_chunk_gated_delta_rule(
            *(seq[name][None] for name in ("q", "k", "v", "g", "beta")), chunk_size=4, output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm)
        # transformers computes in fp32 whatever comes in: fp32 tolerances
        torch.testing.assert_close(out, expected[0].to(out.dtype), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], final[0].to(state.dtype), atol=1e-5, rtol=1e-5)


@settings(max_examples=8, deadline=None)
@given(batches())
def test_lightning_attention_in_chunks_equals_the_quadratic_form(batch):
    lengths, splits, slots = batch
    g = torch.Generator().manual_seed(sum(lengths) + 1)
    slope_rate = torch.rand(HEADS, generator=g, dtype=torch.float64)
    seqs = [{"q": torch.randn(n, HEADS, K_DIM, generator=g, dtype=torch.float64),
             "k": torch.randn(n, HEADS, K_DIM, generator=g, dtype=torch.float64),
             "v": torch.randn(n, HEADS, V_DIM, generator=g, dtype=torch.float64)} for n in lengths]
    state = _garbage_state((max(slots) + 2, HEADS, K_DIM, V_DIM))
    outs = run_in_chunks(seqs, splits, state, slots, lambda i, s, idx, cu, init: (
        torch.ops.pagedpack.lightning_attention_varlen(i["q"], i["k"], i["v"], slope_rate, s, idx, cu, init)))
    for seq, out, slot in zip(seqs, outs, slots):
        expected, final = lightning_reference(seq["q"], seq["k"], seq["v"], slope_rate)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(state[slot], final)


def test_the_lightning_attention_seam_is_minimax_s_forward_on_a_batch():
    """MiniMax's forward without a cache (its loop over blocks of 4: 11 tokens end in a partial one)
    and the seam's, the loop as ``chunk_lightning_attention``, give the same output; a call with a
    cache goes to the original; the original forward is restored after."""
    config = MiniMaxConfig(hidden_size=32, num_attention_heads=2, head_dim=8, num_hidden_layers=2, block_size=4,
                           layer_types=["linear_attention", "full_attention"])
    original = minimax.MiniMaxLightningAttention.forward
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = minimax.MiniMaxLightningAttention(config, 0).double()
        hidden = torch.randn(2, 11, 32, dtype=torch.float64)
    expected, _ = layer(hidden, None, None)
    with kernel_seams(layer):
        assert minimax.MiniMaxLightningAttention.forward is not original
        got, final = layer(hidden, None, None)
        assert final is None
        _, final = layer(hidden, None, None, cache=minimax.MiniMaxCache())  # not the seam's form
        assert final is not None
    assert minimax.MiniMaxLightningAttention.forward is original
    torch.testing.assert_close(got, expected)


def test_the_capture_seam_is_transformers_chunked_form_on_a_batch():
    """The seam (models/seams.py) answers transformers' ``torch_chunk_gated_delta_rule`` called as a
    prompt calls it (no initial state, no final state) with pagedpack's op; other calls go through."""
    args = _chunk_delta_rule_args()
    inputs = [args[name].double() for name in ("q", "k", "v", "g", "beta")]
    expected, _ = torch_chunk_gated_delta_rule(*inputs, chunk_size=2, use_qk_l2norm_in_kernel=True)
    config = Qwen3NextConfig(hidden_size=16, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=4,
                             linear_value_head_dim=4, layer_types=["linear_attention"], num_hidden_layers=1)
    with kernel_seams(qwen3_next.Qwen3NextGatedDeltaNet(config, 0)):
        seam = qwen3_next.torch_chunk_gated_delta_rule
        assert seam is not torch_chunk_gated_delta_rule
        got, final = seam(*inputs, use_qk_l2norm_in_kernel=True)
        assert final is None
        _, final = seam(*inputs, output_final_state=True)  # not the seam's form: transformers' own function
        assert final is not None
    assert qwen3_next.torch_chunk_gated_delta_rule is torch_chunk_gated_delta_rule
    torch.testing.assert_close(got, expected.to(got.dtype))


@pytest.mark.parametrize("form", ["mamba2", "mamba"])
def test_the_scan_seams_are_transformers_scans_on_a_batch(form):
    """Mamba2's ``mamba2_chunk_scan`` (SSD, chunks of 2) and Mamba's ``mamba_selective_scan`` (with its
    gate ``z``) answer a prompt's call through pagedpack's ``chunk_selective_scan`` as transformers does."""
    g = torch.Generator().manual_seed(3)
    batch, tokens, heads, head_dim, groups, d_state = 2, 5, 4, 3, 2, 6
    if form == "mamba2":
        module, layer = mamba2, mamba2.Mamba2Mixer(Mamba2Config(hidden_size=6, num_heads=heads, head_dim=head_dim,
                                                                n_groups=groups, state_size=d_state), 0)
        args = (torch.randn(batch, tokens, heads, head_dim, generator=g),
                torch.randn(batch, tokens, heads, generator=g), -torch.rand(heads, generator=g),
                *torch.randn(2, batch, tokens, groups, d_state, generator=g), 2)
        kwargs = dict(D=torch.randn(heads, generator=g), dt_bias=torch.randn(heads, generator=g), dt_softplus=True,
                      dt_limit=(0.01, 2.0))
        name = "mamba2_chunk_scan"
    else:
        module, layer = mamba, mamba.MambaMixer(MambaConfig(hidden_size=8, state_size=d_state), 0)
        channels = 16
        args = (torch.randn(batch, channels, tokens, generator=g), torch.randn(batch, channels, tokens, generator=g),
                -torch.rand(channels, d_state, generator=g), *torch.randn(2, batch, d_state, tokens, generator=g))
        kwargs = dict(D=torch.randn(channels, generator=g), z=torch.randn(batch, channels, tokens, generator=g),
                      delta_bias=torch.randn(channels, generator=g), delta_softplus=True)
        name = "mamba_selective_scan"
    original = getattr(module, name)
    expected = original(*args, **kwargs)
    with kernel_seams(layer):
        assert getattr(module, name) is not original
        got = getattr(module, name)(*args, **kwargs)
    assert getattr(module, name) is original
    torch.testing.assert_close(got, expected.to(got.dtype), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["mamba2", "mamba"])
@settings(max_examples=6, deadline=None)
@given(batch=batches(max_seqs=3, max_len=9))
def test_selective_scan_in_chunks_equals_the_quadratic_form(form, batch):
    lengths, splits, slots = batch
    g = torch.Generator().manual_seed(sum(lengths) + len(form))
    A = -torch.rand(HEADS, D_STATE, generator=g, dtype=torch.float64) if form == "mamba" else \
        -torch.rand(HEADS, generator=g, dtype=torch.float64)
    D = torch.randn(HEADS, generator=g, dtype=torch.float64)
    dt_bias = torch.randn(HEADS, generator=g, dtype=torch.float64)
    seqs = [{"x": torch.randn(n, HEADS, HEAD_DIM, generator=g, dtype=torch.float64),
             "dt": torch.randn(n, HEADS, generator=g, dtype=torch.float64),
             "B": torch.randn(n, GROUPS, D_STATE, generator=g, dtype=torch.float64),
             "C": torch.randn(n, GROUPS, D_STATE, generator=g, dtype=torch.float64)} for n in lengths]
    state = _garbage_state((max(slots) + 2, HEADS, HEAD_DIM, D_STATE))
    outs = run_in_chunks(seqs, splits, state, slots, lambda i, s, idx, cu, init: (
        torch.ops.pagedpack.selective_scan_varlen(i["x"], i["dt"], A, i["B"], i["C"], D, dt_bias, s, idx, cu, init,
                                                  dt_softplus=True, dt_min=0.0, dt_max=2.0)))
    for seq, out in zip(seqs, outs):
        dt = F.softplus(seq["dt"] + dt_bias).clamp(0.0, 2.0)
        torch.testing.assert_close(out, scan_reference(seq["x"], dt, A, seq["B"], seq["C"], D))


def test_a_padding_slot_reads_zeros_and_writes_nothing():
    x = torch.randn(5, DIM)
    weight, state = torch.randn(DIM, WIDTH), torch.randn(2, DIM, WIDTH - 1)
    before = state.clone()
    out = recurrent.causal_conv1d_varlen(x, weight, None, state, torch.tensor([-1], dtype=torch.int32),
                                         torch.tensor([0, 5], dtype=torch.int32), torch.tensor([True]))
    no_activation = F.conv1d(x.T[None], weight[:, None], padding=WIDTH - 1, groups=DIM)[0, :, :5].T
    torch.testing.assert_close(out, no_activation)
    assert torch.equal(state, before)


def test_bf16_inputs_accumulate_in_fp32_and_keep_their_dtype():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(7, 1, 4, generator=g) * 0.5 for _ in range(2))
    v = torch.randn(7, 2, 3, generator=g)
    gate, beta = -torch.rand(7, 2, generator=g), torch.rand(7, 2, generator=g)
    meta = (torch.tensor([0], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32), torch.tensor([False]))
    state32, state16 = torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3, dtype=torch.bfloat16)
    exact = recurrent.gated_delta_rule_varlen(q, k, v, gate, beta, state32, *meta, 0.5)
    low = recurrent.gated_delta_rule_varlen(*(t.bfloat16() for t in (q, k, v, gate, beta)), state16, *meta, 0.5)
    assert low.dtype == torch.bfloat16 and state16.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), exact, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(state16.float(), state32, atol=3e-2, rtol=3e-2)


def _conv_args():
    return dict(x=torch.randn(5, DIM), weight=torch.randn(DIM, WIDTH), bias=torch.randn(DIM),
                conv_state=torch.randn(3, DIM, WIDTH - 1), state_indices=torch.tensor([2, 0], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32), has_initial_state=torch.tensor([True, False]),
                activation="silu")


def _delta_rule_args():
    return dict(q=torch.randn(5, K_HEADS, K_DIM), k=torch.randn(5, K_HEADS, K_DIM), v=torch.randn(5, V_HEADS, V_DIM),
                g=-torch.rand(5, V_HEADS), beta=torch.rand(5, V_HEADS), ssm_state=torch.randn(3, V_HEADS, K_DIM, V_DIM),
                state_indices=torch.tensor([1, -1], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 5], dtype=torch.int32), has_initial_state=torch.tensor([True, False]),
                scale=0.3, use_qk_l2norm_in_kernel=True)


def _scan_args():
    return dict(x=torch.randn(4, HEADS, HEAD_DIM), dt=torch.randn(4, HEADS), A=-torch.rand(HEADS),
                B=torch.randn(4, GROUPS, D_STATE), C=torch.randn(4, GROUPS, D_STATE), D=torch.randn(HEADS),
                dt_bias=None, ssm_state=torch.randn(2, HEADS, HEAD_DIM, D_STATE),
                state_indices=torch.tensor([1], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32), has_initial_state=torch.tensor([True]),
                dt_softplus=True)


def _lightning_args():
    return dict(q=torch.randn(5, HEADS, K_DIM), k=torch.randn(5, HEADS, K_DIM), v=torch.randn(5, HEADS, V_DIM),
                slope_rate=torch.rand(HEADS), ssm_state=torch.randn(3, HEADS, K_DIM, V_DIM),
                state_indices=torch.tensor([2, 0], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 4, 5], dtype=torch.int32), has_initial_state=torch.tensor([False, True]))


def _chunk_lightning_args():
    return dict(q=torch.randn(2, 3, HEADS, K_DIM), k=torch.randn(2, 3, HEADS, K_DIM),
                v=torch.randn(2, 3, HEADS, V_DIM), slope_rate=torch.rand(HEADS))


def _chunk_delta_rule_args():
    return dict(q=torch.randn(2, 3, K_HEADS, K_DIM), k=torch.randn(2, 3, K_HEADS, K_DIM),
                v=torch.randn(2, 3, V_HEADS, V_DIM), g=-torch.rand(2, 3, V_HEADS), beta=torch.rand(2, 3, V_HEADS),
                scale=0.3, use_qk_l2norm_in_kernel=True)


def _chunk_scan_args():
    scan = _scan_args()
    return dict(x=torch.randn(2, 2, HEADS, HEAD_DIM), dt=torch.randn(2, 2, HEADS), A=scan["A"],
                B=torch.randn(2, 2, GROUPS, D_STATE), C=torch.randn(2, 2, GROUPS, D_STATE), D=scan["D"],
                dt_bias=torch.randn(HEADS), dt_softplus=True, dt_min=0.0, dt_max=4.0)


OPS = {"causal_conv1d_varlen": _conv_args, "gated_delta_rule_varlen": _delta_rule_args,
       "selective_scan_varlen": _scan_args, "lightning_attention_varlen": _lightning_args,
       "chunk_gated_delta_rule": _chunk_delta_rule_args, "chunk_selective_scan": _chunk_scan_args,
       "chunk_lightning_attention": _chunk_lightning_args}


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.pagedpack, name).default, (), OPS[name]())


@pytest.mark.parametrize("name, change, message", [
    ("causal_conv1d_varlen", {"state_indices": torch.tensor([3, 0], dtype=torch.int32)},
     "state_indices: expected slots in [0, 3)"),
    ("causal_conv1d_varlen", {"state_indices": torch.tensor([1, 1], dtype=torch.int32)}, "each slot at most once"),
    ("causal_conv1d_varlen", {"state_indices": torch.tensor([1, 0])}, "state_indices: expected dtype int32"),
    ("causal_conv1d_varlen", {"cu_seqlens_q": torch.tensor([0, 4, 3], dtype=torch.int32)},
     "cu_seqlens_q: expected non-decreasing"),
    ("causal_conv1d_varlen", {"has_initial_state": torch.tensor([True])}, "has_initial_state: expected B=2 entries"),
    ("causal_conv1d_varlen", {"conv_state": torch.randn(3, DIM, WIDTH)}, "conv_state: expected [num_slots, 6, 3]"),
    ("causal_conv1d_varlen", {"activation": "gelu"}, "activation: expected one of"),
    ("causal_conv1d_varlen", {"x": torch.ones(5, DIM, dtype=torch.int64)}, "x: expected a floating-point tensor"),
    ("gated_delta_rule_varlen", {"v": torch.randn(5, 3, V_DIM)}, "num_v_heads a multiple of num_k_heads=2"),
    ("gated_delta_rule_varlen", {"beta": torch.rand(4, V_HEADS)}, "beta: expected shape (5, 4)"),
    ("selective_scan_varlen", {"A": -torch.rand(HEADS, 2)}, "A: expected shape (4,) (Mamba2) or (4, 6) (Mamba)"),
    ("selective_scan_varlen", {"C": torch.randn(4, 1, D_STATE)}, "C: expected shape (4, 2, 6) like B"),
    ("lightning_attention_varlen", {"slope_rate": torch.rand(HEADS, 1, 1)},
     "slope_rate: expected a rank-1 tensor [num_heads]"),
    ("lightning_attention_varlen", {"v": torch.randn(5, 2, V_DIM)}, "v: expected [5, 4, v_head_dim] like q"),
])
def test_bad_arguments_are_refused_by_name(name, change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        getattr(recurrent, name)(**dict(OPS[name](), **change))



def _native_sample(kind: str) -> dict:
    """A step of four sequences for the op ``kind`` names: a decode token, a chunk continuing its
    state, a first chunk over a former occupant's slot, and a padding sequence (slot -1)."""
    g = torch.Generator().manual_seed(7)
    tokens, slots = 10, 5

    def r(*shape):
        return torch.randn(*shape, generator=g)

    data = {
        "conv": lambda: dict(x=r(tokens, DIM), weight=r(DIM, WIDTH), bias=r(DIM), conv_state=r(slots, DIM, WIDTH - 1),
                             activation="silu"),
        "delta_rule": lambda: dict(q=r(tokens, K_HEADS, K_DIM), k=r(tokens, K_HEADS, K_DIM),
                                   v=r(tokens, V_HEADS, V_DIM), g=-r(tokens, V_HEADS).abs(),
                                   beta=r(tokens, V_HEADS).sigmoid(),
                                   ssm_state=r(slots, V_HEADS, K_DIM, V_DIM), scale=0.3, use_qk_l2norm_in_kernel=True),
        "kda": lambda: dict(q=r(tokens, V_HEADS, K_DIM), k=r(tokens, V_HEADS, K_DIM), v=r(tokens, V_HEADS, V_DIM),
                            g=-r(tokens, V_HEADS, K_DIM).abs(), beta=r(tokens, V_HEADS).sigmoid(),
                            ssm_state=r(slots, V_HEADS, K_DIM, V_DIM), scale=0.3, use_qk_l2norm_in_kernel=True),
        "lightning": lambda: dict(q=r(tokens, HEADS, K_DIM), k=r(tokens, HEADS, K_DIM), v=r(tokens, HEADS, V_DIM),
                                  slope_rate=r(HEADS).abs(), ssm_state=r(slots, HEADS, K_DIM, V_DIM)),
        "mamba2": lambda: dict(x=r(tokens, HEADS, HEAD_DIM), dt=r(tokens, HEADS), A=-r(HEADS).abs(),
                               B=r(tokens, GROUPS, D_STATE), C=r(tokens, GROUPS, D_STATE), D=r(HEADS), dt_bias=r(HEADS),
                               ssm_state=r(slots, HEADS, HEAD_DIM, D_STATE), dt_softplus=True, dt_max=3.0),
        "mamba": lambda: dict(x=r(tokens, HEADS, 1), dt=r(tokens, HEADS), A=-r(HEADS, D_STATE).abs(),
                              B=r(tokens, 1, D_STATE), C=r(tokens, 1, D_STATE), D=r(HEADS), dt_bias=None,
                              ssm_state=r(slots, HEADS, 1, D_STATE)),
    }[kind]()
    return dict(data, state_indices=torch.tensor([2, 0, 4, -1], dtype=torch.int32),
                has_initial_state=torch.tensor([True, True, False, False]),
                cu_seqlens_q=torch.tensor([0, 1, 4, 8, 10], dtype=torch.int32))


NATIVE_OPS = {"conv": "causal_conv1d_varlen", "delta_rule": "gated_delta_rule_varlen", "kda": "gated_delta_rule_varlen",
              "lightning": "lightning_attention_varlen", "mamba2": "selective_scan_varlen",
              "mamba": "selective_scan_varlen"}
PER_TOKEN = {"x", "q", "k", "v", "g", "beta", "dt", "B", "C"}


@pytest.mark.parametrize("act_dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("kind", NATIVE_OPS)
def test_native_kernels_equal_the_fp64_reference(kind, act_dtype, state_dtype):
    """The native kernels (fp32 accumulation) against the reference kernel run in fp64 on the same
    rounded values."""
    from pagedpack.kernels import native

    if native.native_ops() is None:
        pytest.skip(f"no native kernels: {native.status()}")
    args = _native_sample(kind)
    state_name = "conv_state" if kind == "conv" else "ssm_state"
    ran = {name: t.to(state_dtype if name == state_name else act_dtype) if name == state_name or name in PER_TOKEN
           else t for name, t in args.items()}
    exact = {name: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
             for name, t in ran.items()}
    out = getattr(recurrent, NATIVE_OPS[kind])(**ran)
    expected = getattr(recurrent, NATIVE_OPS[kind])(**exact)
    tol = 1e-5 if act_dtype == state_dtype == torch.float32 else 2e-2
    assert out.dtype == act_dtype and ran[state_name].dtype == state_dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(ran[state_name].double(), exact[state_name], atol=tol, rtol=tol)


def test_inside_the_runner_s_step_the_native_kernels_still_check_slots_and_offsets():
    """In :func:`checked_step` the Python checks are skipped (the KV manager made the metadata); the
    native kernels keep the checks their memory safety needs."""
    from pagedpack.kernels import native
    from pagedpack.kernels.validation import checked_step

    if native.native_ops() is None:
        pytest.skip(f"no native kernels: {native.status()}")
    args = _native_sample("conv")
    with checked_step():
        for change, message in (({"state_indices": torch.tensor([2, 0, 5, -1], dtype=torch.int32)}, "state_indices"),
                                ({"cu_seqlens_q": torch.tensor([0, 1, 4, 8, 11], dtype=torch.int32)}, "cu_seqlens_q")):
            with pytest.raises(ValueError, match=message):
                recurrent.causal_conv1d_varlen(**dict(args, **change))


@pytest.mark.parametrize("kind", NATIVE_OPS)
def test_inside_the_runner_s_step_the_native_kernels_still_check_the_state_s_shape(kind):
    """A state narrower than the layer (a crafted ``.pt2`` whose graph and metadata agree on it) is refused
    by the native kernel, not read and written out of bounds (a tester's crafted LFM2 file segfaulted)."""
    from pagedpack.kernels import native
    from pagedpack.kernels.validation import checked_step

    if native.native_ops() is None:
        pytest.skip(f"no native kernels: {native.status()}")
    args = _native_sample(kind)
    state_name = "conv_state" if kind == "conv" else "ssm_state"
    narrow = args[state_name][..., :1].contiguous()
    with checked_step(), pytest.raises(ValueError, match=f"{state_name}: expected shape"):
        getattr(recurrent, NATIVE_OPS[kind])(**dict(args, **{state_name: narrow}))
