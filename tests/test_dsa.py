"""Sparse attention with a lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA; kernels/sparse_attention.py,
passes/sparse_attention.py, the capture seam in models/seams.py): the ops pass ``opcheck``, the paged ops
equal the one-sequence ops row for row, each packed sequence selects among its own keys only, and tiny
models whose ``index_topk`` is smaller than their prompts are served token for token."""
import pytest
import torch
import transformers as T

from pagedpack import LLM, SamplingParams
from pagedpack.lowering.targets import get_target
from pagedpack.step.contract import UnsupportedModelError

from conftest import hf_greedy, random_prompts, snapshot

ops = torch.ops.pagedpack
V = 258
TOPK = 4
# MLA sizes as tests/test_families.py's kimi_linear; 16 indexer heads (a tie at score 0, every head's
# ReLU zero, is then unlikely), index_topk far below the prompts
_DSA = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.1, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=16,
            index_head_dim=16, index_topk=TOPK, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_group=1, topk_group=1)
# GLM-MoE-DSA's second layer "shared": no indexer of its own, it reuses the first layer's top-k
FAMILIES = {"deepseek_v32": (T.DeepseekV32Config, {}, "sdpa"),
            "glm_moe_dsa": (T.GlmMoeDsaConfig, {"indexer_types": ["full", "shared"]}, "eager")}
BLOCK = 16


def _model(family: str):
    config_class, extra, attn = FAMILIES[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(config_class(**_DSA, **extra), attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def served():
    """``served(family) -> (reference, llm)``: the unmodified model's copy and its ``LLM`` (block 16, a
    16-token step budget, prefix caching on, the rewritten model kept), built once per module."""
    built = {}

    def get(family):
        if family not in built:
            model = _model(family)
            built[family] = snapshot(model), LLM(model, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=16,
                                                 enable_prefix_caching=True, keep_source_model=True)
        return built[family]

    return get


def _step(seqs, num_blocks=16):
    """Paged metadata for sequences ``(seq_len, q_len)``, their blocks scattered over the pool (reversed)."""
    max_blocks = max(-(-n // BLOCK) for n, _ in seqs)
    ids = list(reversed(range(num_blocks)))
    table = torch.tensor([ids[b * max_blocks:(b + 1) * max_blocks] for b in range(len(seqs))], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    slots = [int(table[b, p // BLOCK]) * BLOCK + p % BLOCK for b, (n, q) in enumerate(seqs) for p in range(n - q, n)]
    return table, cu, lens, torch.tensor(slots, dtype=torch.int64)


def _fill(cache, table, b, values):
    """Write ``values [n, ...]`` as sequence ``b``'s first ``n`` tokens of ``cache``."""
    for p, row in enumerate(values):
        cache[table[b, p // BLOCK], p % BLOCK] = row


def test_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    table, cu, lens, slots = _step([(20, 4), (3, 3)])
    t, heads, dim = int(cu[-1]), 4, 8
    q, w = torch.randn(t, heads, dim, generator=g), torch.randn(t, heads, generator=g)
    k, kv = torch.randn(t, dim, generator=g), torch.randn(t, 2, dim, generator=g)
    for dtype, row in ((torch.float32, dim), (torch.int8, dim + 4)):  # a scaled cache (kv_cache_dtype int8) too
        index_cache = torch.zeros(16, BLOCK, 1, row, dtype=dtype)
        torch.library.opcheck(ops.indexer_k_cache, (k, index_cache, slots))
        topk = ops.paged_indexer_topk(q, w, index_cache, table, cu, lens, 0.3, TOPK)
        torch.library.opcheck(ops.paged_indexer_topk, (q, w, index_cache, table, cu, lens, 0.3, TOPK))
        key_cache, value_cache = (torch.zeros(16, BLOCK, 2, row, dtype=dtype) for _ in "kv")
        ops.reshape_and_cache(kv, kv, key_cache, value_cache, slots)
        torch.library.opcheck(ops.sparse_paged_attention, (q, key_cache, value_cache, topk, table, cu, lens, 0.3))
    s = 6
    topk = ops.indexer_topk(q[:s], w[:s], k[:s], 0.3, TOPK)
    torch.library.opcheck(ops.indexer_topk, (q[:s], w[:s], k[:s], 0.3, TOPK))
    torch.library.opcheck(ops.sparse_attention, (q[:s], kv[:s], kv[:s], topk, 0.3))


def test_paged_ops_equal_the_one_sequence_ops_row_for_row():
    """A chunk after 20 cached tokens, a prefill and a decode in one step: every row's top-k and attention
    output equal the one-sequence ops' rows on that sequence alone (its whole length, no cache)."""
    g = torch.Generator().manual_seed(1)
    seqs = [(37, 17), (9, 9), (23, 1)]
    table, cu, lens, slots = _step(seqs)
    heads, dim, kv_heads = 4, 8, 2
    index_cache = torch.zeros(16, BLOCK, 1, dim)
    key_cache, value_cache = torch.zeros(16, BLOCK, kv_heads, dim), torch.zeros(16, BLOCK, kv_heads, dim)
    rows, whole = [], []
    for b, (n, q_len) in enumerate(seqs):
        q, w = torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, generator=g)
        k_idx, k, v = (torch.randn(n, *shape, generator=g) for shape in ((dim,), (kv_heads, dim), (kv_heads, dim)))
        for cache, values in ((index_cache, k_idx[:n - q_len, None]), (key_cache, k[:n - q_len]),
                              (value_cache, v[:n - q_len])):
            _fill(cache, table, b, values)  # the context earlier steps cached
        rows.append((q[n - q_len:], w[n - q_len:], k_idx[n - q_len:], k[n - q_len:], v[n - q_len:]))
        whole.append((q, w, k_idx, k, v))
    q, w, k_idx, k, v = (torch.cat(parts) for parts in zip(*rows))
    ops.indexer_k_cache(k_idx, index_cache, slots)
    ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
    topk = ops.paged_indexer_topk(q, w, index_cache, table, cu, lens, 0.25, TOPK)
    out = ops.sparse_paged_attention(q, key_cache, value_cache, topk, table, cu, lens, 0.25)
    for b, ((n, q_len), (qs, ws, ks_idx, ks, vs)) in enumerate(zip(seqs, whole)):
        want_topk = ops.indexer_topk(qs, ws, ks_idx, 0.25, TOPK)[n - q_len:]
        want = ops.sparse_attention(qs, ks, vs, ops.indexer_topk(qs, ws, ks_idx, 0.25, TOPK), 0.25)[n - q_len:]
        assert torch.equal(topk[cu[b]:cu[b + 1]], want_topk), b
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], want, rtol=1e-5, atol=1e-6)
    assert (topk[:1] == -1).sum() == 0 and (topk[17] == -1).sum() == TOPK - 1  # the prefill's first row: one key


def test_tied_scores_take_the_earliest_keys_however_the_prompt_is_chunked():
    """From a new-user trial: a tiny indexer whose every head's ReLU is zero on many keys ties them, and
    the choice among them followed each row's length, so a chunked prompt took other keys than the same
    prompt in one step. Ties go to the earliest keys; one step, or 20 tokens cached and the rest now,
    select the same keys."""
    dim, heads, n = 8, 2, 30
    g = torch.Generator().manual_seed(3)
    q, w = torch.randn(n, heads, dim, generator=g), torch.rand(n, heads, generator=g)
    k_idx = torch.randn(n, dim, generator=g)
    k_idx[torch.arange(n) % 10 != 0] = 0.0  # nine keys in ten score 0 for every row: ties at the cut
    whole = ops.indexer_topk(q, w, k_idx, 1.0, TOPK)
    cut_ties = 0
    for row, keys in enumerate(whole.tolist()):
        chosen = [j for j in keys if j >= 0]
        scores = (w[row, :, None] * torch.relu(q[row] @ k_idx[:row + 1].T)).sum(0)
        tied = [j for j in range(row + 1) if scores[j] == scores[chosen[-1]]]
        taken = [j for j in chosen if j in tied]
        assert taken == tied[:len(taken)], row  # the earliest of the tied keys
        cut_ties += row >= 20 and len(tied) > len(taken)
    assert cut_ties >= 5  # the chunk's rows choose among ties
    table, cu, lens, slots = _step([(n, n - 20)])
    index_cache = torch.zeros(16, BLOCK, 1, dim)
    _fill(index_cache, table, 0, k_idx[:20, None])
    ops.indexer_k_cache(k_idx[20:], index_cache, slots)
    assert torch.equal(ops.paged_indexer_topk(q[20:], w[20:], index_cache, table, cu, lens, 1.0, TOPK), whole[20:])


def test_each_sequence_selects_among_its_own_keys_only():
    """Two packed sequences, the second holding a key that out-scores every key of the first for the
    first's queries: scored over both sequences' keys (the second's placed before the first's), the
    first's rows would all take it first; the paged top-k gives the first's rows their own best keys,
    as the first alone does, and the second's rows the second's key."""
    dim, heads = 8, 2
    table, cu, lens, slots = _step([(6, 6), (5, 5)])
    q, w = torch.ones(11, heads, dim), torch.ones(11, heads)
    k_idx = torch.full((11, dim), 0.1)
    k_idx[:6] += torch.arange(6)[:, None] * 0.01  # the first's keys, later ones scoring higher
    k_idx[6 + 2] = 10.0  # the second's third key: the largest score for any query
    index_cache = torch.zeros(16, BLOCK, 1, dim)
    ops.indexer_k_cache(k_idx, index_cache, slots)
    topk = ops.paged_indexer_topk(q, w, index_cache, table, cu, lens, 1.0, 2)
    second_then_first = torch.cat([k_idx[6:], k_idx[:6]])
    together = ops.indexer_topk(torch.cat([q[6:], q[:6]]), torch.cat([w[6:], w[:6]]), second_then_first, 1.0, 2)
    assert together[5:, 0].tolist() == [2] * 6  # the first's rows, seeing the second's keys, would take its key 2
    assert torch.equal(topk[:6], ops.indexer_topk(q[:6], w[:6], k_idx[:6], 1.0, 2))
    assert topk[:6].tolist() == [[0, -1], [1, 0], [2, 1], [3, 2], [4, 3], [5, 4]]
    assert topk[6 + 3:, 0].tolist() == [2, 2]  # the second's rows at positions 3 and 4: its own key 2


@pytest.mark.parametrize("family", FAMILIES)
def test_dsa_family_is_served_token_for_token(family, served):
    """index_topk 4 against prompts of 1 to 40 tokens, batched, chunked (16-token budget), block 16, prefix
    caching on (a second batch extends two prompts of the first: its full blocks are cache hits), greedy:
    the unmodified model's tokens, prompt by prompt; the same model attending densely gives others."""
    reference, llm = served(family)
    dense = snapshot(reference)
    for layer in dense.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.index_topk = 2048  # every key: the tokens before sparse selection was served
    assert [s.params for s in llm.report.sites] == [f"sparse top-{TOPK}"] * 2, llm.report.format()
    first = random_prompts((1, 5, 19, 40), seed=1, vocab=V)
    second = [first[3][:32] + [7, 8, 9], first[2] + first[3][:20]]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    outputs = llm.generate(first, params, use_tqdm=False)
    hits = llm.get_stats().prefix_cache_hits
    outputs += llm.generate(second, params, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits >= hits + 2 * BLOCK
    got = [out.outputs[0].token_ids for out in outputs]
    want = [hf_greedy(reference, prompt, 5) for prompt in first + second]
    assert got == want
    assert any(hf_greedy(dense, prompt, 5) != tokens for prompt, tokens in zip(first + second, want))


def test_dsa_layers_are_refused_by_name_where_no_lowering_exists(served, tmp_path):
    """The ascend and onnx targets, and the onnx format, refuse each DSA layer by name (no lowering to
    npu_lightning_indexer / npu_sparse_flash_attention, no onnx function); the pt2 export serves the same
    tokens as the model."""
    reference, llm = served("deepseek_v32")
    refused = get_target("ascend").sparse_attention_refusals(llm.rewritten)
    assert [line.split(":")[0] for line in refused] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert "npu_lightning_indexer and npu_sparse_flash_attention" in refused[0]
    assert len(get_target("onnx").sparse_attention_refusals(llm.rewritten)) == 2
    assert get_target("reference").sparse_attention_refusals(llm.rewritten) == []
    with pytest.raises(ValueError, match=r"sparse-attention \(DSA\) layers \(model.layers.0.self_attn, "):
        llm.export(tmp_path / "m.onnx", format="onnx")
    served = LLM.from_exported(llm.export(tmp_path / "m.pt2"), block_size=BLOCK, num_blocks=32,
                               max_num_batched_tokens=16)
    prompts = random_prompts((3, 30), seed=3, vocab=V)
    outputs = served.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(reference, p, 4) for p in prompts]


def test_an_indexer_pagedpack_does_not_page_is_refused_by_name():
    """AXK2's indexer is DeepSeek-V3.2's, its attention another (a gate): no seam records it, and as dense
    attention it would be wrong past its top-k: refused before export, naming the indexer."""
    model = T.AutoModelForCausalLM.from_config(T.AXK2Config(**_DSA)).eval()
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.self_attn.indexer: AXK2Indexer\) selects each "
                                                     r"query's top-k keys in a form pagedpack does not page yet"):
        LLM(model, num_blocks=8)


def test_the_torch_compile_backend_runs_a_dsa_model_as_captured_and_says_why():
    """Dynamo captures outside the seams: the backend leaves the graph as captured (the unmodified model's
    logits, its top-k mask included) and its report names the indexer."""
    from pagedpack.compiler import backend

    model = _model("deepseek_v32")
    torch._dynamo.reset()
    backend.LAST_REPORTS.clear()
    ids = torch.tensor(random_prompts((12,), seed=4, vocab=V))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        logits = torch.compile(model, backend="pagedpack", dynamic=True)(input_ids=ids).logits
    torch.testing.assert_close(logits, expected)
    assert any("(model.layers.0.self_attn.indexer: DeepseekV32Indexer) selects each query's top-k keys: the "
               "torch.compile backend does not page it" in note for report in backend.LAST_REPORTS
               for note in report.notes), [report.notes for report in backend.LAST_REPORTS]
