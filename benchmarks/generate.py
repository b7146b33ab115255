"""Generation throughput, side by side in one run: pagedpack ``LLM.generate``, the unmodified
model's padded batch ``generate`` and, when given, vLLM CPU, on the same prompts.

Workloads:
  * ``--workload w1`` (default): W1 exactly as ``../shared/bench/workload.py`` defines it (a Llama
    shape with seed-0 random weights, 32 prompts of lengths 32, 50, 128, 256, 512, 64, 16, 256 x4,
    32 greedy tokens each, EOS ignored). With ``--model smollm2-135m`` (or any model), the same
    prompt lengths cut from English text (Python's own documentation) through the model's tokenizer.
  * ``--workload w1-hybrid``: W1's prompts on W1's model as a hybrid (Qwen3-Next's architecture, dense,
    at W1's sizes, three gated DeltaNet layers to one attention layer: ``common.w1_hybrid_model``).
  * ``--workload random``: ``--model`` on random token ids of those lengths, ``--repeat`` times.

Timing follows ``../shared/bench/SETUP.md``: load and capture excluded, one warm-up run over all
prompts, best of ``--runs``. Each engine's first 4 outputs are compared with the unmodified
model's greedy tokens, prompt by prompt (``first4_match``); pagedpack's ``peak_rss_mb`` is this
process's peak RSS during its runs (imports, the step program's weights, KV pool and activations;
``LLM(path)`` captures in a child process and serves the ``.pt2`` it keeps in the compile cache,
``pagedpack.compiler.compile_cache``, and the references are computed after the runs; the peak of loading,
before the runs, and the largest peak of this process's children so far, the capturing child's when
there was one (or the C++ compiler's on the native kernels' first build), are reported apart),
vLLM's the peak sum over its
processes during its runs (``vllm_cpu.py`` samples it; its main-process figure inherits this
process's peak through ``fork``). ``--vllm-python`` runs
``vllm_cpu.py`` from ``--bench-dir`` with that interpreter (Intel OpenMP preloaded from its venv,
no reserved core, prefix caching off), recipe in ``../shared/bench/SETUP.md``. ``--pt2`` also
serves the ``.pt2`` export of the same step program from a fresh process, as a deployment that
captures once and serves elsewhere does (``pagedpack_pt2_process``: its time, and that process's
peak RSS during the runs: it imports neither ``transformers``' modeling code nor the capture and
rewrite passes). ``--dtype bfloat16`` runs every engine in bf16 (vLLM CPU's own default on a CPU with
AVX512-BF16; the references are the unmodified model in bf16). Start only when the 1-minute load is
below 0.8 (reported as ``load_1min``). Prints one JSON object. Run:
``python benchmarks/generate.py [--workload w1] [--model M] [--dtype D] [--vllm-python PATH] [--onnx] [--pt2]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedpack import LLM, SamplingParams
from pagedpack.kernels.native import status as kernel_status

from common import load_1min, peak_rss_mb, reset_peak_rss, w1_workload

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("w1", "w1-hybrid", "random"), default="w1")
    parser.add_argument("--model", default=None,
                        help="an alias (tiny, smollm2-135m, gemma3-270m) or a Hugging Face directory; "
                             "default: W1's model for --workload w1, tiny otherwise")
    parser.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench",
                        help="folder of workload.py and vllm_cpu.py (default: ../shared/bench)")
    parser.add_argument("--w1-dir", type=Path, default=None,
                        help="where W1's model is written on first use (default: $PAGEDPACK_CACHE/w1, "
                             "else ~/.cache/pagedpack/w1)")
    parser.add_argument("--vllm-python", help="python of a vLLM CPU venv: also run vLLM on the same prompts")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per engine (best is reported)")
    parser.add_argument("--repeat", type=int, default=4, help="--workload random: times the length list repeats")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (outputs checked against the unmodified model); > 0: sampled, unseeded, "
                             "vLLM too (the transformers baseline is left out)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="every engine's dtype (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="KV pool of every engine, GiB (default %(default)s: vllm_cpu.py's VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the padded transformers baseline")
    parser.add_argument("--onnx", action="store_true", help="also serve the ONNX export on onnxruntime")
    parser.add_argument("--pt2", action="store_true", help="also serve the .pt2 export from a fresh process")
    parser.add_argument("--serve-file", nargs=3, metavar=("PT2", "PROMPTS_JSON", "NUM_BLOCKS"),
                        help=argparse.SUPPRESS)  # the process --pt2 starts
    args = parser.parse_args()
    if args.serve_file:
        return print(json.dumps(_serve_file(args, *args.serve_file)))
    load = load_1min()

    model_dir, prompts = w1_workload(args)
    # prefix caching off, as vllm_cpu.py runs vLLM: the timed runs repeat the warm-up's prompts
    # and the KV pool vLLM gets: a smaller one would keep requests waiting for blocks (SmolLM2's W1 needs ~280 MiB)
    llm = LLM(model_dir, block_size=args.block_size, enable_prefix_caching=False, dtype=args.dtype,
              kv_cache_memory=f"{args.kv_cache_gib}GiB")

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    child_peak_mb = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024) or None
    load_peak_mb = peak_rss_mb()  # before the reset, which also resets getrusage's ru_maxrss
    reset_peak_rss()
    paged_s, paged_outputs = _timed(lambda: _generate(llm, prompts, params), args.runs)
    peak_mb = peak_rss_mb()
    # the unmodified model only now (LLM let it go after lowering): its weights are not in the peak
    reference = [_hf_greedy(llm.model, p, args.max_tokens) for p in prompts[:4]] if not args.temperature else None
    eos = llm.description.eos_token_ids
    engines = {"pagedpack": _row(paged_s, paged_outputs, prompts, reference, args.max_tokens, eos)}
    engines["pagedpack"]["peak_rss_mb"] = peak_mb
    engines["pagedpack"]["peak_rss_mb_of_load"] = load_peak_mb
    engines["pagedpack"]["peak_rss_mb_of_child_processes"] = child_peak_mb
    engines["pagedpack"]["steps_per_run"] = llm.llm_engine.stats.num_steps // (args.runs + 1)
    if args.onnx:
        engines["pagedpack_onnxruntime"] = _onnxruntime(llm, prompts, params, reference, args, eos)
    if args.pt2:
        engines["pagedpack_pt2_process"] = _pt2_process(llm, prompts, reference, args, eos)
    if not args.no_transformers and not args.temperature:
        hf_s, hf_outputs = _timed(lambda: _padded_generate(llm.model, prompts, args.max_tokens), args.runs)
        engines["transformers_padded"] = _row(hf_s, hf_outputs, prompts, reference, args.max_tokens)
    if args.vllm_python:
        engines["vllm_cpu"] = _vllm(args, model_dir, prompts, reference)

    result = {
        "workload": args.workload, "model": str(args.model or model_dir), "dtype": args.dtype,
        "temperature": args.temperature, "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)), "new_tokens_per_request": args.max_tokens,
        "engines": engines,
        "ratios_to_pagedpack_time": {name: round(row["seconds"] / paged_s, 2)
                                     for name, row in engines.items() if name != "pagedpack" and "seconds" in row},
        "load_1min": load, "kernels": kernel_status(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(),
    }
    print(json.dumps(result, indent=2))


def _generate(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _timed(run, runs: int) -> tuple[float, list[list[int]]]:
    """Best of ``runs`` timed calls of ``run`` after one warm-up call, and the last outputs."""
    run()
    best, outputs = float("inf"), None
    for _ in range(runs):
        start = time.perf_counter()
        outputs = run()
        best = min(best, time.perf_counter() - start)
    return best, outputs


def _row(seconds: float, outputs, prompts, reference, max_tokens: int, eos_ids=()) -> dict:
    """Time, throughput and ``first4_match``. The reference masks EOS until ``max_tokens``
    (``min_new_tokens``, as vllm_cpu.py's ``min_tokens``); pagedpack's ``ignore_eos`` only keeps
    going, so its outputs (``eos_ids`` given) are compared up to their first EOS."""
    assert all(len(o) == max_tokens for o in outputs), [len(o) for o in outputs]
    row = {"seconds": round(seconds, 3), "generated_tokens_per_s": round(len(prompts) * max_tokens / seconds, 1)}
    if reference is None:  # sampled: nothing to compare with
        return row
    same = 0
    for got, ref in zip(outputs, reference):
        stop = next((i for i, t in enumerate(got) if t in eos_ids), len(got))
        same += list(got[:stop]) == ref[:stop]
    return {**row, "first4_match": f"{same}/4"}


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The unmodified model's greedy tokens for ``prompt`` alone (EOS ignored)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _padded_generate(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """One left-padded batch through ``model.generate`` (what users start from)."""
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def _vllm(args, model_dir: str, prompts, reference) -> dict:
    """``vllm_cpu.py`` on the same model and prompts, in a child process of ``--vllm-python``."""
    venv = Path(args.vllm_python).absolute().parent.parent  # the venv, not the interpreter it links to
    iomp = next(venv.glob("lib/libiomp5.so"), None)
    env = dict(os.environ, **({"LD_PRELOAD": str(iomp)} if iomp else {}))
    with tempfile.TemporaryDirectory() as tmp:
        prompts_json, ref_json = Path(tmp, "prompts.json"), Path(tmp, "ref.json")
        prompts_json.write_text(json.dumps({"prompts": prompts, "max_new_tokens": args.max_tokens}))
        ref_json.write_text(json.dumps({"first4": reference or []}))
        done = subprocess.run([args.vllm_python, str(args.bench_dir / "vllm_cpu.py"), model_dir, str(prompts_json),
                               "--ref", str(ref_json), "--reserved-cpus", "0", "--runs", str(args.runs),
                               "--dtype", args.dtype, "--kv-gb", str(args.kv_cache_gib),
                               "--temperature", str(args.temperature)],
                              env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"engine"')]
    if done.returncode or not lines:
        return {"error": (done.stdout + done.stderr).strip()[-2000:]}
    row = json.loads(lines[-1])
    return {"seconds": row["seconds"], "generated_tokens_per_s": row["tokens_per_s"],
            **({"first4_match": f"{row['first4_match']}/4"} if reference else {}),
            # its engine core runs in a second process: the sum over its processes during the runs
            "peak_rss_mb": row["peak_rss_mb_sum_all_procs_during_runs"],
            "version": row["version"], "ld_preload": bool(iomp)}


def _onnxruntime(llm, prompts, params, reference, args, eos_ids) -> dict:
    """The same requests, the step exported to ONNX and run by onnxruntime's CPU provider."""
    with tempfile.TemporaryDirectory() as tmp:
        path = llm.export(os.path.join(tmp, "step.onnx"), format="onnx")
        served = LLM.from_exported(path, block_size=args.block_size, num_blocks=llm.num_blocks)
        seconds, outputs = _timed(lambda: _generate(served, prompts, params), args.runs)
    return _row(seconds, outputs, prompts, reference, args.max_tokens, eos_ids)


def _pt2_process(llm, prompts, reference, args, eos_ids) -> dict:
    """The same requests, the step exported to ``.pt2`` and served by a fresh process (this script's
    ``--serve-file``) with the same KV pool; its time and its peak RSS during the runs."""
    with tempfile.TemporaryDirectory() as tmp:
        path, prompts_json = llm.export(os.path.join(tmp, "step.pt2")), Path(tmp, "prompts.json")
        prompts_json.write_text(json.dumps(prompts))
        done = subprocess.run([sys.executable, __file__, "--serve-file", path, str(prompts_json), str(llm.num_blocks),
                               "--runs", str(args.runs), "--max-tokens", str(args.max_tokens),
                               "--block-size", str(args.block_size)], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip()[-2000:]}
    served = json.loads(done.stdout.strip().splitlines()[-1])
    row = _row(served["seconds"], served["outputs"], prompts, reference, args.max_tokens, eos_ids)
    return {**row, "peak_rss_mb": served["peak_rss_mb"], "peak_rss_mb_of_load": served["peak_rss_mb_of_load"],
            "imports_transformers_modeling": served["imports_transformers_modeling"], "note": served["note"]}


def _serve_file(args, path: str, prompts_json: str, num_blocks: str) -> dict:
    """``--serve-file``: serve ``path`` as ``main`` serves the captured model (timing and peak RSS alike)."""
    served = LLM.from_exported(path, block_size=args.block_size, num_blocks=int(num_blocks),
                               enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = json.loads(Path(prompts_json).read_text())
    load_peak_mb = peak_rss_mb()
    reset_peak_rss()
    seconds, outputs = _timed(lambda: _generate(served, prompts, params), args.runs)
    return {"seconds": seconds, "outputs": outputs, "peak_rss_mb": peak_rss_mb(),
            "peak_rss_mb_of_load": load_peak_mb, "note": served.program.note,
            "imports_transformers_modeling": "transformers.modeling_utils" in sys.modules}


if __name__ == "__main__":
    main()
