"""Prefix caching on vs off, side by side in one run, on the same requests.

Workload: ``--model`` (default smollm2-135m), ``--requests`` (64) prompts = one shared
``--system-len`` (512) token system prompt + a unique ``--question-len`` (32) token question
each, ``--max-tokens`` (32) greedy tokens, all submitted together. Text is English prose through
the model's tokenizer (random ids for a model without one). For each setting: one warm-up run,
then the best of ``--runs``, every run starting from an empty prefix cache
(``LLM.reset_prefix_cache``), so only what requests of the same run share is reused. Reported
per setting: wall time, prompt tokens computed, prefix-cache hits and queries (tokens looked up
at admission, re-admissions after preemption included), the page reuse ratio (hits / queries:
the share of looked-up prompt pages found cached), peak KV blocks in use and evictions; and
whether both settings produced the same tokens. Start only when the 1-minute load is below 0.8
(``load_1min``). Prints one JSON object. Run: ``python benchmarks/prefix.py [--model
smollm2-135m]``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pagedpack import LLM, SamplingParams

from common import english_text, load_1min


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias, Hugging Face directory, or tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per setting (best is reported)")
    args = parser.parse_args()
    load = load_1min()

    engines = {enable: LLM(args.model, block_size=args.block_size, enable_prefix_caching=enable)
               for enable in (True, False)}
    prompts = _prompts(engines[True], args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, outputs = {}, {}
    for enable, llm in engines.items():
        rows[enable], outputs[enable] = _measure(llm, prompts, params, args.runs)
    on, off = rows[True], rows[False]
    result = {
        "model": args.model, "requests": args.requests, "system_len": args.system_len,
        "question_len": args.question_len, "max_tokens": args.max_tokens, "block_size": args.block_size,
        "prefix_caching_on": on, "prefix_caching_off": off,
        "time_on_over_off": round(on["seconds"] / off["seconds"], 3),
        "prompt_tokens_computed_on_over_off": round(on["prompt_tokens_computed"] / off["prompt_tokens_computed"], 3),
        "same_tokens": outputs[True] == outputs[False],
        "load_1min": load, "threads": torch.get_num_threads(), "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))


def _prompts(llm: LLM, args) -> list[list[int]]:
    need = args.system_len + args.requests * args.question_len
    if llm.tokenizer is not None:
        ids = llm.tokenizer(english_text())["input_ids"]
        if len(ids) < need:
            raise SystemExit(f"--requests/--question-len: the text has {len(ids)} tokens, {need} needed")
    else:
        ids = torch.randint(0, llm.vocab_size, (need,), generator=torch.Generator().manual_seed(0)).tolist()
    system, questions = ids[:args.system_len], ids[args.system_len:need]
    return [system + questions[i * args.question_len:(i + 1) * args.question_len] for i in range(args.requests)]


def _measure(llm: LLM, prompts, params, runs: int) -> tuple[dict, list[list[int]]]:
    """Best of ``runs`` after a warm-up, each from an empty prefix cache; the best run's counters."""
    best, outputs = None, None
    for run in range(runs + 1):
        assert llm.reset_prefix_cache()
        llm.llm_engine.scheduler.kv_cache_manager.pool.reset_peak()
        before = llm.get_stats()
        start = time.perf_counter()
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        seconds = time.perf_counter() - start
        after = llm.get_stats()
        row = {
            "seconds": round(seconds, 3),
            "prompt_tokens": sum(map(len, prompts)),
            "prompt_tokens_computed": after.num_prompt_tokens_computed - before.num_prompt_tokens_computed,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
            "peak_kv_blocks": after.kv_blocks_peak_used,
            "evictions": after.num_evictions - before.num_evictions,
        }
        queries = row["prefix_cache_queries"]  # re-admissions after preemption look up again
        row["page_reuse_ratio"] = round(row["prefix_cache_hits"] / queries, 3) if queries else 0.0
        if run and (best is None or seconds < best["seconds"]):
            best = row
    return best, outputs


if __name__ == "__main__":
    main()
