"""Where a saturated ``pagedpack serve`` spends its time: a sampling profile of the server process
(``py-spy record``, every thread, ``pip install py-spy``) while a client keeps ``--concurrency``
requests in flight (vLLM's random workload shape: ``--input-len`` random prompt tokens,
``--output-len`` tokens each, eos ignored), greedy or sampled.

Each sample of the engine thread (the main thread: it steps the engine) is put in the first of these
categories whose code is on its stack: ``sampler`` (``runtime/sampling*.py``,
``logits_processors.py``), ``model`` (``ModelRunner``: the step program, kernels and GEMMs),
``prompt_logprobs``, ``output`` (``output_processor.py``, the detokenizer), ``scheduler`` (scheduler,
KV cache manager, block pool), ``batch`` (the step's metadata), ``deliver`` (handing deltas to the
HTTP thread), ``idle`` (waiting for work), ``other`` (the engine loop itself); the HTTP thread's
(uvicorn's event loop) into ``sse`` (``openai_serving``: making chunks, JSON), ``idle`` (the event
loop waiting), ``http`` (uvicorn, h11, starlette, the app), ``other``. Prints one JSON object: per
thread the share of its samples in each category, the samples, the client's figures, host and load.

``python benchmarks/server_profile.py [--model smollm2-135m] [--dtype bfloat16] [--sampling t1] [--seconds 15]``
(``--python``: the interpreter whose ``pagedpack`` serves, e.g. another checkout's venv, to compare)
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedpack.serve.remote import RemoteServer

from common import cpu_model, load_1min, model_folder
from serve import SAMPLING
from serve_load import random_schedule, run

ENGINE = (("sampler", ("runtime/sampling", "runtime/logits_processors")), ("model", ("runtime/model_runner",)),
          ("prompt_logprobs", ("runtime/prompt_logprobs",)), ("output", ("runtime/output_processor",
                                                                            "runtime/detokenizer")),
          ("scheduler", ("runtime/scheduler", "runtime/kv_cache_manager", "runtime/block_pool")),
          ("batch", ("runtime/batch", "pagedpack/metadata")), ("deliver", ("EngineLoop._deliver",)),
          ("idle", ("threading.py:Event.wait", "threading.py:Condition.wait")))
HTTP = (("sse", ("serve/openai_serving",)), ("idle", ("selectors.py",)),
        ("http", ("uvicorn", "h11", "starlette", "fastapi", "serve/app")))


def categorize(stack: list[str], categories) -> str:
    """The first category (in ``categories``' order) any of whose markers is in a frame of ``stack``."""
    for name, markers in categories:
        if any(marker in frame for frame in stack for marker in markers):
            return name
    return "other"


def summarize(folded: str) -> dict:
    """py-spy's raw output (``thread (id): name;function (file:line);... count`` a line, outermost first)
    as categories."""
    threads: dict[str, collections.Counter] = {"engine": collections.Counter(), "http": collections.Counter()}
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        frames = [f"{f[f.rfind('(') + 1:f.rfind(':')]}:{f[:f.rfind(' (')]}" for f in frames]  # "path:function"
        if thread.endswith(": MainThread"):
            threads["engine"][categorize(frames, ENGINE)] += int(count)
        elif thread.endswith(": pagedpack-http"):
            threads["http"][categorize(frames, HTTP)] += int(count)
    return {name: {"samples": sum(c.values()),
                   "share": {k: round(v / max(1, sum(c.values())), 3) for k, v in c.most_common()}}
            for name, c in threads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--sampling", default="t1", choices=list(SAMPLING))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num", type=int, default=96, help="requests (enough to outlast the profile)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long py-spy samples (after 5 s)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pagedpack serve")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy: not found; pip install py-spy")
    load = load_1min()
    model_dir = model_folder(args.model)
    from transformers import AutoTokenizer

    plan = random_schedule(len(AutoTokenizer.from_pretrained(model_dir)), args.num, float("inf"),
                           input_len=args.input_len, output_len=args.output_len)

    def command(port):
        return [args.python, "-m", "pagedpack.cli", "serve", model_dir, "--dtype", args.dtype, "--served-model-name",
                "bench", "--no-enable-prefix-caching", "--max-model-len", "2048", "--kv-cache-memory", "2GiB",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]

    with tempfile.TemporaryDirectory() as folder, \
            RemoteServer(command, log_path=Path(folder) / "server.log", start_s=600) as server:
        out = Path(folder) / "profile.txt"

        async def profiled():
            client = asyncio.create_task(run(server.url, "bench", plan, concurrency=args.concurrency,
                                             sampling=SAMPLING[args.sampling]))
            await asyncio.sleep(5.0)  # the warm-up done, the requests in flight
            spy = await asyncio.create_subprocess_exec(
                py_spy, "record", "--pid", str(server.process.pid), "--duration", str(int(args.seconds)),
                "--rate", "100", "--format", "raw", "--threads", "--idle", "--nonblocking", "--full-filenames",
                "--output", str(out),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, err = await spy.communicate()
            return await client, err.decode()

        figures, err = asyncio.run(profiled())
        profile = summarize(out.read_text()) if out.is_file() else {"error": err[-500:]}
    print(json.dumps({"model": args.model, "dtype": args.dtype, "sampling": args.sampling,
                      "concurrency": args.concurrency, "python": args.python, "threads": profile, "client": figures,
                      "cpu": cpu_model(), "load_1min": load}, indent=2))


if __name__ == "__main__":
    main()
