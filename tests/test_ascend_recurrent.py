"""Recurrent layers on the ``ascend`` target (lowering/ascend/recurrent.py): the emulated vllm-ascend /
torch_npu ops against the project's reference ops in fp64 (kernels/recurrent.py), in production's
state layouts; tiny LFM2 and Qwen3.5 hybrids served through the emulation against the unmodified
model run one prompt at a time; and what production has no op for (Mamba2's SSD) refused by name."""
import re
import types

import pytest
import torch
import transformers as T

from pagedpack import LLM, SamplingParams
from pagedpack.lowering.ascend.recurrent import emulated_recurrent_ops, violations
from pagedpack.lowering.ascend.target import AscendOptions, AscendTarget
from pagedpack.lowering.targets import StepBounds
from pagedpack.step.contract import StateSpec

from conftest import assert_greedy_tokens_or_tie, greedy_alone, random_prompts
from test_ascend_schema import (
    C_ASCEND_CAUSAL_CONV,
    C_ASCEND_RECURRENT_GATED_DELTA_RULE,
    NPU_CHUNK_GATED_DELTA_RULE,
    assert_only_real_arguments,
)

OPS = emulated_recurrent_ops()
V, MAX_TOKENS = 258, 4
PROMPTS = random_prompts((3, 17, 40, 5), seed=5, vocab=V)  # the 24-token step budget splits the 17 and the 40
ONE_SLOT_EACH = dict(slots=[2, 0, 3], lengths=[5, 1, 3], initial=[True, False, True])


def _metadata(lengths, slots, initial):
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return cu, torch.tensor(slots, dtype=torch.int32), torch.tensor(initial)


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_causal_conv1d_custom_is_the_reference_conv_in_production_s_layouts():
    """run_mode 0 (fresh and continuing sequences), then run_mode 1 (one token each, always from the
    slot): outputs and states equal the reference op's in fp64, conv_state ``[slots, width - 1, dim]``."""
    torch.manual_seed(0)
    dim, width = 8, 4
    cu, slots, initial = _metadata(ONE_SLOT_EACH["lengths"], ONE_SLOT_EACH["slots"], ONE_SLOT_EACH["initial"])
    x, weight, bias, state = _bf16(9, dim), _bf16(dim, width), _bf16(dim), _bf16(4, dim, width - 1)
    expected_state = state.double()
    ascend_state = state.transpose(1, 2).contiguous()  # production's layout
    for step_x, step_cu, step_initial, run_mode in ((x, cu, initial, 0), (x[:3], torch.tensor([0, 1, 2, 3],
                                                     dtype=torch.int32), torch.ones(3, dtype=torch.bool), 1)):
        expected = torch.ops.pagedpack.causal_conv1d_varlen(step_x.double(), weight.double(), bias.double(),
                                                            expected_state, slots, step_cu, step_initial, "silu")
        out = torch.full_like(step_x, float("nan"))
        got = OPS.causal_conv1d(out, step_x, weight.T, ascend_state, bias, step_cu, slots,
                                step_initial if run_mode == 0 else None, None, 1, -1, run_mode)
        assert got is out
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(ascend_state.transpose(1, 2).double(), expected_state, atol=1e-2, rtol=1e-2)


def test_causal_conv1d_custom_skips_a_padding_slot():
    x, weight, state = _bf16(2, 4), _bf16(3, 4), torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    out = torch.full_like(x, 7.0)
    OPS.causal_conv1d(out, x, weight, state, None, torch.tensor([0, 2], dtype=torch.int32),
                      torch.tensor([-1], dtype=torch.int32), torch.tensor([False]), None, 0, -1, 0)
    assert (out == 7).all() and (state == 0).all()


def test_chunk_gated_delta_rule_is_the_reference_rule_in_production_s_layouts():
    """Sequences in two chunks (the first chunk's final states gathered back as the second's initial
    ones): outputs and states equal the reference op's in fp64, the state value-major ``[B, N_v, D_v, D_k]``."""
    torch.manual_seed(0)
    lengths, num_k, num_v, d = [3, 1, 4], 1, 2, 128
    tokens = sum(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(tokens, num_k, d), dim=-1).to(torch.bfloat16) for _ in "qk")
    v, beta = _bf16(tokens, num_v, d), torch.rand(tokens, num_v).to(torch.bfloat16)
    g = -torch.rand(tokens, num_v)
    cu, slots, initial = _metadata(lengths, [1, 0, 2], [True, False, True])
    state = (torch.randn(3, num_v, d, d) / d).to(torch.bfloat16)  # [slots, N_v, D_k, D_v]: the reference's layout
    expected_state = state.double()
    expected = torch.ops.pagedpack.gated_delta_rule_varlen(q.double(), k.double(), v.double(), g.double(),
                                                           beta.double(), expected_state, slots, cu, initial, 0.125)
    ascend_state = state.transpose(-1, -2).clone()
    initial_state = ascend_state[slots.long()].masked_fill(~initial.view(-1, 1, 1, 1), 0.0)
    out, final = OPS.chunk_gated_delta_rule(q, k, v, beta=beta, initial_state=initial_state,
                                            actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32), scale=0.125,
                                            g=g)
    assert out.dtype == final.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(final.transpose(-1, -2).double(), expected_state[slots.long()], atol=3e-2, rtol=2e-2)


def test_recurrent_gated_delta_rule_is_the_reference_rule_row_by_row():
    """Two sequences of 2 and 1 rows continuing their slots (the first's rows both name its slot):
    outputs and states equal the reference op's in fp64; a sequence past 16 rows is refused."""
    torch.manual_seed(1)
    num_k, num_v, d = 1, 2, 32
    q, k = (torch.nn.functional.normalize(torch.randn(3, num_k, d), dim=-1).to(torch.bfloat16) for _ in "qk")
    v, beta, g = _bf16(3, num_v, d), torch.rand(3, num_v).to(torch.bfloat16), -torch.rand(3, num_v)
    state = (torch.randn(4, num_v, d, d) / d).to(torch.bfloat16)  # [slots, N_v, D_k, D_v]
    cu, slots, initial = _metadata([2, 1], [3, 1], [True, True])
    expected_state = state.double()
    expected = torch.ops.pagedpack.gated_delta_rule_varlen(q.double(), k.double(), v.double(), g.double(),
                                                           beta.double(), expected_state, slots, cu, initial, 0.25)
    ascend_state = state.transpose(-1, -2).contiguous()
    out = OPS.recurrent_gated_delta_rule(q, k, v, ascend_state, beta=beta, scale=0.25,
                                         actual_seq_lengths=torch.tensor([0, 2, 1], dtype=torch.int32),
                                         ssm_state_indices=torch.tensor([3, 3, 1], dtype=torch.int32), g=g)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(ascend_state.transpose(-1, -2).double(), expected_state, atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="sequences of 0..16 rows"):
        OPS.recurrent_gated_delta_rule(*(t.repeat(6, 1, 1) for t in (q, k, v)), ascend_state, beta=beta.repeat(6, 1),
                                       scale=0.25, actual_seq_lengths=torch.tensor([0, 18], dtype=torch.int32),
                                       ssm_state_indices=torch.ones(18, dtype=torch.int32), g=g.repeat(6, 1))


@pytest.mark.parametrize("change, message", [
    (dict(query=lambda t: t.float()), "query must be bfloat16"),
    (dict(value=lambda t: t[..., :64]), "D_k == D_v == 128"),
    (dict(g=lambda t: t.to(torch.bfloat16)), "g must be float32"),
])
def test_chunk_gated_delta_rule_refuses_what_production_rejects(change, message):
    args = dict(query=_bf16(2, 1, 128), key=_bf16(2, 1, 128), value=_bf16(2, 1, 128), beta=_bf16(2, 1),
                initial_state=_bf16(1, 1, 128, 128), actual_seq_lengths=torch.tensor([2], dtype=torch.int32),
                scale=1.0, g=torch.zeros(2, 1))
    for name, f in change.items():
        args[name] = f(args[name])
    with pytest.raises(ValueError, match=message):
        OPS.chunk_gated_delta_rule(args.pop("query"), args.pop("key"), args.pop("value"), **args)


def test_sites_outside_the_ops_limits_are_refused_naming_the_layer():
    """A decay per key channel (Kimi Delta Attention), fp32 activations and state, head dims other
    than 128, and an fp32 conv: each named with its layer (``violations`` reads the recorded shapes)."""
    graph = torch.fx.Graph()
    values = dict(q=torch.empty(2, 1, 64), k=torch.empty(2, 1, 64), v=torch.empty(2, 2, 64), g=torch.empty(2, 2, 64),
                  beta=torch.empty(2, 2), ssm_state_0=torch.empty(1, 2, 64, 64), state_indices=None,
                  cu_seqlens_q=None, has_initial_state=None, x=torch.empty(2, 8), weight=torch.empty(8, 4),
                  conv_state_1=torch.empty(1, 8, 3))
    n = {}
    for name, value in values.items():
        n[name] = graph.placeholder(name)
        n[name].meta["val"] = value
    graph.call_function(torch.ops.pagedpack.gated_delta_rule_varlen.default,
                        tuple(n[a] for a in ("q", "k", "v", "g", "beta", "ssm_state_0", "state_indices",
                                             "cu_seqlens_q", "has_initial_state")) + (0.125,))
    graph.call_function(torch.ops.pagedpack.causal_conv1d_varlen.default,
                        tuple(n[a] for a in ("x", "weight")) + (None,) + tuple(
                            n[a] for a in ("conv_state_1", "state_indices", "cu_seqlens_q", "has_initial_state")))
    specs = [StateSpec("ssm_state", (2, 64, 64), torch.float32, "layers.0.attn"),
             StateSpec("conv_state", (8, 3), torch.float32, "layers.1.conv")]
    found = violations(torch.fx.GraphModule(torch.nn.Module(), graph), specs)
    expected = [("layers.0.attn", "a decay per key channel (Kimi Delta Attention)"),
                ("layers.0.attn", "takes bfloat16 query/key/value, got float32"),
                ("layers.0.attn", "takes a bfloat16 initial_state, the state is float32"),
                ("layers.0.attn", "needs D_k == D_v == 128, got 64 and 64"),
                ("layers.1.conv", "npu_causal_conv1d_custom takes float16 or bfloat16, got float32")]
    assert len(found) == len(expected) and all(line.startswith(f"{layer}: ") and why in line
                                               for line, (layer, why) in zip(found, expected)), found


def _hybrid(config) -> tuple[T.PreTrainedModel, LLM, list[list[int]]]:
    """A bf16 model shaped for FIA (head_dim 128) and the gated delta rule (D_k = D_v = 128), served on the
    ascend target with chunked prefill, and the unmodified model's greedy tokens of each prompt alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    llm = LLM(model, target="ascend", num_blocks=8, max_num_batched_tokens=24, max_num_seqs=4)
    return model, llm, greedy_alone(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def short_conv():
    return _hybrid(T.Lfm2Config(vocab_size=V, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                initializer_range=0.1, layer_types=["conv", "full_attention"]))


@pytest.fixture(scope="module")
def deltanet():
    return _hybrid(T.Qwen3_5TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, initializer_range=0.1, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128))


@pytest.mark.parametrize("hybrid", ["short_conv", "deltanet"])
def test_hybrids_on_ascend_give_each_prompt_its_own_greedy_tokens(hybrid, request):
    model, llm, solo = request.getfixturevalue(hybrid)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0,
                        max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, out, expected in zip(PROMPTS, outs, solo, strict=True):
        assert_greedy_tokens_or_tie(model, prompt, out.outputs[0].token_ids, expected)
    graphs, run = llm.program.graphs, llm.program.run  # no decode graphs with state (the note says why)
    assert graphs.graph_steps == 0 and graphs.eager_steps > run.decode_steps > 0  # both forms ran
    note = next(n for n in llm.report.notes if n.startswith("ascend lowering"))
    assert "every step eager (no decode graphs" in note
    assert ("gated_delta_rule" in note) == (hybrid == "deltanet") and "npu_causal_conv1d_custom" in note  # its ops


def test_the_state_has_production_s_layouts_and_the_calls_only_real_arguments(deltanet):
    _, llm, _ = deltanet
    conv, ssm = llm.program.state_specs
    assert (conv.kind, conv.shape, ssm.kind, ssm.shape) == ("conv_state", (3, 512), "ssm_state", (2, 128, 128))
    assert_only_real_arguments([llm.program.run.prefill, llm.program.run.decode], {
        OPS.causal_conv1d: torch._C.parse_schema(C_ASCEND_CAUSAL_CONV),
        OPS.chunk_gated_delta_rule: torch._C.parse_schema(NPU_CHUNK_GATED_DELTA_RULE),
        OPS.recurrent_gated_delta_rule: torch._C.parse_schema(C_ASCEND_RECURRENT_GATED_DELTA_RULE)})


@pytest.mark.parametrize("mode", ["decode_buckets", "dynamic"])
def test_a_compiling_graph_mode_is_refused_with_state(mode):
    rewritten = types.SimpleNamespace(state_specs=[StateSpec("conv_state", (8, 3), torch.bfloat16, "layers.0")])
    with pytest.raises(ValueError, match=f"graph_mode={mode!r} compiles the step, and .*npu_causal_conv1d_custom"):
        AscendTarget().lower(rewritten, AscendOptions(graph_mode=mode), block_size=128, bounds=StepBounds(256, 8),
                             device="cpu")


@pytest.mark.parametrize("config, layer, why", [
    (T.BambaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                   mamba_d_state=8, mamba_chunk_size=16),
     "model.layers.0.mamba: selective_scan_varlen", "production has no Ascend op"),
    (T.MiniMaxConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                     num_local_experts=2, num_experts_per_tok=1, block_size=8),
     "model.layers.0.self_attn: lightning_attention_varlen", "production runs MiniMax's lightning attention as a "
                                                             "Triton kernel only"),
], ids=["mamba2", "lightning"])
def test_layers_without_a_production_op_are_refused_naming_the_layer_and_the_op(config, layer, why):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=rf"the ascend target does not run these recurrent layers .*\n  "
                                         rf"{re.escape(layer)}: {why}"):
        LLM(model, target="ascend")
