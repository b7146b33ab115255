"""``pagedpack serve``: one process, one engine loop, an OpenAI-compatible HTTP server.

The main thread builds the model and then drives the engine for good
(:meth:`~pagedpack.runtime.engine_loop.EngineLoop.serve_forever`); uvicorn serves HTTP from a
second thread with its own event loop. Stepping in the thread that built the model keeps one
OpenMP worker pool in the process (a second thread's pool made every step much slower:
:mod:`pagedpack.runtime.engine_loop`). SIGINT / SIGTERM stop uvicorn gracefully (in-flight
requests get ``graceful_s`` to finish, the engine steps for them meanwhile; those still running a
second before it ends are aborted: a stream then ends with finish reason ``"abort"``, a whole
answer is a 503), then the engine. A stream whose client stopped reading cannot take its abort
(it waits to send); uvicorn cancels it when the grace period ends and says so in one line ("Cancel
N running task(s)"), without the traceback of each cancellation. The KV pool is made resident before the first request
(``ModelRunner.commit_kv_memory``): a server holds its memory from the start, as vLLM's does.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import threading
from dataclasses import dataclass

import uvicorn

from pagedpack.async_llm import AsyncLLM
from pagedpack.compiler.planner import pool_notice
from pagedpack.llm import LLM
from pagedpack.runtime.flow_control import FlowControl
from pagedpack.serve.app import build_app
from pagedpack.serve.metrics import ServerMetrics
from pagedpack.serve.models import runtime_lora_updating
from pagedpack.serve.openai_serving import OpenAIServing, ServingConfig

log = logging.getLogger("pagedpack.serve")
# The engine thread releases the GIL inside each op and wants it back right after; when the HTTP
# thread (SSE chunks, JSON, tokenizing) holds it then, Python makes the engine wait up to the
# switch interval, 5 ms by default, for each of the step's ~1,000 ops. 0.5 ms: SmolLM2 at 1 req/s,
# TTFT p50 218 -> 185 ms (benchmarks/serve.py, README).
GIL_SWITCH_S = 0.0005


class _CancelledAtShutdown(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for a task it cancelled itself, the grace
    period over (it logs each one's ``CancelledError`` traceback after saying so in one line)."""

    def __init__(self, server: uvicorn.Server):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (self.server.should_exit and isinstance(err, asyncio.CancelledError))


@dataclass(frozen=True)
class ServerOptions:
    """Where to listen and who may call: ``host``, ``port``, ``api_key`` (None: anyone),
    ``metrics_namespace`` (``pagedpack``; ``vllm`` for vLLM's exact metric names),
    ``graceful_s`` (how long in-flight requests may finish once asked to stop), ``flow_control``
    (when a request whose client reads nothing is paused, then aborted:
    :mod:`pagedpack.runtime.flow_control`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    metrics_namespace: str = "pagedpack"
    graceful_s: float = 5.0
    log_level: str = "info"
    flow_control: FlowControl = FlowControl(stall_timeout_s=60.0)


def serving_over(llm: LLM, config: ServingConfig, *, flow_control: FlowControl,
                 metrics_namespace: str) -> OpenAIServing:
    """The OpenAI API's request handling over ``llm``, as a server runs it (one process's, or a Ray
    Serve engine replica's): ``flow_control`` on its engine loop, its KV pages committed (call it in
    the thread that built ``llm``), its metrics under ``metrics_namespace``."""
    llm._loop.flow_control = flow_control
    llm.llm_engine.runner.commit_kv_memory()
    metrics = ServerMetrics(llm._loop, model_name=config.model_name, namespace=metrics_namespace)
    return OpenAIServing(AsyncLLM.from_llm(llm), config, metrics)


def serve(llm: LLM, config: ServingConfig, options: ServerOptions) -> int:
    """Serve ``llm`` until SIGINT / SIGTERM; call it in the main thread (the one that built
    ``llm``). Returns the exit status: 0 after a clean stop, 1 if the server could not start
    (e.g. the port is taken) or the engine loop died (the HTTP front then stays up, answering
    503, until stopped)."""
    sys.setswitchinterval(GIL_SWITCH_S)
    serving = serving_over(llm, config, flow_control=options.flow_control, metrics_namespace=options.metrics_namespace)
    print(f"pagedpack: serving {config.model_name!r} ({llm.target} target, {llm.get_stats().kv_cache_dtype} KV "
          f"cache) on http://{options.host}:{options.port}/v1", flush=True)  # once its adapters are loaded
    lora = llm.llm_engine.lora
    if lora is not None:
        names = ", ".join(r.lora_name for r in llm.llm_engine.list_loras()) or "none yet"
        print(f"pagedpack: LoRA adapters: {names} ({lora.max_loras} at once, rank at most {lora.max_lora_rank})",
              file=sys.stderr, flush=True)
    # The model, its graphs and the tokenizer live as long as the process: out of the collector's
    # sight (as vLLM does after start-up), they cost no full collection while serving and none at
    # exit, which took 2-5 s to walk them.
    gc.collect()
    gc.freeze()
    notice = pool_notice(llm.engine_args, num_blocks=llm.num_blocks, bytes_per_token=llm.bytes_per_token,
                         max_model_len=llm.max_model_len)
    if notice is not None:  # serving.max_model_len: the tokens the pool holds
        print(f"pagedpack: {notice}", file=sys.stderr, flush=True)
    proposer = llm.llm_engine.proposer
    if proposer is not None:
        print(f"pagedpack: speculative decoding: {proposer.config.describe()}", file=sys.stderr, flush=True)
    connector = llm.llm_engine.scheduler.connector
    if connector is not None:
        print(f"pagedpack: KV connector {connector.describe()}", file=sys.stderr, flush=True)
    threads = llm.llm_engine.runner.cpu_threads
    if threads is not None:
        print(f"pagedpack: the CPU step runs with {threads.describe()}", file=sys.stderr, flush=True)
    app = build_app(serving, api_key=options.api_key, lora_updating=runtime_lora_updating())
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                                           timeout_graceful_shutdown=options.graceful_s, access_log=False))
    logging.getLogger("uvicorn.error").addFilter(_CancelledAtShutdown(server))
    stopped = threading.Event()
    abort_timers: list[threading.Timer] = []

    def run_http():
        try:
            server.run()
        except SystemExit:  # uvicorn exits when it cannot bind; it logged why
            pass
        finally:
            stopped.set()

    def ask_to_stop(signum, _frame):
        log.info("%s: stopping (in-flight requests get %.0f s)", signal.Signals(signum).name, options.graceful_s)
        server.should_exit = True
        # what has not finished by then is aborted a moment before uvicorn cancels it, so each
        # stream ends with finish_reason "abort" and [DONE], each whole answer with a 503
        timer = threading.Timer(max(0.0, options.graceful_s - 1.0), llm._loop.abort_all)
        timer.daemon = True
        abort_timers.append(timer)
        timer.start()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, ask_to_stop)
    http = threading.Thread(target=run_http, name="pagedpack-http", daemon=True)
    http.start()
    try:
        llm._loop.serve_forever(stopped)
    except Exception:  # noqa: BLE001 -- the HTTP front stays up: /health says 503 (for a supervisor), requests 503
        log.exception("the engine loop died; /health answers 503 until the server is stopped")
        http.join()
        return 1
    finally:
        for timer in abort_timers:  # stopped before its deadline: nothing is left to abort
            timer.cancel()
        llm.llm_engine.close()  # the KV event publisher's queued batches are sent, its sockets closed
        # frozen objects are never collected, so at exit nanobind saw the ones triton (imported by
        # torch._dynamo) made at import as leaked and printed some 30 lines; this collection takes 0.2 s
        gc.unfreeze()
    http.join()
    if not server.started:
        print(f"pagedpack: error: could not serve on {options.host}:{options.port} (see above)", file=sys.stderr)
        return 1
    return 0
