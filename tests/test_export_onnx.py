"""ONNX export: the model's structure (checker, functions, dynamic axes, functional caches),
generation through onnxruntime across families, and the ``com.microsoft.PagedAttention`` form
checked against the schema onnxruntime itself registers (it has no CPU kernel to run here)."""

import onnx
import onnxruntime
import pytest
import torch
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from pagedpack import LLM, SamplingParams
from pagedpack.compiler.program import load_exported
from pagedpack.lowering.onnx.export import export_onnx
from pagedpack.models.tiny import tiny_model

from conftest import MIXED_PROMPT_LENS, run_cli

DYNAMIC_AXES = {"input_ids": ["num_tokens"], "positions": ["num_tokens"], "cu_seqlens_q": ["num_seqs + 1"],
                "seq_lens": ["num_seqs"], "block_table": ["num_seqs", "max_blocks_per_seq"],
                "slot_mapping": ["num_tokens"], "logits_indices": ["num_logits_rows"]}


def dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def llama():
    return LLM(tiny_model("llama"), block_size=16, max_num_batched_tokens=256, keep_source_model=True)


@pytest.fixture(scope="module")
def exported(llama, tmp_path_factory):
    path = llama.export(tmp_path_factory.mktemp("onnx") / "llama.onnx", format="onnx")
    return path, onnx.load(path)


def test_checker_full_check(exported):
    path, _ = exported
    onnx.checker.check_model(path, full_check=True)  # shape inference through the functions, strict


def test_attention_is_pagedpack_functions_of_standard_ops(exported, llama):
    _, model = exported
    num_layers = len(llama.rewritten.kv_cache_specs)
    functions = {(f.domain, f.name): f for f in model.functions}
    assert set(functions) == {("pagedpack", "reshape_and_cache"), ("pagedpack", "paged_attention")}
    for f in functions.values():
        assert {n.domain for n in f.node} == {""}, f.name  # bodies: standard ONNX only
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert {d for d, _ in ops} == {"", "pagedpack"}
    assert ops.count(("pagedpack", "reshape_and_cache")) == ops.count(("pagedpack", "paged_attention")) == num_layers
    assert {o.domain: o.version for o in model.opset_import} == {"": 20, "pagedpack": 1}


def test_dynamic_axes_and_functional_caches(exported, llama):
    _, model = exported
    spec = llama.rewritten.kv_cache_specs[0]
    inputs, outputs = {i.name: i for i in model.graph.input}, {o.name: o for o in model.graph.output}
    for name, want in DYNAMIC_AXES.items():
        assert dims(inputs[name]) == want, name
    assert dims(outputs["logits"]) == ["num_logits_rows", llama.vocab_size]
    cache_dims = ["num_blocks", "block_size", spec.num_kv_heads, spec.key_head_size]
    writers = {out: n for n in model.graph.node for out in n.output}
    for i in range(len(llama.rewritten.kv_cache_specs)):
        for kind in ("key", "value"):
            assert dims(inputs[f"{kind}_cache_{i}"]) == dims(outputs[f"{kind}_cache_out_{i}"]) == cache_dims
            writer = writers[f"{kind}_cache_out_{i}"]  # the updated cache is a new value, not an alias
            assert writer.op_type == "reshape_and_cache" and f"{kind}_cache_{i}" in writer.input


def test_a_kv_cache_dtype_onnxruntime_cannot_take_is_refused_by_its_name(exported):
    """The session's cache inputs are typed with the model's dtype (a scaled cache would need BitCast)."""
    with pytest.raises(ValueError, match=r"onnx target keeps the KV cache in the model's dtype \(float32\), got "
                                         r"float8_e4m3fn \(kv_cache_dtype='fp8'\)"):
        LLM.from_exported(exported[0], kv_cache_dtype="fp8")


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_onnxruntime_generation_matches_pytorch(family, mixed_prompts, tmp_path):
    # Llama (and the fresh-process load) is covered by test_export.py for both formats.
    llm = LLM(tiny_model(family), block_size=16, max_num_batched_tokens=256, keep_source_model=True)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in llm.generate(mixed_prompts, params, use_tqdm=False)]
    loaded = LLM.from_exported(llm.export(tmp_path / f"{family}.onnx", format="onnx"), block_size=16,
                               max_num_batched_tokens=256)
    got = [o.outputs[0].token_ids for o in loaded.generate(mixed_prompts, params, use_tqdm=False)]
    for n, w, g in zip(MIXED_PROMPT_LENS, want, got):
        assert g == w, f"prompt length {n}"


# ---------------------------------------------------------------- com.microsoft.PagedAttention


@pytest.fixture(scope="module")
def microsoft(tmp_path_factory):
    llm = LLM(tiny_model("llama"), dtype=torch.float16, block_size=16, num_blocks=8, keep_source_model=True)
    path = llm.export(tmp_path_factory.mktemp("onnx") / "llama-ms.onnx", format="onnx", attention="com.microsoft")
    return llm, path, onnx.load(path)


def ort_schema(name: str, domain: str):
    (schema,) = [s for s in ort_state.get_all_operator_schema() if s.name == name and s.domain == domain]
    return schema


def test_paged_attention_nodes_follow_onnxruntime_schema(microsoft):
    llm, _, model = microsoft
    schema = ort_schema("PagedAttention", "com.microsoft")
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    allowed = {c.type_param_str: {s.removeprefix("tensor(").removesuffix(")") for s in c.allowed_type_strs}
               for c in schema.type_constraints}
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == len(llm.rewritten.kv_cache_specs) and not model.functions
    assert {n.domain for n in model.graph.node} == {"", "com.microsoft"}
    option = ort_state.schemadef.OpSchema.FormalParameterOption
    for i, node in enumerate(nodes):
        assert node.domain == "com.microsoft" and len(node.input) <= len(schema.inputs)
        given = dict(zip((p.name for p in schema.inputs), node.input))
        for param in schema.inputs:
            value = given.get(param.name, "")
            if param.option == option.Single:
                assert value, f"required input {param.name} missing"
            if value:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(types[value]).name
                dtype = {"float32": "float", "float16": "float16"}.get(dtype, dtype)
                assert dtype in allowed[param.typeStr], (param.name, dtype)
        # Wiring: the step's own caches in, updated caches out; metadata where the schema wants it.
        assert given["key_cache"] == f"key_cache_{i}" and given["value_cache"] == f"value_cache_{i}"
        assert given["cumulative_sequence_length"] == "cu_seqlens_q" and given["block_table"] == "block_table"
        assert len(node.output) == len(schema.outputs) == 3
        assert list(node.output[1:]) == [f"key_cache_out_{i}", f"value_cache_out_{i}"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for name, attr in schema.attributes.items():
            if attr.required:
                assert name in attrs, name
        for a in node.attribute:
            assert a.name in schema.attributes and a.type == int(schema.attributes[a.name].type), a.name
        spec = llm.rewritten.kv_cache_specs[i]
        config = llm.model.config
        assert attrs["num_heads"] == config.num_attention_heads
        assert attrs["kv_num_heads"] == spec.num_kv_heads == config.num_key_value_heads
        assert attrs["is_causal"] == 1 and attrs["scale"] == pytest.approx(spec.key_head_size ** -0.5)


def test_onnxruntime_accepts_the_graph_and_lacks_only_a_cpu_kernel(microsoft):
    # Session creation resolves the graph (schema and type inference of every node) before it
    # looks for kernels; the CPU provider then has none for PagedAttention.
    _, path, _ = microsoft
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED.*Could not find an implementation for PagedAttention"):
        onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="CUDA provider only"):
        load_exported(path)


def test_bad_attention_arguments(llama, tmp_path):
    with pytest.raises(ValueError, match="attention: expected one of"):
        export_onnx(llama.rewritten, tmp_path / "x.onnx", attention="flash")
    with pytest.raises(ValueError, match="float16 or bfloat16.*float32"):
        export_onnx(llama.rewritten, tmp_path / "x.onnx", attention="com.microsoft")
    foreign = tmp_path / "foreign.onnx"
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])), foreign)
    with pytest.raises(ValueError, match="not a pagedpack ONNX model"):
        load_exported(foreign)


def test_cli_refuses_com_microsoft_for_float32(tmp_path, capsys):
    code, _, stderr = run_cli(capsys, "export", "--format", "onnx", "--attention", "com.microsoft",
                              "--out", str(tmp_path / "x.onnx"))
    assert code == 2 and "float16 or bfloat16" in stderr
