"""What structured outputs cost per decode step: ``--num-seqs`` (32) greedy requests of SmolLM2 whose
batch is full for every timed step, with 0 %, 50 % and 100 % of them constrained by a JSON schema
(an array of at least 64 integers: no request finishes within the timed steps), against the same
batch on an engine that has never seen a constrained request (``none``: no bitmask, no thread).

In-process (default): ``LLMEngine.step`` is driven directly; after the prompts are computed,
``--steps`` decode steps are timed, once for ``none`` and then ``--rounds`` times (3) for 0 %, 50 %
and 100 % in turn; ``step_ms`` is the median of a configuration's steps, ``overhead_pct`` the change
from 0 % (the same batch on an engine with a grammar compiler: no bitmask, no thread, as ``none``;
measured in every round, the fairer baseline on a host whose speed moves by minutes). The target: at
most 10 % at 100 % constrained.

Against a server (``--url``, any OpenAI-compatible one: ``pagedpack serve`` or vLLM's, e.g. the vLLM
CPU server of ../shared/bench/SETUP.md §6 started on the same model): ``--num-seqs`` concurrent
``/v1/completions`` requests of ``--steps`` tokens each (``ignore_eos``, vLLM's ``structured_outputs``
body field for the constrained ones), timed whole; ``tokens_per_s`` and its change from 0 %.

Prints one JSON object. ``--quick``: 4 requests, 3 steps (checks that it runs, measures nothing).
Measure on an idle machine (1-minute load below 0.8). Run:
``python benchmarks/structured_outputs.py [--model smollm2-135m] [--url http://127.0.0.1:8011 --served-model NAME]``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from common import english_text, load_1min, model_folder

SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 64}
FRACTIONS = (0.0, 0.5, 1.0)


def _prompts(num: int) -> list[str]:
    words = english_text().split()
    return [" ".join(words[i * 40:i * 40 + 40]) for i in range(num)]


def _constrained(num: int, fraction: float) -> list[bool]:
    return [i < round(num * fraction) for i in range(num)]


def in_process(args) -> dict:
    from pagedpack import LLM, SamplingParams

    llm = LLM(model_folder(args.model), max_num_seqs=args.num_seqs)
    engine, prompts = llm.llm_engine, _prompts(args.num_seqs)

    def step_times(constrained: list[bool]) -> list[float]:
        for i, (prompt, on) in enumerate(zip(prompts, constrained)):
            params = SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.steps + 8, ignore_eos=True,
                                    structured_outputs={"json": SCHEMA} if on else None)
            engine.add_request(f"r{i}", prompt, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + list(
                engine.scheduler.waiting)):
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        while engine.has_unfinished():
            engine.step()
        return times

    step_times([False] * args.num_seqs)  # warm-up
    times = {"none": step_times([False] * args.num_seqs)}
    # the first constrained request makes the grammar compiler; then the fractions in turn, round after
    # round, so that a slow minute of the host falls on all of them
    for _ in range(args.rounds):
        for fraction in FRACTIONS:
            times.setdefault(f"{fraction:.0%}", []).extend(step_times(_constrained(args.num_seqs, fraction)))
    base = statistics.median(times["0%"])
    out = {}
    for name, values in times.items():
        ms = statistics.median(values)
        out[name] = {"step_ms": round(ms, 2), "tokens_per_s": round(args.num_seqs / ms * 1e3, 1),
                     "overhead_pct": round((ms / base - 1) * 100, 1), "steps": len(values)}
    return out


def against_server(args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=600)
    prompts = _prompts(args.num_seqs)

    async def one(prompt: str, on: bool) -> int:
        extra = {"ignore_eos": True, **({"structured_outputs": {"json": SCHEMA}} if on else {})}
        out = await client.completions.create(model=args.served_model, prompt=prompt, max_tokens=args.steps,
                                              temperature=0, extra_body=extra)
        return out.usage.completion_tokens

    async def batch(constrained: list[bool]) -> float:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, on) for p, on in zip(prompts, constrained)))
        return sum(tokens) / (time.perf_counter() - start)

    async def everything() -> dict:
        async with client:
            # warm-up, constrained too: the server's first constraint imports its grammar engine and compiles
            await batch([False] * args.num_seqs)
            await batch(_constrained(args.num_seqs, 1.0))
            return {f"{f:.0%}": await batch(_constrained(args.num_seqs, f)) for f in FRACTIONS}

    rates = asyncio.run(everything())
    base = rates["0%"]
    return {name: {"tokens_per_s": round(rate, 1), "change_pct": round((rate / base - 1) * 100, 1)}
            for name, rate in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="an alias or a Hugging Face folder")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed (tokens per request with --url)")
    parser.add_argument("--temperature", type=float, default=0.0, help="in-process: 0 greedy, 1.0 sampled (seeded)")
    parser.add_argument("--rounds", type=int, default=3, help="in-process: rounds of 0 / 50 / 100 %% in turn")
    parser.add_argument("--quick", action="store_true", help="4 requests, 3 steps: checks that it runs")
    parser.add_argument("--url", help="an OpenAI-compatible server to measure instead (pagedpack serve, vLLM)")
    parser.add_argument("--served-model", default=None, help="the model name the server serves (with --url)")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.steps, args.rounds = 4, 3, 1
    load = load_1min()
    results = against_server(args) if args.url else in_process(args)
    print(json.dumps({"benchmark": "structured_outputs", "model": args.model if not args.url else args.served_model,
                      "url": args.url, "temperature": args.temperature, "num_seqs": args.num_seqs,
                      "steps": args.steps, "load_1min": load,
                      "results": results}))


if __name__ == "__main__":
    main()
