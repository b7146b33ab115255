"""``pagedpack serve``'s application in this process (httpx's ASGI transport, the built-in tiny
model): one request must never fail the others. A failure that is no request's fault answers a
generic 500 with an error id (the traceback only in the log); an error the engine gives one request
is passed on."""
import asyncio
import json
import re

import httpx
import pytest

from pagedpack import LLM
from pagedpack.runtime.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_blocks=64)  # 1024 tokens of context: 4096 characters of text at most


def _app(llm, **config):
    """The application and its :class:`OpenAIServing` (``config``: :class:`ServingConfig`'s fields)."""
    from pagedpack.async_llm import AsyncLLM
    from pagedpack.serve.app import build_app
    from pagedpack.serve.metrics import ServerMetrics
    from pagedpack.serve.openai_serving import OpenAIServing, ServingConfig

    serving = OpenAIServing(AsyncLLM.from_llm(llm), ServingConfig("tiny", **config),
                            ServerMetrics(llm._loop, model_name="tiny"))
    return build_app(serving), serving


def _ask(app, *requests):
    """``(method, path, json body)`` requests sent at once; their responses."""
    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server",
                                     timeout=60) as http:
            return await asyncio.gather(*(http.request(method, path, json=body) for method, path, body in requests))

    return asyncio.run(ask())


def _events(response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.text.splitlines() if line.startswith("data: ")]


def _streams(*deltas_then):
    """An ``AsyncLLM.add_request`` whose stream yields the given deltas, then raises what follows
    them (if an exception)."""
    async def stream():
        for item in deltas_then:
            if isinstance(item, BaseException):
                raise item
            yield item

    return lambda prompt, params, request_id: stream()


ERROR_ID = re.compile(r"internal server error \(error id ([0-9a-f]{12}); the server's log has its details\)")


def test_a_500_tells_the_client_an_error_id_and_the_log_the_traceback(llm, caplog):
    app, serving = _app(llm)

    def fail(*_):
        raise TypeError("secret detail 42")

    serving.engine.add_request = fail
    with caplog.at_level("ERROR", logger="pagedpack.serve"):
        (r,) = _ask(app, ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}))
    assert r.status_code == 500 and "secret" not in r.text and "TypeError" not in r.text
    error = r.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    (record,) = caplog.records
    error_id = ERROR_ID.fullmatch(error["message"])[1]
    assert record.getMessage() == f"internal error {error_id}" and "secret detail 42" in caplog.text
    assert "Traceback" in caplog.text


def test_a_stream_that_fails_sends_an_error_event_with_an_id_and_logs_the_traceback(llm, caplog):
    app, serving = _app(llm)
    first = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "a", [5])], finished=False)
    serving.engine.add_request = _streams(first, RuntimeError("secret detail 43"))
    with caplog.at_level("ERROR", logger="pagedpack.serve"):
        (r,) = _ask(app, ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}))
    chunk, error, done = _events(r)
    assert chunk["choices"][0]["text"] == "a" and done == "[DONE]" and "secret" not in r.text
    error_id = ERROR_ID.fullmatch(error["error"]["message"])[1]
    assert error["error"]["code"] == 500 and f"internal error {error_id}" in caplog.text
    assert "secret detail 43" in caplog.text and "Traceback" in caplog.text


def test_an_error_the_engine_gives_one_request_is_passed_on_as_written(llm, caplog):
    message = "sampling: the probabilities of completion 0 are not finite"
    failed = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", [], "error")], error=message)
    app, serving = _app(llm)
    serving.engine.add_request = _streams(failed)
    with caplog.at_level("ERROR", logger="pagedpack.serve"):
        (whole,) = _ask(app, ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}))
        (streamed,) = _ask(app, ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}))
    assert whole.status_code == 500 and whole.json()["error"]["message"] == message
    assert [e if e == "[DONE]" else e["error"]["message"] for e in _events(streamed)] == [message, "[DONE]"]
    assert not caplog.records  # the request's own failure, not the server's: nothing to trace
