"""What speculative decoding buys in decode tokens/s: pagedpack and, when given, vLLM CPU, on the same
model and token ids.

SmolLM2-135M (the ``smollm2-135m`` alias: the Instruct checkpoint), bfloat16, on two workloads of 8 prompts
each: ``grounded``, chat prompts whose answer copies a 200-400 token passage of the prompt (repeat a paragraph
of ``english_text()``, fix a named typo in one, rename a variable in or repeat a stdlib function's source),
and ``open``, W1's lengths (``PROMPT_LENS``) cut from ``english_text()`` and continued freely. Each workload
runs 1-stream (one request per ``generate`` call, one after the other) and 8-stream (the 8 requests in one
call), greedy and sampled (temperature 1, request ``i`` seeded ``SEED + i``), ``--max-tokens`` (128) with
``ignore_eos``, prefix caching off (the runs repeat prompts). Per cell: ``tok_s``, the output tokens over the
wall time of the calls (best of ``--runs`` after one warm-up; pagedpack's configurations are built together
and their runs alternate), ``ratio_vs_off``, and ``copied_4grams``, the share of output tokens that end a
4-gram seen before in the prompt or output (what prompt lookup can draft: greedy SmolLM2-135M also loops on
open-ended text, so that share is not 0 there).

Configurations (:data:`CONFIGS`, vLLM's ``speculative_config`` spelling): ``off``; ``ngram`` (prompt
lookup, 4 draft tokens from 2- to 4-gram matches); ``suffix``, skipped with a note where the engine
refuses it (``TypeError``/``ValueError`` when built). A speculative configuration's cells also carry
the engine's ``spec_decode_*`` counters over the cell (``dataclasses.asdict(llm.get_stats())``;
vLLM: ``llm.get_metrics()``) with ``acceptance_rate`` and ``mean_acceptance_length`` when the
counters allow. ``--vllm-python`` runs ``spec_decode_vllm.py`` (this folder) with that interpreter on
the same token ids (tokenized here, passed on stdin).

Prints one JSON object. Start only when the 1-minute load is below 0.8 (``load_1min``). Run:
``python benchmarks/spec_decode.py [--vllm-python /work/main/PEERS/vllm/bin/python]``; a quick check:
``--max-tokens 16 --runs 1`` (``--workloads``, ``--configs``, ``--streams`` select cells; ``--show``
prints the greedy outputs of the first configuration to stderr).
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import PROMPT_LENS, cpu_model, english_text, load_1min, model_folder

CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 24},  # vLLM's default depth for suffix decoding
}
WORKLOADS = ("grounded", "open")
SEED = 1000


def passages(tokenizer, count: int, low: int = 200, high: int = 400) -> list[str]:
    """``count`` passages of ``english_text()``'s prose (paragraphs of plain lines, no tables, examples
    or option lists; lines joined): consecutive paragraphs from evenly spaced starts, joined until
    ``low`` tokens (a paragraph that would pass ``high`` is skipped)."""
    prose = [" ".join(p.split()) for p in english_text().split("\n\n")
             if len(p) > 150 and all(line[:1].isalpha() for line in p.splitlines())
             and not any(c in p for c in (">>>", "--", "|", "{"))]
    found = []
    for k in range(count):
        parts, n = [], 0
        for p in prose[(2 * k + 1) * len(prose) // (2 * count):]:
            size = len(tokenizer(p + "\n\n", add_special_tokens=False).input_ids)
            if n + size <= high:
                parts, n = parts + [p], n + size
            if n >= low:
                break
        found.append("\n\n".join(parts))
    return found


def with_typo(text: str) -> tuple[str, str, str]:
    """``text`` with two letters of one word (the first of 7+ letters after the middle) swapped, that
    word misspelt and the word."""
    words = text.split(" ")
    i = next(i for i in range(len(words) // 2, len(words)) if words[i].isalpha() and len(words[i]) >= 7)
    word = words[i]
    words[i] = word[:3] + word[4] + word[3] + word[5:]
    return " ".join(words), words[i], word


def grounded_messages(tokenizer) -> list[str]:
    """The 8 user messages of the ``grounded`` workload: each answer copies a passage of the message."""
    import difflib
    import statistics
    import tempfile
    import textwrap

    a, c, b, d = passages(tokenizer, 6)[2:]  # the first two: SmolLM2-135M writes code or loops instead of copying
    (c, c_typo, c_word), (d, d_typo, _) = with_typo(c), with_typo(d)
    mkdtemp, typo = inspect.getsource(tempfile.mkdtemp), "file = _os.path.join(dir, prefix + name + suffix)"
    return [
        f"Repeat the following text exactly.\n\n{a}",
        f"Repeat the following paragraphs exactly.\n\n{b}",
        f"Rewrite the following text, fixing the typo (\"{c_typo}\" should be \"{c_word}\").\n\n{c}",
        f"Fix the spelling mistake \"{d_typo}\" in this text and write out the corrected text in full.\n\n{d}",
        "Edit this Python function to rename the variable `margin` to `common_prefix`. Reply with the whole "
        f"function.\n\n```python\n{inspect.getsource(textwrap.dedent)}```",
        "Edit this Python function to rename the variable `total` to `running_sum`. Reply with the whole "
        f"function.\n\n```python\n{inspect.getsource(statistics.fmean)}```",
        "Rewrite the following code, fixing the typo (`flie` should be `file`).\n\n```python\n"
        f"{mkdtemp.replace(typo, typo.replace('file', 'flie', 1))}```",
        f"Repeat this code exactly.\n\n```python\n{inspect.getsource(difflib.SequenceMatcher.ratio)}```",
    ]


def workload_prompts(tokenizer) -> dict[str, list[list[int]]]:
    """The token ids of both workloads' prompts (``grounded``: rendered by the chat template)."""
    grounded = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                              add_generation_prompt=True) for m in grounded_messages(tokenizer)]
    ids = tokenizer(english_text(), add_special_tokens=False).input_ids
    windows = [ids[s:s + n] for s, n in zip(range(0, len(ids), len(ids) // len(PROMPT_LENS)), PROMPT_LENS)]
    return {"grounded": [tokenizer(t, add_special_tokens=False).input_ids for t in grounded], "open": windows}


def spec_delta(before: dict, after: dict) -> dict:
    """The counters' growth from ``before`` to ``after`` (sequences element-wise; floats as they are now),
    with ``acceptance_rate`` (accepted / draft tokens) and ``mean_acceptance_length`` (1 + accepted / drafts)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, (list, tuple)):  # per draft position (pagedpack: a tuple, empty before any draft)
            old = list(before.get(key) or ())
            out[key] = [x - y for x, y in zip(value, old + [0] * (len(value) - len(old)))]
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    ints = {k: v for k, v in out.items() if isinstance(v, int)}
    drafted, accepted, drafts = (next((v for k, v in ints.items() if k.endswith(end)), None)
                                 for end in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
    if drafted and accepted is not None:
        out["acceptance_rate"] = round(accepted / drafted, 3)
    if drafts and accepted is not None:
        out["mean_acceptance_length"] = round(1 + accepted / drafts, 3)
    return out


def copied(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of ``output``'s tokens that end an ``n``-gram of ``prompt`` + ``output`` before it (what
    prompt lookup can draft)."""
    seen, ids = set(), list(prompt)
    for i in range(n, len(ids) + 1):
        seen.add(tuple(ids[i - n:i]))
    hits = 0
    for token in output:
        ids.append(token)
        gram = tuple(ids[-n:])
        hits += gram in seen
        seen.add(gram)
    return hits / max(len(output), 1)


def timed_calls(llm, ids: list, params: list, streams: int) -> tuple[float, list]:
    """The wall time of generating ``ids``, ``streams`` requests per ``generate`` call, and the outputs."""
    start, outs = time.perf_counter(), []
    for i in range(0, len(ids), streams):
        outs += llm.generate(ids[i:i + streams], params[i:i + streams], use_tqdm=False)
    return time.perf_counter() - start, outs


def best_of(engines: dict, ids: list, params: list, streams: int, runs: int) -> dict:
    """Per engine name: the fastest of ``runs`` timed calls (:func:`timed_calls`) as ``(seconds, outputs)``, or
    the error it raised (``ValueError``, ``NotImplementedError``: it refuses the requests). The runs alternate
    between the engines (in order, then reversed), so that a drift in the host's speed falls on all alike."""
    best, names = {}, list(engines)
    for run in range(runs):
        for name in names if run % 2 == 0 else names[::-1]:
            if isinstance(best.get(name), Exception):
                continue
            try:
                timed = timed_calls(engines[name][0], ids, params, streams)
            except (ValueError, NotImplementedError) as err:
                best[name] = err
                continue
            if name not in best or timed[0] < best[name][0]:
                best[name] = timed
    return best


def run_configs(engines: dict, sampling_params, prompts: dict, args, show=False) -> dict:
    """Per engine of ``engines`` (name -> ``(llm, counters)``: vLLM's or pagedpack's ``LLM``, and None or a
    function of it giving its speculation counters), the cells per workload, stream count and sampling:
    ``decode_tok_s``, the tokens after each request's first over the time the calls take beyond the same calls
    with ``max_tokens=1`` (the prompts' prefill and first token, timed once per workload and stream count), and
    ``tok_s`` over the whole calls, with the counters' growth over the cell. Each cell's runs alternate between
    the engines (:func:`best_of`). Each engine is warmed up once, on the first cell's calls. A cell whose
    requests an engine refuses: ``skipped``, why."""
    rows, warm = {name: {} for name in engines}, set()
    for workload, streams in itertools.product(args.workloads, args.streams):
        ids = [{"prompt_token_ids": p} for p in prompts[workload]]
        first = [sampling_params(temperature=0.0, max_tokens=1, ignore_eos=True) for _ in ids]
        for name in set(engines) - warm:
            timed_calls(engines[name][0], ids, first, streams)
            warm.add(name)
        prefill = best_of(engines, ids, first, streams, args.runs)
        for mode in ("greedy", "sampled"):
            params = [sampling_params(temperature=0.0 if mode == "greedy" else 1.0,
                                      seed=SEED + i if mode == "sampled" else None,
                                      max_tokens=args.max_tokens, ignore_eos=True) for i in range(len(ids))]
            cell = f"{workload}/{streams}-stream/{mode}"
            before = {name: counters(llm) if counters else {} for name, (llm, counters) in engines.items()}
            for name, found in best_of(engines, ids, params, streams, args.runs).items():
                if isinstance(found, Exception):
                    rows[name][cell] = {"skipped": f"{type(found).__name__}: {found}"}
                    continue
                (best, outs), (llm, counters) = found, engines[name]
                out_ids = [o.outputs[0].token_ids if o.outputs else [] for o in outs]
                tokens = sum(map(len, out_ids))
                errors = sorted({str(e) for o in outs if (e := getattr(o, "error", None))})
                row = rows[name][cell] = {
                    "decode_tok_s": round((tokens - len(ids)) / (best - prefill[name][0]), 1),
                    "tok_s": round(tokens / best, 1), "best_s": round(best, 3),
                    "prefill_s": round(prefill[name][0], 3), "tokens": tokens,
                    "copied_4grams": round(sum(map(copied, prompts[workload], out_ids)) / len(outs), 3),
                    **({"errors": errors} if errors else {})}
                if counters:
                    row |= spec_delta(before[name], counters(llm))
                if show and name == next(iter(engines)) and mode == "greedy" and streams == args.streams[0]:
                    for o in outs:
                        print(f"--- {workload}: {o.outputs[0].text if o.outputs else None!r}", file=sys.stderr)
    return rows


def with_ratios(configs: dict) -> dict:
    """Each cell's ``ratio_vs_off``: its ``decode_tok_s`` over the ``off`` configuration's."""
    off = configs.get("off", {}).get("rows", {})
    for config in configs.values():
        for cell, row in config.get("rows", {}).items():
            if "decode_tok_s" in row and off.get(cell, {}).get("decode_tok_s"):
                row["ratio_vs_off"] = round(row["decode_tok_s"] / off[cell]["decode_tok_s"], 3)
    return configs


def spec_counters(llm) -> dict:
    """pagedpack's speculation counters (``Stats`` fields starting ``spec_decode_``; none before it has them)."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(llm.get_stats()).items() if k.startswith("spec_decode_")}


def pagedpack_side(args, model_dir: str, prompts: dict) -> dict:
    """Every configuration's engine built first, then their cells measured side by side (:func:`run_configs`)."""
    from pagedpack import LLM, SamplingParams

    configs, engines = {}, {}
    for name in args.configs:
        spec = CONFIGS[name]
        configs[name] = {"config": spec}
        try:
            llm = LLM(model_dir, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=max(args.streams),
                      max_model_len=2048, num_threads=args.num_threads,
                      **({"speculative_config": spec} if spec else {}))
        except (TypeError, ValueError) as err:  # no speculative_config, or not this method
            if spec is None:
                raise
            configs[name]["skipped"] = f"{type(err).__name__}: {err}"
            continue
        engines[name] = (llm, spec_counters if spec else None)
    for name, rows in run_configs(engines, SamplingParams, prompts, args, args.show).items():
        configs[name]["rows"] = rows
    return with_ratios(configs)


def vllm_side(args, model_dir: str, prompts: dict) -> dict:
    venv = Path(args.vllm_python).absolute().parent.parent
    iomp = next(venv.glob("lib/libiomp5.so"), None)
    env = dict(os.environ, **({"LD_PRELOAD": str(iomp)} if iomp else {}))
    script = Path(__file__).with_name("spec_decode_vllm.py")
    done = subprocess.run([args.vllm_python, str(script), model_dir], input=json.dumps(
        {"args": vars(args), "prompts": prompts}), env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stdout + done.stderr).strip()[-2000:]}
    answer = json.loads(lines[-1])  # the configurations measured, all of them unless it failed on the way
    return {"configs": with_ratios(answer["configs"]), "version": answer["version"],
            **({"error": done.stderr.strip()[-500:]} if done.returncode else {})}


def versions() -> dict:
    import importlib.metadata

    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                            capture_output=True, text=True).stdout.strip()
    return {"pagedpack": importlib.metadata.version("pagedpack"), "commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--vllm-python", default=None, help="a vLLM CPU venv's python (its speculation, side by side)")
    parser.add_argument("--show", action="store_true", help="print the first configuration's greedy outputs to stderr")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = model_folder(args.model)
    prompts = workload_prompts(AutoTokenizer.from_pretrained(model_dir))
    result = {"host": cpu_model(), "load_1min": load_1min(), "date": time.strftime("%Y-%m-%d"),
              "model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "runs": args.runs,
              "prompt_lens": {w: [len(p) for p in prompts[w]] for w in args.workloads}, "versions": versions(),
              "pagedpack": pagedpack_side(args, model_dir, prompts)}
    if args.vllm_python:
        result["vllm_cpu"] = vllm_side(args, model_dir, prompts)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
