"""Accuracy of each ``--kv-cache-dtype`` on real weights, against ``auto`` (issue 31's acceptance).

For one model (``--model``, default SmolLM2-135M) in ``--dtype`` (default float32, so that ``auto``
is an fp32 cache), and each KV dtype, prints JSON:

* ``perplexity``: of a fixed ``--ppl-tokens``-token English text (Python's documentation,
  :func:`common.english_text`), the KV cache filled in ``--chunk``-token prefill chunks
  (``max_num_batched_tokens``), from the prompt log-probabilities; its change against ``auto``.
* greedy ``--max-tokens`` tokens on ``--num-prompts`` prompts cut from the same text: ``top1_agreement``,
  the generated tokens equal to ``auto``'s up to each prompt's first difference, over all of ``auto``'s
  tokens; ``max_abs_dlogprob``, the largest |logprob difference| of ``auto``'s token (among the
  top 8) up to that first difference, as vLLM's ``check_logprobs_close`` compares.

Prefix caching is off (the prompts share no prefix with the text's run, and a cached block would
hide the dtype under test). Run: ``python benchmarks/kv_cache_dtype.py [--model gemma3-270m]``.
"""
from __future__ import annotations

import argparse
import json
import math
import time

from pagedpack import LLM, SamplingParams

from common import english_text, load_1min


def perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)[0]
    logprobs = [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=8, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def compare(auto: list, other: list) -> tuple[float, float]:
    """``(top1_agreement, max_abs_dlogprob)`` of ``other``'s completions against ``auto``'s."""
    equal = total = 0
    worst = 0.0
    for a, b in zip(auto, other, strict=True):
        total += len(a.token_ids)
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta in b.logprobs[pos]:
                worst = max(worst, abs(a.logprobs[pos][ta].logprob - b.logprobs[pos][ta].logprob))
            if ta != tb:
                break
            equal += 1
    return equal / total, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtypes", default="auto,bfloat16,float16,int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    result = {"model": args.model, "dtype": args.dtype, "load_1min_at_start": load_1min(), "kv_cache_dtypes": {}}
    auto_outputs = None
    for name in args.kv_cache_dtypes.split(","):
        start = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=name, max_num_batched_tokens=args.chunk,
                  enable_prefix_caching=False, max_model_len=args.ppl_tokens + 8)
        ids = llm.tokenizer(english_text())["input_ids"]
        text_ids = ids[:args.ppl_tokens]
        rest = ids[args.ppl_tokens:]
        prompts = [rest[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.num_prompts)]
        row = {"bytes_per_token": llm.bytes_per_token, "perplexity": perplexity(llm, text_ids)}
        outputs = greedy(llm, prompts, args.max_tokens)
        if auto_outputs is None:
            auto_outputs, auto_ppl = outputs, row["perplexity"]
        row["perplexity_vs_auto"] = row["perplexity"] / auto_ppl - 1
        row["top1_agreement"], row["max_abs_dlogprob"] = compare(auto_outputs, outputs)
        row["seconds"] = round(time.perf_counter() - start, 1)
        result["kv_cache_dtypes"][name] = row
        print(name, json.dumps(row), flush=True)
        del llm
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
