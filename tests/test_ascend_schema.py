"""The ops the ascend lowering emits against the schemas of the real ones.

The real ops exist only with torch_npu and CANN, so their schema strings are copied here:
TorchAir's ``torch.ops.air.npu_fused_infer_attention_score`` (Ascend/torchair,
``python/torchair/ops/_npu_fused_infer_attention_score.py``, ``lib.define``), torch_npu's eager
``npu_fused_infer_attention_score`` (its function prototype in torch_npu's op documentation,
``torch_npu-npu_fused_infer_attention_score.md``) and ``npu_scatter_nd_update_`` (as TorchAir's
converter ``_npu_scatter_nd_update_.py`` quotes it), with its functional twin.
If TorchAir renames or retypes an argument the lowering passes, update the copy and this test
fails until the lowering follows.
"""
import pytest
import torch

from pagedpack import LLM
from pagedpack.lowering.ascend.lower import emulated_ops
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
NPU_SCATTER = "npu_scatter_nd_update_(Tensor(a!) input, Tensor indices, Tensor updates) -> Tensor(a!)"
NPU_SCATTER_FUNCTIONAL = "npu_scatter_nd_update(Tensor input, Tensor indices, Tensor updates) -> Tensor"


def arguments(schema: torch._C.FunctionSchema) -> dict[str, torch.Argument]:
    return {a.name: a for a in schema.arguments}


@pytest.mark.parametrize("real, emulated", [
    (AIR_FIA, emulated_ops().fused_infer_attention_score),
    (NPU_FIA, emulated_ops().fused_infer_attention_score_eager),
    (NPU_SCATTER, emulated_ops().scatter_nd_update_),
    (NPU_SCATTER_FUNCTIONAL, torch.ops.pagedpack_npu.npu_scatter_nd_update.default),
], ids=["air FIA", "npu FIA", "scatter_nd_update_", "scatter_nd_update"])
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


def test_the_lowering_emits_only_arguments_the_real_ops_take():
    """Both lowered graphs of the decode_buckets graph mode: the one compiled per decode bucket
    (air FIA) and the eager one (torch_npu FIA, also what the aclgraph mode runs and captures)."""
    llm = LLM(tiny_model("llama", dtype=torch.bfloat16, head_dim=128), target="ascend", block_size=128,
              num_blocks=4, max_num_batched_tokens=256, max_num_seqs=8, target_options={"graph_mode": "decode_buckets"})
    ops = emulated_ops()
    schemas = {ops.fused_infer_attention_score: torch._C.parse_schema(AIR_FIA),
               ops.fused_infer_attention_score_eager: torch._C.parse_schema(NPU_FIA),
               ops.scatter_nd_update_: torch._C.parse_schema(NPU_SCATTER)}
    calls = [n for gm in (llm.program.run.graph, llm.program.run.eager) for n in gm.graph.nodes
             if n.op == "call_function" and n.target in schemas]
    assert {n.target for n in calls} == set(schemas)
    for node in calls:
        schema = schemas[node.target]
        positional = [a for a in schema.arguments if not a.kwarg_only]
        assert len(node.args) <= len(positional), node.format_node()
        theirs = arguments(schema)
        for key in node.kwargs:
            assert key in theirs and theirs[key].kwarg_only, f"{node.target}: {key} is not a keyword of the real op"
