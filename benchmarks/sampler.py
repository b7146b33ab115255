"""The sampler alone, side by side: pagedpack's ``Sampler.sample`` and, with ``--vllm-python``, vLLM's
v1 ``Sampler`` (its CPU path: ``forward_cpu``, the fused Gumbel-argmax kernel; a full sort for top-p)
called in that interpreter on the same logits (the same seeded ``torch.randn`` in the same torch).

Grid: the vocabulary sizes of the served families (32,000 Llama-2 / Mistral, 49,152 SmolLM2, 128,256
Llama-3, 151,936 Qwen2.5 / Qwen3, 262,144 Gemma-3) x batch 1, 4, 16, 64 x modes ``greedy``,
``t1`` (temperature 1.0), ``t0.7_p0.9`` (temperature 0.7, top-p 0.9), ``t1_k50`` (top-k 50) and,
for pagedpack, the per-row options ``penalties`` (repetition 1.1, presence 0.5, frequency 0.5 over a
256-token prompt and 64 output tokens), ``bias`` (10 biased tokens), ``logprobs5``. Two logits
shapes: ``lm`` (probabilities falling as ``rank^-1.5``, as a trained model's do: a top-p nucleus of
tens to hundreds of tokens) and ``flat`` (``3 * randn``: a nucleus of thousands, the worst case for
top-p). Each figure: the median of ``--reps`` calls after a warm-up, in ms; the logits are made
before the timing (vLLM's sampler divides them in place: one fresh copy a call).

``python benchmarks/sampler.py [--vllm-python PEERS/vllm/bin/python] [--vocab 49152 ...] [--batch 16 ...]``
prints one JSON object: host, load, torch threads, and per configuration both times and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VOCABS = (32000, 49152, 128256, 151936, 262144)
BATCHES = (1, 4, 16, 64)
MODES = ("greedy", "t1", "t0.7_p0.9", "t1_k50")
OPTION_MODES = ("penalties", "bias", "logprobs5")  # pagedpack only: what each per-row option costs


def make_logits(shape: str, batch: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 1_000_003 + vocab)
    if shape == "flat":
        return torch.randn(batch, vocab, generator=g) * 3
    rank = torch.argsort(torch.rand(batch, vocab, generator=g), dim=-1).float()  # each token's rank in its row
    return -1.5 * torch.log1p(rank) + 0.1 * torch.randn(batch, vocab, generator=g)


def params_of(mode: str) -> dict:
    return {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0), "t0.7_p0.9": dict(temperature=0.7, top_p=0.9),
            "t1_k50": dict(temperature=1.0, top_k=50), "penalties": dict(repetition_penalty=1.1, presence_penalty=0.5,
                                                                         frequency_penalty=0.5),
            "bias": dict(logit_bias={t: 5.0 for t in range(10)}), "logprobs5": dict(logprobs=5)}[mode]


def time_ms(call, inputs: list) -> float:
    call(inputs[0])
    times = []
    for x in inputs[1:]:
        start = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def pagedpack_times(configs: list, reps: int) -> list[float]:
    from pagedpack.runtime.request import Request
    from pagedpack.runtime.sampling import Sampler, SamplingParams

    sampler, out = Sampler(), []
    for shape, vocab, batch, mode in configs:
        logits = make_logits(shape, batch, vocab)
        requests = []
        for i in range(batch):
            request = Request(str(i), list(range(256)), SamplingParams(**params_of(mode)))
            request.output_token_ids.extend(range(1000, 1064))
            requests.append(request)
        out.append(time_ms(lambda x: sampler.sample(x, requests), [logits] * (reps + 1)))
    return out


def vllm_times(configs: list, reps: int) -> list[float]:
    import vllm._custom_ops  # noqa: F401 -- the CPU kernels (fused_gumbel_argmax)
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    sampler, out = Sampler(), []
    for shape, vocab, batch, mode in configs:
        p = params_of(mode)
        greedy = p.get("temperature") == 0.0
        metadata = SamplingMetadata(
            temperature=None if greedy else torch.full((batch,), p["temperature"]), all_greedy=greedy,
            all_random=not greedy, top_p=torch.full((batch,), p["top_p"]) if "top_p" in p else None,
            top_k=torch.full((batch,), p["top_k"], dtype=torch.int32) if "top_k" in p else None, generators={},
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
            presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
            output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors())
        logits = make_logits(shape, batch, vocab)
        out.append(time_ms(lambda x: sampler(x, metadata), [logits.clone() for _ in range(reps + 1)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="a vLLM CPU venv's python (../shared/bench/SETUP.md)")
    parser.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--shape", nargs="+", choices=("lm", "flat"), default=["lm", "flat"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch threads of both (default: torch's, the cores)")
    parser.add_argument("--peer", choices=("vllm",), help=argparse.SUPPRESS)  # this script, in vLLM's venv
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peer:
        configs = json.loads(sys.stdin.read())
        print(json.dumps(vllm_times(configs, args.reps)))
        return
    from common import cpu_model, load_1min  # this folder's (not on the peer's path)

    load = load_1min()
    compared = [(s, v, b, m) for s in args.shape for v in args.vocab for b in args.batch for m in MODES]
    alone = [("lm", v, b, m) for v in args.vocab for b in args.batch for m in OPTION_MODES]
    ours = pagedpack_times(compared + alone, args.reps)
    theirs = [None] * len(compared)
    if args.vllm_python:
        venv = Path(args.vllm_python).resolve().parent.parent
        env = {**os.environ, "LD_PRELOAD": str(venv / "lib" / "libiomp5.so")}
        threads = ["--threads", str(args.threads)] if args.threads else []
        done = subprocess.run([args.vllm_python, __file__, "--peer", "vllm", "--reps", str(args.reps), *threads],
                              input=json.dumps(compared), capture_output=True, text=True, env=env, check=True)
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [{"shape": s, "vocab": v, "batch": b, "mode": m, "pagedpack_ms": round(t, 3),
             "vllm_ms": None if u is None else round(u, 3), "ratio": None if u is None else round(t / u, 2)}
            for (s, v, b, m), t, u in zip(compared, ours, theirs)]
    rows += [{"shape": s, "vocab": v, "batch": b, "mode": m, "pagedpack_ms": round(t, 3)}
             for (s, v, b, m), t in zip(alone, ours[len(compared):])]
    print(json.dumps({"host": cpu_model(), "load_1min": load,
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "reps": args.reps,
                      "rows": rows}))


if __name__ == "__main__":
    main()
