"""``pagedpack disagg-proxy``: one OpenAI endpoint over a prefill server and a decode server (prefill/decode
disaggregation, vLLM's proxy flow: ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``).

For each ``POST /v1/completions`` or ``/v1/chat/completions`` it

1. sends the body to the prefill server (``--kv-transfer-config`` with ``"kv_role": "kv_producer"``) as a
   whole answer of one token (``max_tokens`` / ``max_completion_tokens`` 1, ``stream`` false, no
   ``stream_options`` or ``min_tokens``) with ``"kv_transfer_params": {"do_remote_decode": true}``; the
   answer's ``kv_transfer_params`` say where its KV blocks wait;
2. sends the client's body with those ``kv_transfer_params`` to the decode server (``"kv_role":
   "kv_consumer"``), which pulls the blocks, and relays its answer (server-sent events as they come).

A body with ``n`` > 1 or several prompts goes to the decode server alone (it prefills them itself): one
answer's ``kv_transfer_params`` name one request's blocks. A client's own ``kv_transfer_params`` is refused
(400): only the proxy says where blocks are. An error answer of either server (status and body) goes to
the client as it came; a server that cannot be reached, or ends a whole answer early, is a 502 naming it;
one that ends a stream early, an error event then ``data: [DONE]`` (only whole events are relayed, so the
client never parses half a chunk). A prefill server whose whole answer does not come within
``prefill_timeout_s`` (``--prefill-timeout``) is a 504 naming it, and its request is closed (which aborts
it there); the decode server's answer has no limit of the proxy's (its length is the client's
``max_tokens``: the client's own timeout, a disconnect, ends it). A client that goes away closes the
server request under way, which aborts it there. ``Authorization`` is passed on to both servers. ``GET
/health``: 200 when both servers answer 200; ``GET /v1/models``: the decode server's (both within
:data:`QUICK_ANSWER_S`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedpack.serve import DEFAULT_PREFILL_TIMEOUT_S
from pagedpack.serve.app import MAX_BODY_BYTES, _App, _disconnected, _error
from pagedpack.serve.openai_serving import ServingError

_PASSED_HEADERS = ("authorization",)
QUICK_ANSWER_S = 5.0  # /health and /v1/models: seconds either server has to answer


class DisaggProxy:
    """The proxy's work over the servers at ``prefill_url`` and ``decode_url`` (``http://host:port``);
    ``connect_timeout_s``: to reach either; ``prefill_timeout_s``: the prefill server's whole answer
    (seconds; module docstring). ``ValueError`` for a timeout that is not a finite number > 0."""

    def __init__(self, prefill_url: str, decode_url: str, *, connect_timeout_s: float = 10.0,
                 prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S):
        if not 0 < prefill_timeout_s < float("inf"):  # NaN too
            raise ValueError(f"--prefill-timeout: expected seconds > 0, got {prefill_timeout_s}")
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.prefill_timeout_s = prefill_timeout_s
        timeout = httpx.Timeout(None, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def handle(self, path: str, request: Request):
        """The answer to a client's ``POST path`` (``/v1/completions`` or ``/v1/chat/completions``)."""
        body = await _json_body(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
        if "kv_transfer_params" in body:
            raise ServingError(400, "kv_transfer_params: set by the proxy, not by a client", param="kv_transfer_params")
        if _one_request(body):
            prefilled = await _until_disconnect(request, self._prefill(path, body, headers))
            if isinstance(prefilled, Response):  # the prefill server's error, as it came
                return prefilled
            if prefilled is not None:
                body = {**body, "kv_transfer_params": prefilled}
        if body.get("stream") is True:
            return await self._stream(path, body, headers)
        return await _until_disconnect(request, self._whole(self.decode_url, path, body, headers))

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """The prefill server's ``kv_transfer_params`` for ``body`` (None: it gave none, the decode server
        computes the prompt), or its error answer."""
        prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        prefill.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in body:
            prefill["max_completion_tokens"] = 1
        try:  # past the deadline the request is cancelled: its connection closed, which aborts it there
            answer = await asyncio.wait_for(self._whole(self.prefill_url, path, prefill, headers),
                                            self.prefill_timeout_s)
        except asyncio.TimeoutError:
            raise ServingError(504, f"the prefill server at {self.prefill_url} did not answer {path} within "
                                    f"{self.prefill_timeout_s:g} s (--prefill-timeout); the request there was "
                                    "aborted") from None
        if answer.status_code != 200:
            return answer
        data = json.loads(answer.body)
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        return params if isinstance(params, dict) else None

    async def _whole(self, url: str, path: str, body: dict, headers: dict) -> Response:
        try:
            answer = await self.client.post(url + path, json=body, headers=headers)
        except httpx.HTTPError as err:
            raise _unreachable(url, err) from err
        if answer.status_code == 200:
            try:
                json.loads(answer.content)
            except ValueError as err:
                raise ServingError(502, f"the server at {url} answered {path} with no JSON object") from err
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", "application/json"))

    async def _stream(self, path: str, body: dict, headers: dict) -> Response:
        url = self.decode_url
        try:
            answer = await self.client.send(self.client.build_request("POST", url + path, json=body, headers=headers),
                                            stream=True)
        except httpx.HTTPError as err:
            raise _unreachable(url, err) from err
        if answer.status_code != 200:
            try:
                content = await answer.aread()
            except httpx.HTTPError as err:
                raise _unreachable(url, err) from err
            finally:
                await answer.aclose()
            return Response(content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type", "application/json"))
        return StreamingResponse(_whole_events(answer, url), media_type="text/event-stream")

    async def healthy(self) -> bool:
        for url in (self.prefill_url, self.decode_url):
            try:
                if (await self.client.get(f"{url}/health", timeout=QUICK_ANSWER_S)).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    async def aclose(self) -> None:
        await self.client.aclose()


def build_proxy_app(proxy: DisaggProxy, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The proxy's FastAPI application (errors as OpenAI's body, :class:`ServingError`; a body over
    ``max_body_bytes``, declared or streamed, is a 413)."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        await proxy.aclose()

    app = _App(title="pagedpack disagg-proxy", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan, max_body_size=max_body_bytes)

    @app.exception_handler(ServingError)
    async def serving_error(_, err: ServingError):
        return _error(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):  # an unknown route, a body over the limit
        return _error(ServingError(err.status_code, str(err.detail)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        return await _get(proxy, "/v1/models", request)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if await proxy.healthy() else 503)

    return app


async def _get(proxy: DisaggProxy, path: str, request: Request) -> Response:
    headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
    try:
        answer = await proxy.client.get(proxy.decode_url + path, headers=headers, timeout=QUICK_ANSWER_S)
    except httpx.HTTPError as err:
        raise _unreachable(proxy.decode_url, err) from err
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type", "application/json"))


async def _json_body(request: Request) -> dict:
    """The body as a JSON object (400 otherwise), read within the body limit."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise ServingError(400, f"body: expected JSON ({err})") from None
    if not isinstance(body, dict):
        raise ServingError(400, f"body: expected a JSON object, got {type(body).__name__}")
    return body


def _one_request(body: dict) -> bool:
    """Whether ``body`` makes one engine request (one prompt, ``n`` 1): only then is it prefilled apart."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        and len(prompt) > 1
    return body.get("n", 1) == 1 and not several


async def _until_disconnect(request: Request, work):
    """``await work``, cancelled (closing its server request, which aborts it there) if the client goes."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


async def _whole_events(answer: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The server-sent events of ``answer``, each passed on once whole; if the server ends the stream
    early (no ``[DONE]``), an error event naming it and ``data: [DONE]``. Closing this closes ``answer``."""
    pending, done = b"", False
    try:
        async for chunk in answer.aiter_raw():
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                done = done or event.strip() == b"data: [DONE]"
                yield event + b"\n\n"
        if done:
            return
        failure = "ended the stream before data: [DONE]"
    except httpx.HTTPError as err:
        failure = f"failed mid-stream ({type(err).__name__}: {err})"
    finally:
        await answer.aclose()
    error = ServingError(502, f"the decode server at {url} {failure}")
    yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


def _unreachable(url: str, err: httpx.HTTPError) -> ServingError:
    return ServingError(502, f"the server at {url} could not be reached or did not answer ({type(err).__name__}: "
                             f"{err or 'no details'})")
