"""Generation throughput: pagedpack ``LLM.generate`` vs the unmodified model's padded batch ``generate``.

Same model, same prompts, same number of greedy tokens per request, side by side in one run.
With ``--onnx`` the pagedpack step also runs exported to ONNX on onnxruntime (CPU).
``--model smollm2-135m`` (or ``gemma3-270m``) runs a real small model, fetched and converted on
first use (``pagedpack.models.aliases``); ``greedy_agreement`` then says how many requests got the
same greedy tokens from both. Prints one JSON object. Run:
``python benchmarks/generate.py [--model M] [--repeat N] [--onnx]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from pagedpack import LLM, SamplingParams
from pagedpack.models.loading import DEFAULT_MODEL

PROMPT_LENS = (32, 50, 128, 256, 512, 64, 16, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="an alias (tiny, smollm2-135m, gemma3-270m), a Hugging Face directory or hub id; "
                             "default: the built-in tiny model")
    parser.add_argument("--repeat", type=int, default=4, help="times the prompt-length list is repeated")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--onnx", action="store_true", help="also serve the ONNX export on onnxruntime")
    args = parser.parse_args()

    llm = LLM(args.model, block_size=args.block_size)
    model, vocab = llm.model, llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = list(PROMPT_LENS) * args.repeat
    prompts = [torch.randint(0, min(vocab, 256), (n,), generator=g).tolist() for n in lens]
    n_new = args.max_tokens

    # pagedpack: packed steps, paged KV cache, continuous batching.
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    paged_s, paged_outputs = _timed_generate(llm, prompts, params)
    paged_tokens = sum(len(o.outputs[0].token_ids) for o in paged_outputs)
    kv = llm.llm_engine.scheduler.kv_cache_manager

    # transformers: one left-padded batch through model.generate (warm-up run first).
    width = max(lens)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    hf_kwargs = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2], **hf_kwargs)
        start = time.perf_counter()
        hf_out = model.generate(input_ids, attention_mask=attention_mask, **hf_kwargs)
        hf_s = time.perf_counter() - start
    hf_tokens = (hf_out.shape[1] - width) * len(prompts)

    per_token = llm.bytes_per_token
    result = {
        "model": args.model,
        "requests": len(prompts),
        "prompt_tokens": sum(lens),
        "new_tokens_per_request": n_new,
        "pagedpack": {
            "seconds": round(paged_s, 3),
            "generated_tokens_per_s": round(paged_tokens / paged_s, 1),
            "steps": llm.llm_engine.stats.num_steps,
            "kv_peak_mib": round(kv.peak_used_blocks * args.block_size * per_token / 2**20, 2),
        },
        "transformers_padded": {
            "seconds": round(hf_s, 3),
            "generated_tokens_per_s": round(hf_tokens / hf_s, 1),
            "padded_prompt_tokens": width * len(prompts),
            "kv_mib": round(len(prompts) * (width + n_new) * per_token / 2**20, 2),
        },
        "speedup": round(hf_s / paged_s, 2),
        "greedy_agreement": _agreement(paged_outputs, hf_out[:, width:].tolist(), llm.description.eos_token_ids),
        **(_onnxruntime(llm, prompts, params, args.block_size) if args.onnx else {}),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    print(json.dumps(result, indent=2))


def _timed_generate(llm, prompts, params) -> tuple[float, list]:
    """Seconds and outputs of ``llm.generate`` on ``prompts``, after a warm-up run."""
    llm.generate(prompts[:2], params, use_tqdm=False)
    llm.llm_engine.scheduler.kv_cache_manager.allocator.reset_peak()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _agreement(paged_outputs, hf_tokens: list[list[int]], eos_ids: list[int]) -> str:
    """How many requests got the same greedy tokens from pagedpack and the padded batch, each
    compared before pagedpack's first EOS (``min_new_tokens`` masks EOS on the transformers
    side, ``ignore_eos`` only keeps pagedpack going)."""
    same = 0
    for out, ref in zip(paged_outputs, hf_tokens):
        got = out.outputs[0].token_ids
        stop = next((i for i, t in enumerate(got) if t in eos_ids), len(got))
        same += got[:stop] == ref[:stop]
    return f"{same}/{len(hf_tokens)}"


def _onnxruntime(llm, prompts, params, block_size) -> dict:
    """The same requests, the step exported to ONNX and run by onnxruntime's CPU provider."""
    with tempfile.TemporaryDirectory() as tmp:
        path = llm.export(os.path.join(tmp, "step.onnx"), format="onnx")
        served = LLM.from_exported(path, block_size=block_size, num_blocks=llm.num_blocks)
        seconds, outputs = _timed_generate(served, prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"pagedpack_onnxruntime": {"seconds": round(seconds, 3),
                                      "generated_tokens_per_s": round(tokens / seconds, 1)}}


if __name__ == "__main__":
    main()
