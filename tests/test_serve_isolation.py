"""``pagedpack serve``'s application in this process (httpx's ASGI transport, the built-in tiny
model): one request must never fail the others. A failure that is no request's fault answers a
generic 500 with an error id (the traceback only in the log), an error the engine gives one request
is passed on, rendering and tokenizing run in threads of their own with a bounded queue (503 past
it), and the rendered text is checked against the context before it is tokenized."""
import asyncio
import json
import re
import time

import httpx
import pytest

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import tiny_model
from pagedpack.runtime.outputs import CompletionOutput, RequestOutput

# ~1 s of rendering on an idle machine, the content once
SLOW = "{% for i in range(20000) %}{% for j in range(1000) %}{% if j < 0 %}{% endif %}{% endfor %}{% endfor %}" \
       "<{{ messages[0]['content'] }}>"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_blocks=64)  # 1024 tokens of context: 4096 characters of text at most


@pytest.fixture(scope="module")
def untokenized():
    """The tiny Llama given as an instance: no tokenizer, token ids in and out."""
    return LLM(tiny_model("llama", num_hidden_layers=1), num_blocks=64)


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

    return lambda prompt, params, request_id, lora_request=None: stream()


ERROR_ID = re.compile(r"internal server error \(error id ([0-9a-f]{12}); the server's log has its details\)")


def test_a_500_tells_the_client_an_error_id_and_the_log_the_traceback(llm, caplog):
    app, serving = _app(llm)

    def fail(*_, **__):
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


def test_the_rendered_text_is_checked_before_it_is_tokenized(llm):
    """A template can multiply what the messages hold: 100 characters rendered 60 times."""
    app, _ = _app(llm, chat_template="{% for i in range(60) %}{{ messages[0]['content'] }}{% endfor %}")
    fits, too_long = "x" * 10, "x" * 100  # 600 and 6000 characters rendered; 4096 fit
    r, ok = _ask(app, ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}),
                 ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": fits}], "max_tokens": 1}))
    assert r.status_code == 400 and ok.status_code == 200
    assert r.json()["error"] == {
        "message": "messages: the chat template renders 6000 characters, more than the 4096 that this model's "
                   "maximum context length (1024 tokens) can hold",
        "type": "BadRequestError", "param": "messages", "code": 400}


def test_a_request_s_own_template_is_counted_too(llm):
    app, _ = _app(llm, trust_request_chat_template=True)
    template = "{# " + "x" * 5000 + " #}{{ messages[0]['content'] }}"
    (r,) = _ask(app, ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template": template}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert r.json()["error"]["message"].startswith(f"chat_template: {len(template)} characters, more than the 4096")


def test_rendering_runs_off_the_event_loop_in_a_bounded_queue(llm):
    """While a slow template renders, the event loop answers at once; with one place in the
    tokenizer's queue, two more chats at that moment get 503 + Retry-After, a later one is taken."""
    app, _ = _app(llm, chat_template=SLOW, max_tokenize_queue=1)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server",
                                     timeout=60) as http:
            slow = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat))
            await asyncio.sleep(0.05)  # it renders now
            start = time.monotonic()
            health = await http.get("/health")
            health_s = time.monotonic() - start
            refused = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat) for _ in range(2)))
            assert not slow.done()
            return health, health_s, refused, await slow, await http.post("/v1/chat/completions", json=chat)

    health, health_s, refused, slow, later = asyncio.run(ask())
    assert health.status_code == 200 and health_s < 0.25, health_s
    for r in refused:
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert r.json()["error"]["message"] == ("the server is busy: the tokenizer's queue is full "
                                                "(--max-tokenize-queue 1); retry later")
    assert slow.status_code == later.status_code == 200, (slow.text, later.text)


def test_serve_refuses_a_max_tokenize_queue_under_1(capsys):
    from conftest import run_cli

    code, _, err = run_cli(capsys, "serve", "no-such-model-dir", "--max-tokenize-queue", "0")
    assert code == 2 and "--max-tokenize-queue" in err, err


def test_without_a_tokenizer_stop_strings_and_text_prompts_are_400s_and_the_others_are_served(untokenized):
    """Issue: ``stop`` on a model without a tokenizer was refused in the engine's thread once the request
    had been taken (a 500, a stream's error event); a text prompt's 400 named ``prompts``."""
    app, _ = _app(untokenized)
    ok = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    bad = [({**ok, "stop": ["x"]}, "stop", "stop: stop strings need a tokenizer and the model"),
           ({**ok, "stop": "x", "n": 2}, "stop", "stop: stop strings need a tokenizer and the model"),
           ({**ok, "prompt": "hello"}, "prompt", "prompt: the model has no tokenizer; send token ids")]
    *refused, served = _ask(app, *[("POST", "/v1/completions", {**body, "stream": stream})
                                   for body, _, _ in bad for stream in (False, True)],
                            ("POST", "/v1/completions", ok))
    for r, (_, param, message) in zip(refused, [case for case in bad for _ in range(2)]):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(message), r.text
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4, served.text
    assert not untokenized.llm_engine.has_unfinished()


def test_without_a_tokenizer_a_stream_sends_a_chunk_per_step(untokenized):
    """Issue: with no text to show, a stream sent nothing until its last chunk; as vLLM, a chunk per step
    (empty text), the tokens in its logprobs when asked for (``return_tokens_as_token_ids``)."""
    app, _ = _app(untokenized)
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    plain, named = _ask(app, ("POST", "/v1/completions", body),
                        ("POST", "/v1/completions", {**body, "logprobs": 0, "return_tokens_as_token_ids": True}))
    expected = untokenized.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids
    for r in (plain, named):
        *chunks, done = _events(r)
        choices = [c["choices"][0] for c in chunks]
        assert done == "[DONE]" and [c["text"] for c in choices] == [""] * 5, r.text
        assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]
    tokens = [t for c in _events(named)[:-1] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == [f"token_id:{t}" for t in expected]


def test_serve_refuses_a_model_name_no_response_could_encode(capsys, monkeypatch):
    """From a break-it review: a model path with bytes that are not UTF-8 (Python's lone surrogates) became
    the served name, and every response and /metrics then failed with a 500 while /health said 200. Refused
    before the model is loaded."""
    from conftest import run_cli

    monkeypatch.setattr(LLM, "from_engine_args", lambda *_: pytest.fail("the model was loaded"))
    code, _, err = run_cli(capsys, "serve", "/tmp/caf\udce9.pt2")
    assert code == 2 and "--served-model-name: expected a name encodable as UTF-8" in err, err
