"""The FastAPI application of ``pagedpack serve``: OpenAI's routes, health, version and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`pagedpack.serve.openai_serving`),
``GET /v1/models`` (the base model and its LoRA adapters), ``GET /health`` (200; 503 once the engine
loop has died), ``GET /version``, ``GET /metrics`` (Prometheus text, :mod:`pagedpack.serve.metrics`);
with ``lora_updating`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (:mod:`pagedpack.serve.models`), which are otherwise not there (404).

Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, a missing, unknown or mistyped field (a union-typed one, e.g. ``prompt``, says the forms it
takes), or a value the engine refuses (the message and ``param`` name the field); 404 for a model
this server does not serve (as OpenAI and vLLM answer), or an adapter to unload it does not; 401
without the API key (``--api-key``: ``Authorization: Bearer KEY`` on ``/v1/*`` only, as vLLM:
``/openapi.json``, ``/health``, ``/metrics`` and ``/version`` answer anyone, and the schema holds no
key); 413 for a body over
``max_body_bytes``, or a chat body over what its fields could use
(:attr:`~pagedpack.serve.openai_serving.OpenAIServing.max_chat_body_bytes`), declared or
streamed: refused before it is read and parsed, the connection then closed (not read to its end);
503 with ``Retry-After`` when ``--max-queue`` requests already wait for their first step or
``--max-tokenize-queue`` for the tokenizer; 500 if the engine fails on a request, or for a bug: a
generic message with an error id, the traceback in the log
(:meth:`~pagedpack.serve.openai_serving.ServingError.internal`). A client that goes away (a closed
stream, a timed-out request) aborts its requests: their KV blocks are freed before the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY

import pagedpack
from pagedpack.serve.openai_serving import OpenAIServing, ServingError
from pagedpack.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    brief,
    printable,
)

MAX_BODY_BYTES = 32 * 2**20


def build_app(serving: OpenAIServing, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              lora_updating: bool = False) -> FastAPI:
    """The application over ``serving`` (its engine, configuration, models and metrics)."""
    # max_body_size: Starlette's limit, on declared and streamed (chunked) bodies alike -> 413
    app = _App(title="pagedpack", version=pagedpack.__version__, docs_url=None, redoc_url=None,
               max_body_size=max_body_bytes)
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """The API key on ``/v1/*``; what no handler answered (a bug) as a 500 with an error id."""
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(ServingError(401, "Unauthorized: expected the header 'Authorization: Bearer <api key>'"))
        try:
            return await call_next(request)
        except Exception as err:  # noqa: BLE001 -- a bug, the engine failing: OpenAI's error body, the id logged
            # (here, not in an exception handler: Starlette re-raises after those, and uvicorn logs it again)
            return _error(ServingError.internal(err))

    @app.exception_handler(ServingError)
    async def serving_error(_, err: ServingError):
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, err: RequestValidationError):
        return _error(_validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):  # unknown route, wrong method, a body
        if err.status_code == 413:  # streamed past the limit: the app's, or the chat route's
            return _too_large(request.url.path, request.scope.get(MAX_BODY_SIZE_SCOPE_KEY, max_body_bytes))
        return _error(ServingError(err.status_code, str(err.detail)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(request, serving.completions(body))

    @app.post("/v1/chat/completions", max_body_size=min(max_body_bytes, serving.max_chat_body_bytes))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _answer(request, serving.chat(body))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": serving.models.cards(created, serving.max_model_len)}

    if lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return PlainTextResponse(await serving.load_lora_adapter(body))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return PlainTextResponse(serving.unload_lora_adapter(body))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if serving.healthy else 503)

    @app.get("/version")
    async def version():
        return {"version": pagedpack.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


class _App(FastAPI):
    """FastAPI whose body limits (the app's ``max_body_size``, a route's own) cost next to nothing: a
    body declared larger is answered (413, :func:`_too_large`) before any of the application runs;
    a streamed (chunked) one is counted as it comes, by Starlette, and answered the same way."""

    def build_middleware_stack(self):
        inner = super().build_middleware_stack()
        limits = {route.path: route.max_body_size for route in self.routes
                  if getattr(route, "max_body_size", None) is not None}

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return await inner(scope, receive, send)
            limit = limits.get(scope["path"], self.max_body_size)
            declared = Headers(scope=scope).get("content-length", "")
            if limit is not None and declared.isdigit() and int(declared) > limit:
                return await _too_large(scope["path"], limit)(scope, receive, send)
            await inner(scope, receive, send)

        return app


async def _answer(request: Request, work):
    """The endpoint's answer: server-sent events for a stream (Starlette cancels the stream when the
    client goes; its ``finally`` aborts the requests), else the whole body, computed while the
    client is still there (a client gone cancels it, which aborts the requests)."""
    result = await work
    if inspect.isasyncgen(result):
        return StreamingResponse(result, media_type="text/event-stream")
    task, gone = asyncio.ensure_future(result), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client went away (or the server is stopping): abort the work
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(task.result())


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(err: ServingError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _too_large(path: str, limit: int) -> JSONResponse:
    """413 for a body over ``limit`` bytes. It closes the connection: uvicorn would otherwise read the
    rest of the body to keep it (30 MB: ~40 ms of the event loop)."""
    return _error(ServingError(413, f"body: more than the {limit} bytes a request to {path} may have",
                               headers={"Connection": "close"}))


def _validation_error(err: RequestValidationError) -> ServingError:
    """400 naming the first bad field (``loc`` after ``"body"``, then a union's ``ctx["at"]``:
    :mod:`pagedpack.serve.protocol`) with pydantic's message (a ``ValueError``'s own) and what came."""
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ())[1:]]
    kind, ctx = first.get("type", ""), first.get("ctx") or {}
    if kind == "json_invalid":
        return ServingError(400, f"body: expected JSON ({ctx.get('error', 'invalid')})")
    if not loc:
        return ServingError(400, f"body: expected a JSON object, got {brief(first.get('input'))}")
    field = loc[0]
    if kind == "extra_forbidden":
        return ServingError(400, printable(f"Unrecognized request argument supplied: {'.'.join(loc)}"), param=field)
    shown = ".".join([*loc, ctx["at"]] if ctx.get("at") else loc)
    message = ctx["error"] if kind == "value_error" and "error" in ctx else first.get("msg", "invalid")
    got = ctx.get("got") or brief(first.get("input"))
    return ServingError(400, printable(f"{shown}: {message}, got {got}"), param=field)
