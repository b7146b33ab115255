"""``pagedpack serve`` as a Ray Serve application: N engine replicas behind one OpenAI-compatible ingress.

Two deployments. ``PagedpackEngine`` (``data_parallel_size`` replicas): each builds the model and
runs :class:`~pagedpack.serve.openai_serving.OpenAIServing` over its own engine, the single
server's code, so every answer and error body is the single server's; it reports its cached
block hashes and prefix-cache counters in its routing stats (``record_routing_stats``). ``PagedpackIngress``
(one replica, no CPU reserved): the single server's FastAPI app (:func:`pagedpack.serve.app.build_app`)
over :class:`RemoteServing`, which hands each request body to an engine replica through a
deployment handle whose request router (:mod:`pagedpack.serve.prefix_router`) picks the replica.
For prefix-aware routing the ingress tokenizes the first prompt as the replicas do (their
tokenizer, fetched from one at start-up, and chat template) and passes its block hashes
(:func:`~pagedpack.runtime.block_hash.extend_block_hashes`, the replicas' ``block_size``, the
request's ``cache_salt``) with the call; a prompt it cannot tokenize is routed without them, and
the replica answers the error.

Between them each engine call is a stream: a head (``("stream",)``, ``("accepted",)`` for a whole
answer, or ``("error", status, message, param, headers)``), then the server-sent events, or
``("whole", body)`` / an error. A replica that dies (``ray.kill``, its node lost) before the
client got a byte (a whole answer, or a stream before its first event) is retried once on another
replica; after that, or once a stream has sent events, the client gets OpenAI's error body (503;
in a stream an error event, then ``[DONE]``). Ray Serve restarts the replica; its router drops it
once the handle sees it dead.

Why not Ray Serve LLM (``ray.serve.llm``): its ``LLMServer`` takes an engine class
(``ray.llm._internal.serve.core.engine.protocol.LLMEngine``), but its ``LLMConfig.llm_engine`` accepts
only the engines it knows (vLLM), and its requests and responses are vLLM's protocol classes
(``vllm.entrypoints.openai...``), so it needs vLLM installed; its ``PrefixCacheAffinityRouter``
matches prompt characters in a prefix tree of what it routed, not the engine's block hashes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import signal
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig

from pagedpack.async_llm import check_online
from pagedpack.engine_args import EngineArgs
from pagedpack.llm import LLM
from pagedpack.runtime.block_hash import extend_block_hashes, first_block_keys
from pagedpack.runtime.flow_control import FlowControl
from pagedpack.serve.app import build_app as build_fastapi_app
from pagedpack.serve.models import ServingModels
from pagedpack.serve.openai_serving import ServingConfig, ServingError, _num_chars, chat_text
from pagedpack.serve.protocol import ChatCompletionRequest, CompletionRequest
from pagedpack.serve.server import serving_over

APP_NAME = "pagedpack"
DELETE_TIMEOUT_S = 30.0  # pagedpack serve -dp N: how long a stop waits for Serve to delete the application
REQUEST_ROUTERS = {"prefix-aware": "pagedpack.serve.prefix_router.PrefixAwareRouter",
                   "round-robin": "pagedpack.serve.prefix_router.RoundRobinRouter",
                   "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}


@dataclass(frozen=True)
class RayServeOptions:
    """How the application is deployed: ``data_parallel_size`` engine replicas of ``num_cpus``
    CPUs each (Ray's resource, fractional allowed), at most ``max_ongoing_requests`` requests at
    a replica, routed by ``request_router`` (a key of :data:`REQUEST_ROUTERS`), the replicas
    reporting their cached blocks every ``routing_stats_period_s`` seconds; ``api_key``,
    ``metrics_namespace`` and ``flow_control`` as the single server's; ``runtime_env``: Ray's, for
    both deployments (e.g. ``{"py_executable": "/path/to/venv/bin/python"}``)."""

    data_parallel_size: int = 1
    request_router: str = "prefix-aware"
    num_cpus: float = 1.0
    max_ongoing_requests: int = 256
    routing_stats_period_s: float = 1.0
    api_key: str | None = None
    metrics_namespace: str = "pagedpack"
    flow_control: FlowControl = FlowControl(stall_timeout_s=60.0)
    runtime_env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: expected an int >= 1, got {self.data_parallel_size!r}")
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router: expected one of {sorted(REQUEST_ROUTERS)}, got {self.request_router!r}")
        for name in ("num_cpus", "routing_stats_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a number > 0, got {getattr(self, name)!r}")


class PagedpackEngine:
    """One engine replica: the single server's :class:`OpenAIServing` over its own model."""

    def __init__(self, engine_args: EngineArgs, config: ServingConfig, metrics_namespace: str,
                 flow_control: FlowControl):
        check_online(engine_args)
        built, self._stop = queue.SimpleQueue(), threading.Event()

        def drive():  # builds the model and steps it in one thread, as pagedpack serve does (one OpenMP pool)
            try:
                llm = LLM.from_engine_args(engine_args)
                serving = serving_over(llm, config, flow_control=flow_control, metrics_namespace=metrics_namespace)
            except BaseException as err:  # noqa: BLE001 -- raised by the constructor
                built.put(err)
                return
            built.put(serving)
            llm._loop.serve_forever(self._stop)  # if it dies: loop.error is set, the health check fails

        threading.Thread(target=drive, name="pagedpack-engine", daemon=True).start()
        serving = built.get()
        if isinstance(serving, BaseException):
            raise serving
        self.serving, self.llm = serving, serving.llm
        self.kv = self.llm.llm_engine.scheduler.kv_cache_manager

    def routing_info(self) -> dict:
        """What the ingress needs to compute block hashes and check bodies as this replica does."""
        return {"tokenizer": self.llm.tokenizer, "block_size": self.llm.block_size,
                "prefix_caching": self.kv.enable_prefix_caching, "max_text_chars": self.serving.max_text_chars,
                "max_model_len": self.serving.max_model_len, "max_chat_body_bytes": self.serving.max_chat_body_bytes}

    async def serve_request(self, route: str, body: CompletionRequest | ChatCompletionRequest,
                            block_hashes: list[bytes] | None = None):
        """The answer to ``body`` (``route``: ``"completions"`` or ``"chat"``) as the stream the
        module docstring describes; ``block_hashes`` is the router's, unused here."""
        try:
            result = await (self.serving.completions(body) if route == "completions" else self.serving.chat(body))
        except Exception as err:  # noqa: BLE001 -- answered as the single server answers it
            yield _error_item(err)
            return
        # the requests are in the engine now: whatever ends this generator (the client gone cancels it)
        # must end their stream or task, whose own cleanup aborts them; a stream's is armed once it runs
        if not asyncio.iscoroutine(result):
            async with contextlib.aclosing(result) as events:
                first = await anext(events, None)
                yield ("stream",)
                if first is not None:
                    yield first
                    async for event in events:
                        yield event
            return
        whole = asyncio.ensure_future(result)
        try:
            yield ("accepted",)
            try:
                answer = ("whole", await whole)
            except Exception as err:  # noqa: BLE001
                answer = _error_item(err)
            yield answer
        finally:
            whole.cancel()  # nothing once it is done

    async def record_routing_stats(self) -> dict:
        """Ray Serve's routing-stats hook: ``block_hashes`` (the cached blocks' 32-byte digests),
        the prefix cache's counters in tokens (``prefix_cache_queries``, ``prefix_cache_hits``),
        ``num_waiting`` and ``num_running`` requests."""
        stats = self.llm.get_stats()
        return {"block_hashes": list(self.kv.pool.cached_blocks()), "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits, "num_waiting": self.llm._loop.num_waiting,
                "num_running": self.llm.llm_engine.scheduler.num_running}

    def metrics(self) -> str:
        """This replica's Prometheus exposition (the single server's ``/metrics``)."""
        return self.serving.metrics.exposition().decode()

    def check_health(self) -> None:
        """Ray Serve's health check: ``RuntimeError`` once the engine loop has died (Serve restarts the replica)."""
        if not self.serving.healthy:
            raise RuntimeError(f"the engine loop has died: {self.llm._loop.error!r}")


def _error_item(err: Exception) -> tuple:
    err = err if isinstance(err, ServingError) else ServingError.internal(err)  # logged here, with its id
    return ("error", err.status, str(err), err.param, err.headers)


def _serving_error(item: tuple) -> ServingError:
    _, status, message, param, headers = item
    return ServingError(status, message, param=param, headers=headers)


def _replica_gone(err: BaseException) -> ServingError:
    return ServingError(503, f"the engine replica serving this request died ({type(err).__name__}); retry later",
                        headers={"Retry-After": "1"})


class RemoteServing:
    """:class:`OpenAIServing`'s face for :func:`pagedpack.serve.app.build_app`, its work done by
    the engine replicas behind ``engine`` (a deployment handle); ``info`` is a replica's
    :meth:`PagedpackEngine.routing_info`."""

    healthy = True  # a replica that fails its health check is restarted by Ray Serve

    def __init__(self, engine, config: ServingConfig, info: dict, *, route_by_prefix: bool = True):
        self.engine, self.config, self.route_by_prefix = engine, config, route_by_prefix
        self.tokenizer, self.block_size = info["tokenizer"], info["block_size"]
        self.prefix_caching, self.max_text_chars = info["prefix_caching"], info["max_text_chars"]
        self.max_model_len, self.max_chat_body_bytes = info["max_model_len"], info["max_chat_body_bytes"]
        self.metrics = _ReplicaMetrics()
        self.models = ServingModels(config.model_name)  # no LoRA adapters over replicas (pagedpack serve refuses them)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedpack-route")

    async def completions(self, body: CompletionRequest):
        return await self._call("completions", body)

    async def chat(self, body: ChatCompletionRequest):
        return await self._call("chat", body)

    def block_hashes(self, route: str, body) -> list[bytes]:
        """The block hashes of ``body``'s first prompt as a replica will tokenize it; [] for a
        prompt it would refuse (the replica answers the error), with prefix caching off, or for a
        router that does not use them."""
        if not (self.route_by_prefix and self.prefix_caching) or self.tokenizer is None:
            return []
        limit = self.max_text_chars  # past it the replica refuses the request: not worth tokenizing
        hashes: list[bytes] = []
        try:
            if route == "chat":
                if body.chat_template is not None and not self.config.trust_request_chat_template:
                    return []
                if _num_chars([m.model_dump(exclude_none=True) for m in body.messages], limit) > limit:
                    return []
                text = chat_text(self.tokenizer, body, self.config)
                ids = self.tokenizer(text[:limit], add_special_tokens=False).input_ids
            else:
                prompt = body.prompts()[0]
                if isinstance(prompt, str) and len(prompt) > limit:
                    return []
                ids = prompt if not isinstance(prompt, str) else \
                    self.tokenizer(prompt, add_special_tokens=True).input_ids
            extend_block_hashes(hashes, ids, self.block_size, first_block_keys(body.cache_salt))
        except (ValueError, TypeError, UnicodeError, struct.error):  # ids out of range: struct.error
            return []
        return hashes

    async def _call(self, route: str, body):
        loop = asyncio.get_running_loop()
        block_hashes = await loop.run_in_executor(self._tokenizer_thread, self.block_hashes, route, body)
        stream, head = await self._open(route, body, block_hashes, retries=1)
        if head[0] == "stream":
            return self._events(stream, route, body, block_hashes)
        return self._whole(stream, route, body, block_hashes)

    async def _open(self, route: str, body, block_hashes: list[bytes], *, retries: int):
        """(the replica's stream, its head); a replica that dies first is retried ``retries`` times."""
        for attempt in range(retries + 1):
            stream = self.engine.options(stream=True).serve_request.remote(route, body, block_hashes=block_hashes)
            try:
                head = await stream.__anext__()
            except RayActorError as err:
                if attempt == retries:
                    raise _replica_gone(err) from err
                continue
            if head[0] == "error":
                raise _serving_error(head)
            return stream, head

    async def _whole(self, stream, route: str, body, block_hashes: list[bytes], retries: int = 1) -> dict:
        try:
            item = await stream.__anext__()
        except RayActorError as err:
            if not retries:
                raise _replica_gone(err) from err
            stream, _ = await self._open(route, body, block_hashes, retries=0)
            return await self._whole(stream, route, body, block_hashes, retries=0)
        finally:
            stream.cancel()  # the client gone (this task cancelled): the replica aborts the request
        if item[0] == "error":
            raise _serving_error(item)
        return item[1]

    async def _events(self, stream, route: str, body, block_hashes: list[bytes]):
        sent, retries = False, 1
        try:
            while True:
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except RayActorError as err:
                    if sent or not retries:
                        yield f"data: {json.dumps(_replica_gone(err).body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    retries -= 1
                    try:
                        stream, _ = await self._open(route, body, block_hashes, retries=0)
                    except ServingError as failed:
                        yield f"data: {json.dumps(failed.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    continue
                sent = True
                yield event
        finally:
            stream.cancel()


class _ReplicaMetrics:
    """The ingress's ``/metrics``: each engine replica serves its own (:meth:`PagedpackEngine.metrics`)."""

    def exposition(self) -> bytes:
        raise ServingError(404, "/metrics: on Ray Serve each engine replica keeps its own metrics "
                                "(PagedpackEngine.metrics, and the prefix-cache counters in its routing stats)")


@serve.ingress()
class PagedpackIngress:
    """The OpenAI API's routes (the single server's app) over the engine replicas."""

    def __init__(self, engine, config: ServingConfig, api_key: str | None, route_by_prefix: bool):
        self.engine, self.config, self.api_key, self.route_by_prefix = engine, config, api_key, route_by_prefix

    async def __serve_build_asgi_app__(self):
        info = await self.engine.routing_info.remote()
        serving = RemoteServing(self.engine, self.config, info, route_by_prefix=self.route_by_prefix)
        return build_fastapi_app(serving, api_key=self.api_key)


def pagedpack_app(engine_args: EngineArgs, config: ServingConfig, options: RayServeOptions = RayServeOptions()):
    """The Ray Serve application (bound, for ``serve.run``) serving ``engine_args``' model."""
    check_online(engine_args)
    actor_options = {"runtime_env": options.runtime_env} if options.runtime_env else {}
    router = RequestRouterConfig(request_router_class=REQUEST_ROUTERS[options.request_router],
                                 request_routing_stats_period_s=options.routing_stats_period_s)
    engine = serve.deployment(PagedpackEngine).options(
        num_replicas=options.data_parallel_size, max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options={**actor_options, "num_cpus": options.num_cpus}, request_router_config=router,
        health_check_period_s=2, graceful_shutdown_timeout_s=5)
    ingress = serve.deployment(PagedpackIngress).options(
        num_replicas=1, max_ongoing_requests=config.max_queue, ray_actor_options={**actor_options, "num_cpus": 0})
    return ingress.bind(engine.bind(engine_args, config, options.metrics_namespace, options.flow_control),
                        config, options.api_key, options.request_router == "prefix-aware")


def engine_replicas(app_name: str = APP_NAME) -> dict:
    """The live engine replicas of application ``app_name``: actor name -> actor handle (Ray Serve
    names a replica's actor ``SERVE_REPLICA::<app>#<deployment>#<id>``, in namespace ``serve``)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{PagedpackEngine.__name__}#"
    return {a["name"]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def prefix_cache_counters(app_name: str = APP_NAME, timeout_s: float = 30.0) -> tuple[int, int]:
    """(prompt tokens looked up, found) in the prefix caches of every live engine replica of
    ``app_name``, summed from the replicas' own counters (their routing stats)."""
    import ray

    actors = engine_replicas(app_name).values()
    stats = ray.get([actor.record_routing_stats.remote() for actor in actors], timeout=timeout_s)
    return sum(s["prefix_cache_queries"] for s in stats), sum(s["prefix_cache_hits"] for s in stats)


def run(app, *, host: str, port: int) -> int:
    """``pagedpack serve --data-parallel-size N``: ``app`` served on ``host:port`` by Ray Serve's
    HTTP proxy until SIGINT / SIGTERM, then deleted. Joins the Ray cluster of ``RAY_ADDRESS`` (or one
    running on this host), else starts one in this process. Returns the exit status."""
    import ray

    ray.init(log_to_driver=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        status = 0 if _answers(host, port) else 1
        if not status:
            print(f"pagedpack: serving on http://{host}:{port}/v1 (Ray Serve application {APP_NAME!r})", flush=True)
            stop.wait()
        else:  # Serve was running already: it keeps the HTTP options it started with
            print(f"pagedpack: error: --port: Ray Serve on this cluster already serves HTTP elsewhere (it keeps the "
                  f"options of its first start), nothing answers on {host}:{port}; stop it (`serve shutdown`) "
                  f"or use its port", file=sys.stderr, flush=True)
        # bounded: a Ctrl-C in a terminal reaches the Ray processes this one started too, and a delete
        # then waits for a controller that is gone
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(DELETE_TIMEOUT_S)
    finally:
        ray.shutdown()
    return status


def _answers(host: str, port: int, timeout_s: float = 10.0) -> bool:
    """Whether Serve's HTTP proxy answers ``GET /health`` on ``host:port`` within ``timeout_s``."""
    address = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(f"http://{address}:{port}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


_SERVING_ARGS = {"served_model_name", "chat_template", "trust_request_chat_template", "max_queue",
                 "max_tokenize_queue"}


def build_app(args: dict):
    """Ray Serve's application builder: ``serve run pagedpack.serve.ray_app:build_app model=NAME
    data_parallel_size=2``, or a config file's ``import_path: pagedpack.serve.ray_app:build_app``
    with ``args``. ``args`` (strings from the command line, or the config's values): ``model``
    (required); the fields of :class:`RayServeOptions` (``data_parallel_size``, ``request_router``,
    ``num_cpus``, ...); ``served_model_name`` (default: ``model``), ``chat_template`` (a file or
    the template), ``trust_request_chat_template``, ``max_queue``, ``max_tokenize_queue`` as
    ``pagedpack serve`` takes them; ``engine_args``: :class:`~pagedpack.engine_args.EngineArgs`'
    keyword arguments (a mapping, or its JSON). ``ValueError`` naming an unknown or bad argument."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("model: required (e.g. serve run pagedpack.serve.ray_app:build_app model=smollm2-135m)")
    option_types = {f.name: f.type for f in fields(RayServeOptions) if f.name != "flow_control"}
    unknown = set(args) - {"model", "engine_args"} - _SERVING_ARGS - set(option_types)
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown argument; expected model, engine_args, "
                         f"{', '.join(sorted(_SERVING_ARGS | set(option_types)))}")
    engine_kwargs = _parsed("engine_args", args.pop("engine_args", {}), dict)
    engine_args = EngineArgs(model=args.pop("model"), **engine_kwargs)
    template = args.pop("chat_template", None)
    if template is not None and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    config = ServingConfig(model_name=args.pop("served_model_name", None) or str(engine_args.model),
                           chat_template=template,
                           trust_request_chat_template=_parsed("trust_request_chat_template",
                                                               args.pop("trust_request_chat_template", False), bool),
                           **{name: _parsed(name, args.pop(name), int) for name in ("max_queue", "max_tokenize_queue")
                              if name in args})
    converters = {"int": int, "float": float, "str": str, "dict": dict, "str | None": str}
    options = RayServeOptions(**{name: _parsed(name, value, converters[option_types[name]])
                                 for name, value in args.items()})
    return pagedpack_app(engine_args, config, options)


def _parsed(name: str, value, kind: type):
    """``value`` as ``kind``: as given (a YAML config's whole number for a float too), or parsed from
    the string the command line gives."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if kind in (dict, bool) else kind(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, kind):
            return parsed
    raise ValueError(f"{name}: expected {kind.__name__}, got {value!r:.80}")
