"""The ops the ascend lowering emits against the schemas of the real ones.

The real ops exist only with torch_npu and CANN, so their schema strings are copied here:
TorchAir's ``torch.ops.air.npu_fused_infer_attention_score`` and ``..._v2`` (Ascend/torchair,
``python/torchair/ops/_npu_fused_infer_attention_score.py`` and ``..._v2.py``, ``lib.define``),
torch_npu's eager ``npu_fused_infer_attention_score`` (its function prototype in torch_npu's op
documentation, ``torch_npu-npu_fused_infer_attention_score.md``) and
``npu_fused_infer_attention_score_v2`` (Ascend/op-plugin ``op_plugin/config/op_plugin_functions.yaml``
as of 2026-08, the entry every torch_npu from 2.1 to 2.10 is generated from; 2.14 re-checked at the end), and
``npu_scatter_nd_update_`` (as TorchAir's converter ``_npu_scatter_nd_update_.py`` quotes it),
with its functional twin; for recurrent layers (vllm-ascend main @ 182b75ea, 2026-08-22), vllm-ascend's
``torch.ops._C_ascend.npu_causal_conv1d_custom`` and ``npu_recurrent_gated_delta_rule``
(``csrc/torch_binding.cpp``, ``ops.def``) and torch_npu's
``npu_chunk_gated_delta_rule`` (op-plugin's ``op_plugin_functions.yaml``, as TorchAir's converter
``_npu_chunk_gated_delta_rule.py`` quotes it).
If TorchAir renames or retypes an argument the lowering passes, update the copy and this test
fails until the lowering follows.
"""
import pytest
import torch

from pagedpack import LLM
from pagedpack.lowering.ascend.lower import emulated_ops
from pagedpack.lowering.ascend.recurrent import emulated_recurrent_ops
from pagedpack.models.tiny import tiny_model

AIR_FIA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, Tensor? actual_seq_lengths=None, Tensor? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, "
    "Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
    "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "Tensor? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
    'int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, '
    "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
    "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"
)
NPU_FIA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, "
    "Tensor? block_table=None, Tensor? query_padding_size=None, Tensor? kv_padding_size=None, "
    "Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
    'int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, '
    "int inner_precise=0, int block_size=0, int antiquant_mode=0, bool softmax_lse_flag=False, "
    "int key_antiquant_mode=0, int value_antiquant_mode=0) -> (Tensor, Tensor)"
)
AIR_FIA_V2 = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, Tensor? actual_seq_qlen=None, "
    "Tensor? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, "
    "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
    "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, "
    "Tensor? quant_offset_out=None, Tensor? learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, "
    "float softmax_scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", "
    "int sparse_mode=0, int block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, "
    "int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, "
    "int? value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
    "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, "
    "int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) "
    "-> (Tensor, Tensor)"
)
NPU_FIA_V2 = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
    "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, "
    "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
    "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, "
    "Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? learnable_sink=None, int num_query_heads=1, "
    "int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, "
    "str input_layout=\"BSH\", int sparse_mode=0, int block_size=0, int query_quant_mode=0, int key_quant_mode=0, "
    "int value_quant_mode=0, int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, "
    "int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, "
    "int? key_shared_prefix_dtype=None, int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
    "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, "
    "int? out_dtype=None) -> (Tensor, Tensor)"
)
C_ASCEND_CAUSAL_CONV = (
    "npu_causal_conv1d_custom(Tensor output, Tensor x, Tensor weight, Tensor conv_state, Tensor? bias_opt, "
    "Tensor? query_start_loc_opt, Tensor? cache_indices_opt, Tensor? initial_state_mode_opt, "
    "Tensor? num_accepted_tokens_opt, int activation_mode, int pad_slot_id, int run_mode) -> (Tensor output)"
)
C_ASCEND_RECURRENT_GATED_DELTA_RULE = (
    "npu_recurrent_gated_delta_rule(Tensor query, Tensor key, Tensor value, Tensor(a!) state, *, Tensor? beta=None, "
    "float? scale=None, Tensor? actual_seq_lengths=None, Tensor? ssm_state_indices=None, "
    "Tensor? num_accepted_tokens=None, Tensor? g=None, Tensor? gk=None) -> Tensor"
)
NPU_CHUNK_GATED_DELTA_RULE = (
    "npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *, Tensor? beta=None, "
    "Tensor? initial_state=None, Tensor? actual_seq_lengths=None, float? scale=None, Tensor? g=None) "
    "-> (Tensor, Tensor)"
)
NPU_SCATTER = "npu_scatter_nd_update_(Tensor(a!) input, Tensor indices, Tensor updates) -> Tensor(a!)"
NPU_SCATTER_FUNCTIONAL = "npu_scatter_nd_update(Tensor input, Tensor indices, Tensor updates) -> Tensor"


def arguments(schema: torch._C.FunctionSchema) -> dict[str, torch.Argument]:
    return {a.name: a for a in schema.arguments}


@pytest.mark.parametrize("real, emulated", [
    (AIR_FIA, emulated_ops().fused_infer_attention_score),
    (NPU_FIA, emulated_ops().fused_infer_attention_score_eager),
    (AIR_FIA_V2, emulated_ops().fused_infer_attention_score_v2),
    (NPU_FIA_V2, emulated_ops().fused_infer_attention_score_v2_eager),
    (NPU_SCATTER, emulated_ops().scatter_nd_update_),
    (NPU_SCATTER_FUNCTIONAL, torch.ops.pagedpack_npu.npu_scatter_nd_update.default),
    (C_ASCEND_CAUSAL_CONV, emulated_recurrent_ops().causal_conv1d),
    (NPU_CHUNK_GATED_DELTA_RULE, emulated_recurrent_ops().chunk_gated_delta_rule),
    (C_ASCEND_RECURRENT_GATED_DELTA_RULE, emulated_recurrent_ops().recurrent_gated_delta_rule),
], ids=["air FIA", "npu FIA", "air FIA v2", "npu FIA v2", "scatter_nd_update_", "scatter_nd_update",
        "causal_conv1d_custom", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"])
def test_the_emulation_has_the_real_signature(real, emulated):
    """Every argument of the emulated op exists in the real one, in the same position kind (positional
    or keyword-only), type and default; the returns and the mutation annotation agree."""
    real_schema = torch._C.parse_schema(real)
    ours = emulated._schema
    theirs = arguments(real_schema)
    for arg in ours.arguments:
        assert arg.name in theirs, f"{arg.name} is not an argument of the real op"
        other = theirs[arg.name]
        assert (str(arg.type), arg.default_value, arg.kwarg_only) == (
            str(other.type), other.default_value, other.kwarg_only), arg.name
        assert (arg.alias_info is None) == (other.alias_info is None), arg.name
    assert [str(r.type) for r in ours.returns] == [str(r.type) for r in real_schema.returns]
    positional = [a.name for a in real_schema.arguments if not a.kwarg_only]
    assert [a.name for a in ours.arguments if not a.kwarg_only] == positional


@pytest.mark.parametrize("family, fia", [("llama", "v1"), ("mistral", "v2")])
def test_the_lowering_emits_only_arguments_the_real_ops_take(family, fia):
    """Both lowered graphs of the decode_buckets graph mode: the one compiled per decode bucket
    (air FIA) and the eager one (torch_npu FIA, also what the aclgraph mode runs and captures);
    FIA v1 for plain sites, v2 for the sliding window of the tiny Mistral."""
    llm = LLM(tiny_model(family, dtype=torch.bfloat16, head_dim=128), target="ascend", block_size=128,
              num_blocks=4, max_num_batched_tokens=256, max_num_seqs=8, target_options={"graph_mode": "decode_buckets"})
    ops = emulated_ops()
    schemas = {ops.scatter_nd_update_: torch._C.parse_schema(NPU_SCATTER)}
    if fia == "v1":
        schemas[ops.fused_infer_attention_score] = torch._C.parse_schema(AIR_FIA)
        schemas[ops.fused_infer_attention_score_eager] = torch._C.parse_schema(NPU_FIA)
    else:
        schemas[ops.fused_infer_attention_score_v2] = torch._C.parse_schema(AIR_FIA_V2)
        schemas[ops.fused_infer_attention_score_v2_eager] = torch._C.parse_schema(NPU_FIA_V2)
    assert_only_real_arguments([llm.program.run.graph, llm.program.run.eager], schemas)


def assert_only_real_arguments(graphs, schemas) -> None:
    """Every op of ``schemas`` (emulated op -> the real one's schema) is called in ``graphs``, with
    positional arguments the real op has and keywords it takes."""
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in schemas]
    assert {n.target for n in calls} == set(schemas)
    for node in calls:
        schema = schemas[node.target]
        positional = [a for a in schema.arguments if not a.kwarg_only]
        assert len(node.args) <= len(positional), node.format_node()
        theirs = arguments(schema)
        for key in node.kwargs:
            assert key in theirs and theirs[key].kwarg_only, f"{node.target}: {key} is not a keyword of the real op"


# torch_npu 2.14 (the newest release on the index in 2026-10): the entries of Ascend/op-plugin's
# op_plugin/config/op_plugin_functions.yaml @ 517f2e7d (2026-08-21; its ``all_version`` runs v2.1 to
# v2.15, and each entry below is generated for v2.14: ``[v2.1, newest]`` or ``all_version``), copied
# verbatim from the ``custom`` section (the ``symint`` section repeats FIA and FIA v2 unchanged).
# Against the copies above: the same arguments, types, defaults and returns; FIA's keywords come in
# another order (keyword-only: no effect) and the scatters name their first argument ``self``, where
# TorchAir's converter quotes ``input`` (positional, and passed positionally: no effect).
OP_PLUGIN_V2_14 = {
    # op_api: [v2.1, newest]
    "FIA": (
        'npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, '
        'Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, '
        'Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? '
        'quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? '
        'antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? '
        'value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? '
        'query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? '
        'value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? '
        'key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int '
        'pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int '
        'num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int '
        'antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False)'
        ' -> (Tensor, Tensor)'
    ),
    # op_api: [v2.1, newest]
    "FIA_V2": (
        'npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? '
        'query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? '
        'actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? '
        'dequant_scale_query=None, Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? '
        'dequant_scale_value=None, Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, '
        'Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? '
        'learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int '
        'pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, int '
        'block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int '
        'inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? '
        'value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, int? '
        'key_shared_prefix_dtype=None, int? value_shared_prefix_dtype=None, int? '
        'dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, int? '
        'dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> '
        '(Tensor, Tensor)'
    ),
    # op_api: all_version
    "SCATTER": (
        'npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)'
    ),
    # op_api: all_version
    "SCATTER_FUNCTIONAL": (
        'npu_scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor'
    ),
    # op_api: all_version
    "CHUNK_GATED_DELTA_RULE": (
        'npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *, Tensor? beta=None, Tensor? '
        'initial_state=None, Tensor? actual_seq_lengths=None, float? scale=None, Tensor? g=None) -> (Tensor, '
        'Tensor)'
    ),
}


@pytest.mark.parametrize("name, emulated", [
    ("FIA", emulated_ops().fused_infer_attention_score_eager),
    ("FIA_V2", emulated_ops().fused_infer_attention_score_v2_eager),
    ("SCATTER", emulated_ops().scatter_nd_update_),
    ("SCATTER_FUNCTIONAL", emulated_ops().scatter_nd_update),
    ("CHUNK_GATED_DELTA_RULE", emulated_recurrent_ops().chunk_gated_delta_rule),
])
def test_the_emulation_has_torch_npu_2_14s_signature(name, emulated):
    """Each torch_npu op the lowering emits, against op-plugin's entry for v2.14: every keyword of
    the emulated op has the real one's type, default and kind; positionals agree in number, type
    and mutation annotation (their names are not part of a positional call); the returns agree."""
    real = torch._C.parse_schema(OP_PLUGIN_V2_14[name])
    ours = emulated._schema
    theirs = arguments(real)
    for arg in (a for a in ours.arguments if a.kwarg_only):
        assert arg.name in theirs, f"{arg.name} is not an argument of torch_npu 2.14's op"
        other = theirs[arg.name]
        assert (str(arg.type), arg.default_value, other.kwarg_only) == (str(other.type), other.default_value, True)
    positional = [(str(a.type), a.alias_info is None) for a in real.arguments if not a.kwarg_only]
    assert [(str(a.type), a.alias_info is None) for a in ours.arguments if not a.kwarg_only] == positional
    assert [str(r.type) for r in ours.returns] == [str(r.type) for r in real.returns]


@pytest.mark.parametrize("name, earlier", [("FIA", NPU_FIA), ("FIA_V2", NPU_FIA_V2), ("SCATTER", NPU_SCATTER),
                                           ("SCATTER_FUNCTIONAL", NPU_SCATTER_FUNCTIONAL),
                                           ("CHUNK_GATED_DELTA_RULE", NPU_CHUNK_GATED_DELTA_RULE)])
def test_torch_npu_2_14_changed_none_of_the_ops_since_the_copies_above(name, earlier):
    """What changed from the schemas the lowering followed (2.1 to 2.10) to 2.14: no argument's
    type, default or kind, no return; the only differences are the first positional's name
    (``self``) and FIA's keyword order."""
    def described(schema):
        parsed = torch._C.parse_schema(schema)
        keywords = {a.name: (str(a.type), a.default_value) for a in parsed.arguments if a.kwarg_only}
        positionals = [(str(a.type), a.alias_info is None) for a in parsed.arguments if not a.kwarg_only]
        return keywords, positionals, [str(r.type) for r in parsed.returns]
    assert described(OP_PLUGIN_V2_14[name]) == described(earlier)
