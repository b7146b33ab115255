"""The native CPU kernels (``kernels/csrc``): the cases their own code paths add to ``test_ops``
(split-KV merges over long contexts, the flash and SDPA paths of long query runs, low-precision caches,
checks that must hold when the per-call Python checks are skipped), and the build's fallback.

References are the explicit-mask attention of ``test_ops`` (independent) and, where the
semantics are the reference kernel's own, ``PAGEDPACK_NATIVE=0``.
"""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedpack.kernels import native
from pagedpack.kernels.validation import checked_step

from conftest import assert_rounded_close
from test_ops import make_params, make_step, reference_attention

ops = torch.ops.pagedpack
pytestmark = pytest.mark.skipif(native.native_ops() is None, reason=f"native kernels: {native.status()}")


def run_step(seqs, params=None, *, dtype=torch.float32, drop_last_key=None, **kw):
    """Write a packed step's K/V, run ``paged_attention``; returns the output and, per sequence,
    the explicit-mask reference in fp32. ``drop_last_key=b``: the kernel is told sequence ``b`` has
    one key fewer (a defect the checks must see; the reference keeps every key)."""
    batch, write, full_kv = make_step(seqs, dtype=dtype, **kw)
    params = params or {}
    ops.reshape_and_cache(write["key"], write["value"], batch["key_cache"], batch["value_cache"],
                          write["slot_mapping"])
    if drop_last_key is not None:
        batch["seq_lens"] = batch["seq_lens"].clone()
        batch["seq_lens"][drop_last_key] -= 1
    out = ops.paged_attention(**batch, **params)
    cu = batch["cu_seqlens_q"].tolist()
    expected = [reference_attention(batch["query"][cu[b]:cu[b + 1]].float(), k.float(), v.float(), batch["scale"],
                                    **params) for b, (k, v) in enumerate(full_kv)]
    return out, torch.cat(expected)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The kernel's work split for 1 and for 2 threads, run on that many (the suite's workers get
    fewer threads each: tests/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("q_len", [1, 3, 40])
@pytest.mark.parametrize("with_params", [False, True])
def test_long_context_split_kv(q_len, with_params, threads):
    """One sequence with 3000 keys: few work items, so the KV range is split and merged."""
    params = make_params(4, window=700, soft_cap=20.0, alibi=True, sinks=True) if with_params else None
    out, expected = run_step([(3000 - q_len, q_len)], params, num_kv_heads=1, ratio=4, head_dim=64, block_size=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 70)), min_size=1, max_size=6),
       head_dim=st.sampled_from([64, 80, 128, 256]), ratio=st.sampled_from([1, 3, 4]),
       block_size=st.sampled_from([1, 16, 32]), seed=st.integers(0, 2**31))
def test_mixed_steps_both_paths(seqs, head_dim, ratio, block_size, seed):
    """Decode, short chunks (in-place path) and runs of >= 32 rows (the flash path: BRGEMM tiles)
    in one step, for every head-dim specialisation (64, 128, 256) and the generic one (80)."""
    seqs = [(c, q) if c + q else (c, 1) for c, q in seqs]
    out, expected = run_step(seqs, num_kv_heads=2, ratio=ratio, head_dim=head_dim, block_size=block_size,
                             g=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_kv_heads, head_dim", [(3, 64), (4, 256), (5, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_items_span_kv_heads(num_kv_heads, head_dim, dtype, threads):
    """Enough decode rows to keep every thread busy: a work item covers several KV heads (all 3;
    2 of 4 at head_dim 256, where the chunk caps them; all 5 of the generic head dim), with a chunk
    and a long context in the same step; against the explicit-mask reference (fp32 to 2e-5, bf16
    rounded once)."""
    seqs = [(n, 1) for n in (1, 17, 63, 200, 401, 950)] + [(30, 5), (0, 9)]
    out, expected = run_step(seqs, dtype=dtype, num_kv_heads=num_kv_heads, ratio=3, head_dim=head_dim,
                             block_size=16, g=torch.Generator().manual_seed(num_kv_heads))
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    else:
        assert_rounded_close(out, expected)


@pytest.mark.parametrize("head_dim, ratio", [(64, 5), (64, 8), (128, 3), (32, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_groups_wider_than_a_register_tile(head_dim, ratio, dtype):
    """A GQA group's query heads share each K/V row read in tiles of up to 4 heads (2 at head_dim
    128): groups of 5, 8, 3 and 6 split over tiles, with per-head ALiBi slopes, sinks and a soft cap
    (each tile's heads must get their own), decode rows and short chunks; against the explicit-mask
    reference."""
    params = make_params(2 * ratio, soft_cap=30.0, alibi=True, sinks=True, seed=ratio)
    seqs = [(n, 1) for n in (0, 15, 40, 333)] + [(20, 3), (0, 7)]
    out, expected = run_step(seqs, params, dtype=dtype, num_kv_heads=2, ratio=ratio, head_dim=head_dim,
                             block_size=16, g=torch.Generator().manual_seed(ratio))
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    else:
        assert_rounded_close(out, expected)


@pytest.mark.parametrize("head_dim, ratio", [(64, 3), (128, 1), (80, 4)])
def test_fp32_prefill(head_dim, ratio, threads):
    """fp32 runs of >= 32 rows on the flash path (BRGEMM tiles over 128-key blocks, 64-row items
    shared by the threads), fresh, chunked after a past of 1..300 keys, and across block edges:
    the explicit-mask reference to 2e-5."""
    seqs = [(0, 32), (0, 200), (100, 64), (1, 129), (300, 40), (7, 1)]
    out, expected = run_step(seqs, num_kv_heads=2, ratio=ratio, head_dim=head_dim, block_size=16,
                             g=torch.Generator().manual_seed(head_dim))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_caches_are_the_fp32_result_rounded(dtype, monkeypatch):
    """bf16/fp16 query and caches: the fp32-accumulating native kernel and the reference kernel are
    the fp32 explicit-mask result up to its rounding (``assert_rounded_close``); a kernel that
    drops the (600, 1) decode's last key fails that rule."""
    seqs = [(0, 37), (100, 1), (5, 3), (600, 1)]
    out, exact = run_step(seqs, dtype=dtype, head_dim=64, g=torch.Generator().manual_seed(1))
    assert out.dtype == dtype
    assert_rounded_close(out, exact)
    dropped, _ = run_step(seqs, dtype=dtype, head_dim=64, g=torch.Generator().manual_seed(1), drop_last_key=3)
    with pytest.raises(AssertionError):
        assert_rounded_close(dropped, exact)
    monkeypatch.setenv("PAGEDPACK_NATIVE", "0")
    reference, _ = run_step(seqs, dtype=dtype, head_dim=64, g=torch.Generator().manual_seed(1))
    assert_rounded_close(reference, exact)


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), [
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.float64, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_the_output_has_the_query_dtype_whatever_the_cache(query_dtype, cache_dtype, threads, monkeypatch):
    """The query is read and the output written in the query's own dtype (no fp32 copy of either):
    the decode items, a 40-row prefill (flash where query and caches share bf16 or fp32, else SDPA
    over the copied K/V) and a row that sees no key (zeros) each give the fp32 result on the query's
    values, rounded once to the query's dtype."""
    monkeypatch.delenv("PAGEDPACK_VALIDATE", raising=False)  # the checks refuse seq_lens < q_len
    seqs = [(70, 1), (0, 40), (9, 3)]
    batch, write, full_kv = make_step(seqs, dtype=cache_dtype, head_dim=64, g=torch.Generator().manual_seed(2))
    ops.reshape_and_cache(write["key"], write["value"], batch["key_cache"], batch["value_cache"], write["slot_mapping"])
    batch["query"] = batch["query"].to(query_dtype)
    batch["seq_lens"] = batch["seq_lens"].clone()
    batch["seq_lens"][2] = 2  # sequence 2's 3 rows over 2 keys: its first row sees none
    out = ops.paged_attention(**batch)
    assert out.dtype == query_dtype and out.shape == batch["query"].shape
    cu, q = batch["cu_seqlens_q"].tolist(), batch["query"]
    exact = torch.cat([reference_attention(q[cu[b]:cu[b + 1]], k[:n], v[:n], batch["scale"], torch.float64)
                       for b, ((k, v), n) in enumerate(zip(full_kv, batch["seq_lens"].tolist()))])
    exact[cu[2]] = 0.0  # reference_attention's row with no key is NaN; the kernels' is zeros
    if query_dtype in (torch.bfloat16, torch.float16):
        assert_rounded_close(out, exact)
    else:  # fp32 compute on the query's values: fp32's own error, in a float64 output too
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 20)), min_size=1, max_size=6),
       head_dim=st.sampled_from([64, 80, 128, 256]), ratio=st.sampled_from([1, 3, 4]),
       block_size=st.sampled_from([1, 16]), seed=st.integers(0, 2**31))
def test_bf16_decode_and_short_chunks(seqs, head_dim, ratio, block_size, seed):
    """bf16 caches on the in-place path (decode rows and chunks under 32 rows: vectorised bf16 loads,
    scores a vector of keys at a time, ragged tails), for each head-dim specialisation and the generic
    one (80): the fp32 explicit-mask result rounded once; told one key fewer, the first sequence fails."""
    kw = dict(dtype=torch.bfloat16, num_kv_heads=2, ratio=ratio, head_dim=head_dim, block_size=block_size)
    out, exact = run_step(seqs, g=torch.Generator().manual_seed(seed), **kw)
    assert_rounded_close(out, exact)
    q_len = seqs[0][1]
    dropped, _ = run_step(seqs, g=torch.Generator().manual_seed(seed), drop_last_key=0, **kw)
    with pytest.raises(AssertionError):
        assert_rounded_close(dropped[:q_len], exact[:q_len])


@settings(max_examples=25, deadline=None,  # `threads` holds for every example: not reset between them is right
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=st.lists(st.tuples(st.integers(0, 300), st.integers(32, 300)), min_size=1, max_size=3),
       head_dim=st.sampled_from([64, 80, 128]), ratio=st.sampled_from([1, 3]), block_size=st.sampled_from([1, 16]),
       seed=st.integers(0, 2**31))
@example(seqs=[(90, 64)], head_dim=64, ratio=1, block_size=16, seed=0)  # a diagonal tile sees none of its block
def test_bf16_prefill(seqs, head_dim, ratio, block_size, seed, threads):
    """bf16 runs of >= 32 query rows (the flash path: BRGEMM tiles), fresh and chunked (a cached
    past), any GQA ratio, head dims with and without a register kernel: the fp32 explicit-mask
    result rounded once, as on every other path (P's hi + lo terms); a kernel told one key fewer
    (every row's causal edge moves) fails that rule."""
    kw = dict(dtype=torch.bfloat16, num_kv_heads=2, ratio=ratio, head_dim=head_dim, block_size=block_size)
    out, exact = run_step(seqs, g=torch.Generator().manual_seed(seed), **kw)
    assert_rounded_close(out, exact)
    cached, q_len = seqs[0]
    if cached:
        dropped, _ = run_step(seqs, g=torch.Generator().manual_seed(seed), drop_last_key=0, **kw)
        with pytest.raises(AssertionError):
            assert_rounded_close(dropped[:q_len], exact[:q_len])


def test_prefill_takes_brgemm_where_the_cpu_has_it():
    """``test_bf16_prefill`` and ``test_mixed_steps_both_paths`` test the BRGEMM kernel, not the
    SDPA fallback: fp32 on a CPU with AVX-512, bf16 with AVX512-BF16 or AMX; head dims oneDNN's
    micro-kernel cannot pair (odd) and fp16 take the fallback."""
    uses = torch.ops.pagedpack_cpu.prefill_uses_brgemm
    flags = set(open("/proc/cpuinfo").read().split())
    assert not uses(torch.float16, 64, 64)
    for dtype, needs in ((torch.float32, {"avx512f"}), (torch.bfloat16, {"avx512_bf16", "amx_bf16"})):
        if needs & flags:
            assert all(uses(dtype, d, d) for d in (64, 80, 128, 256)), dtype
            assert not uses(dtype, 65, 65)


def test_bad_metadata_raises_inside_a_checked_step():
    """In the runner's step the Python checks are skipped; the kernel still refuses a block id
    outside the pool, a slot outside the pool and mismatched head dims instead of reading
    outside the caches."""
    batch, write, _ = make_step([(20, 1)], num_kv_heads=2, ratio=2, head_dim=64, block_size=16)
    with checked_step():
        bad = dict(batch, block_table=batch["block_table"].clone().fill_(10**6))
        with pytest.raises(ValueError, match=r"block_table: expected block ids in \[0, "):
            ops.paged_attention(**bad)
        with pytest.raises(ValueError, match="head dims do not match"):
            ops.paged_attention(**dict(batch, query=batch["query"][..., :32]))
        with pytest.raises(ValueError, match=r"slot_mapping: expected -1 or a slot in \[0, "):
            ops.reshape_and_cache(write["key"], write["value"], batch["key_cache"], batch["value_cache"],
                                  torch.full_like(write["slot_mapping"], 10**7))
        with pytest.raises(ValueError, match="slot_mapping: expected dtype int32 or int64, got Float"):
            ops.reshape_and_cache(write["key"], write["value"], batch["key_cache"], batch["value_cache"],
                                  write["slot_mapping"].float())


@pytest.mark.parametrize(("params", "message"), [
    (dict(sliding_window=0), "sliding_window: expected None or an int >= 1"),
    (dict(logits_soft_cap=float("nan")), "logits_soft_cap: expected None or a finite float > 0"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap: expected None or a finite float > 0"),
    (dict(sinks=torch.zeros(1)), r"sinks: expected a floating tensor of shape \[num_heads\] = \(4,\)"),
    (dict(alibi_slopes=torch.zeros(4, dtype=torch.int32)), "alibi_slopes: expected a floating tensor"),
])
def test_bad_attention_parameters_raise_inside_a_checked_step(params, message):
    """The parameters' Python checks are skipped in the runner's step too; the kernel refuses
    values it would read out of bounds with (a sinks tensor shorter than the heads) or compute
    garbage from."""
    batch, _, _ = make_step([(20, 1)], num_kv_heads=2, ratio=2, head_dim=64, block_size=16)
    with checked_step(), pytest.raises(ValueError, match=message):
        ops.paged_attention(**batch, **params)


def test_a_cache_of_empty_blocks_is_refused_not_divided_by():
    """block_size 0 (a zero-size cache dimension) raised SIGFPE in the kernel's metadata check."""
    cache = torch.empty(4, 0, 1, 16)
    int32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="key_cache: expected block_size >= 1"):
        torch.ops.pagedpack_cpu.paged_attention(torch.randn(0, 1, 16), cache, cache, torch.zeros(1, 1, **int32),
                                                torch.tensor([0, 0], **int32), torch.tensor([0], **int32), 0.25)


def test_status_reports_without_building(tmp_path):
    """``status()`` (the README's "which kernels?" check) in a fresh process with an empty cache: it
    says the library is not built yet and starts no compiler (a fake one would leave a mark), writes
    nothing into the cache; with a build in the cache it says so and does not load it (the file
    here is no library: loading it would fail)."""
    mark = tmp_path / "compiler-ran"
    fake = tmp_path / "fake-c++"
    fake.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    code = ("import sys, time\n"
            "start = time.monotonic()\n"
            "from pagedpack.kernels import native\n"
            "print(native.status())\n"
            "if sys.argv[1:] == ['plant']:\n"
            "    import hashlib, json\n"
            "    library = native._target()[2]\n"
            "    library.parent.mkdir(parents=True)\n"
            "    library.write_bytes(b'not a library')\n"
            "    record = {'size': 13, 'sha256': hashlib.sha256(b'not a library').hexdigest()}\n"
            "    native._record(library).write_text(json.dumps(record))\n"
            "    print(native.status())\n"
            "    print(any(p.endswith('libpagedpack_cpu.so') for p in native.torch.ops.loaded_libraries))\n"
            "print(round(time.monotonic() - start, 1))\n")
    env = dict(os.environ, CXX=str(fake), PAGEDPACK_CACHE=str(cache))
    env.pop("PAGEDPACK_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    line, seconds = done.stdout.splitlines()
    assert line.startswith("native CPU kernels, not built yet: built on first use into ") and str(cache) in line
    assert not mark.exists() and not cache.exists() and "building" not in done.stderr
    assert float(seconds) < 60  # the import and a sha256 of the sources; a build is minutes on a busy machine

    done = subprocess.run([sys.executable, "-c", code, "plant"], env=env, capture_output=True, text=True, check=True)
    before, after, loaded, _ = done.stdout.splitlines()
    assert before.startswith("native CPU kernels, not built yet")
    assert after.startswith("native CPU kernels (built in ") and after.endswith("; loaded on first use)")
    assert loaded == "False" and not mark.exists()


def test_without_a_compiler_the_reference_kernels_run():
    """No C++ compiler (and a cache with no build): the ops say so and still compute."""
    code = ("import torch, pagedpack.kernels.ops\n"
            "from pagedpack.kernels import native\n"
            "print(native.status())\n"
            "q = torch.randn(3, 2, 8); kc = torch.randn(4, 2, 1, 8)\n"
            "out = torch.ops.pagedpack.paged_attention(q, kc, kc, torch.tensor([[0, 1]], dtype=torch.int32),\n"
            "    torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.3)\n"
            "print(tuple(out.shape))\n")
    env = dict(os.environ, CXX="no-such-compiler", PAGEDPACK_CACHE=os.devnull + "-missing")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["reference kernels (no C++ compiler 'no-such-compiler' on PATH)", "(3, 2, 8)"]
