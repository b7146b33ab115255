"""Prefill/decode disaggregation on one machine, as a client sees it: the disaggregation proxy
(``pagedpack disagg-proxy``'s application, served in this process) over a ``pagedpack serve`` that prefills
(``P2pTcpConnector``, ``kv_producer``) and one that decodes (``kv_consumer``), two live processes shared by
the module (the built-in tiny model, exported once), talked to with the official ``openai`` client and raw
HTTP / sockets. Reference: the same exported model in this process (``LLM.generate``), one prompt at a time,
greedy and seeded."""
import json
import signal
import socket
import struct
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from pagedpack import LLM, SamplingParams
from pagedpack.host.child_process import free_port
from pagedpack.runtime.kv_connector.p2p_tcp_connector import P2pTcpOptions
from pagedpack.runtime.kv_connector.tcp_transfer import Pull, _encoder
from pagedpack.serve.disagg_proxy import DisaggProxy, build_proxy_app

from conftest import RemoteServer, idle_metrics, random_prompts, run_cli, server_metrics

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"
PROMPTS = random_prompts((5, 16, 17, 40), seed=3)  # block_size 16: none, one, one and a token, two and a half
SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=11)]
MAX_TOKENS = 8


def _connector(role: str, **fields) -> str:
    return json.dumps({"kv_connector": "P2pTcpConnector", "kv_role": role, **fields})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("disagg")
    (folder / "chat.jinja").write_text(TEMPLATE)
    llm = LLM("tiny", num_blocks=64, keep_source_model=True)
    return llm, llm.export(folder / "tiny.pt2"), folder


class _Proxy:
    """The proxy's application on a free port, served by uvicorn in a thread of this process
    (``proxy_options``: :class:`DisaggProxy`'s, ``options``: :func:`build_proxy_app`'s)."""

    def __init__(self, prefill_url: str, decode_url: str, proxy_options: dict | None = None, **options):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_proxy_app(DisaggProxy(prefill_url, decode_url, **(proxy_options or {})), **options)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _started(proxy: _Proxy, timeout_s: float = 10.0) -> None:
    """Returns once ``proxy`` accepts connections."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def servers(exported):
    """``(proxy, producer, consumer)``: the two servers started side by side, all stopped at the end."""
    _, path, folder = exported
    common = (str(path), "--served-model-name", "tiny", "--num-blocks", "128", "--chat-template",
              str(folder / "chat.jinja"), "--kv-transfer-config")
    producer = RemoteServer(*common, _connector("kv_producer", kv_port=free_port(),
                                                kv_connector_extra_config={"hold_timeout_s": 2}),
                            log_path=folder / "producer.log")
    consumer = RemoteServer(*common, _connector("kv_consumer", kv_connector_extra_config={"transfer_timeout_s": 3}),
                            log_path=folder / "consumer.log")
    proxy = _Proxy(producer.url, consumer.url)
    try:
        with producer, consumer:
            yield proxy, producer, consumer
    finally:
        proxy.stop()
        for server in (producer, consumer):
            server.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=f"{servers[0].url}/v1", api_key="unused", max_retries=0, timeout=60)


def _alone(llm, prompt: list[int], sampling: dict) -> str:
    """The reference: ``prompt``'s text from the model in this process, alone."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].text


def test_disaggregated_answers_equal_one_process(exported, servers, client):
    llm, _, _ = exported
    proxy, producer, consumer = servers
    for prompt in PROMPTS:
        for sampling in SAMPLING:
            expected = _alone(llm, prompt, sampling)
            extra = {"ignore_eos": True, **({"top_p": sampling["top_p"]} if "top_p" in sampling else {})}
            kwargs = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=sampling["temperature"],
                          seed=sampling.get("seed"), extra_body=extra)
            whole = client.completions.create(**kwargs)
            assert whole.choices[0].text == expected and whole.usage.completion_tokens == MAX_TOKENS
            assert (whole.model_extra or {}).get("kv_transfer_params") is None  # the decoder's keeps none
            streamed = client.completions.create(**kwargs, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == expected, (len(prompt), sampling)
    # chat, through the template both servers were given
    tokenizer = llm.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me"}], chat_template=TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
    expected = _alone(llm, tokenizer(text, add_special_tokens=False).input_ids, SAMPLING[1])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me"}],
                                          max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=11,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == expected
    sent, received = idle_metrics(producer), idle_metrics(consumer)
    # the whole blocks before each prompt's last token moved (17: 1, 40: 2; once: repeats hit the decoder's
    # prefix cache), nothing failed or waits
    assert received["pagedpack:kv_transfer_blocks_total{direction=received}"] >= 3
    assert sent["pagedpack:kv_transfer_bytes_total{direction=sent}"] == \
        received["pagedpack:kv_transfer_bytes_total{direction=received}"] > 0
    assert sent["pagedpack:kv_transfer_failures_total{direction=sent}"] == 0
    assert received["pagedpack:kv_transfer_failures_total{direction=received}"] == 0
    assert received["pagedpack:kv_transfer_seconds_total{direction=received}"] > 0


def test_a_client_abort_aborts_on_both_sides(servers):
    proxy, producer, consumer = servers
    aborted = "pagedpack:request_success_total{finished_reason=abort}"
    before = server_metrics(consumer).get(aborted, 0)
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    idle_metrics(producer)
    assert idle_metrics(consumer).get(aborted, 0) == before + 1


def test_errors_keep_their_status_and_name_the_field(servers, exported, capsys):
    proxy, producer, consumer = servers
    bad = httpx.post(f"{proxy.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert httpx.post(f"{proxy.url}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    own = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": [1], "kv_transfer_params": {}})
    assert own.status_code == 400 and own.json()["error"]["param"] == "kv_transfer_params"
    pull = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x",
            "remote_num_tokens": 2}
    for server, params, error in [
        (consumer, {**pull, "remote_host": "10.1.2.3"}, "kv_transfer_params.remote_host: expected one of"),
        (consumer, {**pull, "remote_port": "1"}, "kv_transfer_params.remote_port: expected a int or null"),
        (consumer, {**pull, "remote_num_tokens": 3}, "kv_transfer_params.remote_num_tokens: expected the prompt's 2"),
        (consumer, {**pull, "bogus": 1}, "kv_transfer_params.bogus: expected one of the fields"),
        (consumer, {"do_remote_decode": True}, "do_remote_decode: this engine's kv_role is kv_consumer"),
        (producer, pull, "do_remote_prefill: this engine's kv_role is kv_producer"),
    ]:
        answer = httpx.post(f"{server.url}/v1/completions",
                            json={"prompt": [1, 2], "max_tokens": 2, "kv_transfer_params": params})
        assert answer.status_code == 400 and error in answer.json()["error"]["message"], answer.text
    # from an adversarial trial: n > 1 (best_of n) was taken with kv_transfer_params; one sequence's KV moves
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for server, params in ((consumer, pull), (producer, {"do_remote_decode": True})):
        for path, body, got in [("completions", {"prompt": [1, 2], "n": 2}, "n=2"),
                                ("completions", {"prompt": [1, 2], "n": 3, "best_of": 3}, "n=3"),
                                ("chat/completions", {**chat, "n": 2}, "n=2"),
                                ("completions", {"prompt": [[1, 2], [1, 2]]}, "got 2")]:
            answer = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2, "kv_transfer_params": params})
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == "kv_transfer_params", answer.text
            assert error["message"].startswith("kv_transfer_params: one sequence's KV") and got in error["message"]
    _, path, _ = exported
    code, _, err = run_cli(capsys, "serve", str(path), "--kv-transfer-config", _connector("kv_producer", kv_port=70000))
    assert code == 2 and "kv_transfer_config.kv_port: expected a port from 0 to 65535, got 70000" in err
    code, _, err = run_cli(capsys, "serve", str(path), "--kv-transfer-config", '{"kv_connector": "Nope"}')
    assert code == 2 and "kv_transfer_config.kv_connector: expected one of" in err and "P2pTcpConnector" in err
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.timeout_s: expected seconds in \(0, 1e6\)"):
        P2pTcpOptions.parse({"timeout_s": -1})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.hold_time_s: expected one of"):
        P2pTcpOptions.parse({"hold_time_s": 1})


def test_a_pull_that_fails_is_computed_again_not_answered_wrong(exported, servers):
    """A consumer whose pull fails (a request id the producer never had; a prompt of other tokens, here
    another ``cache_salt``; a copy pulled already) computes the prompt itself: the one process's answer."""
    llm, _, _ = exported
    proxy, producer, consumer = servers
    failures = "pagedpack:kv_transfer_failures_total{direction=received}"
    before = server_metrics(consumer)[failures]
    prompt = random_prompts((40,), seed=8)[0]
    params = httpx.post(f"{producer.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 1, "cache_salt": "a", "kv_transfer_params": {"do_remote_decode": True}}
    ).json()["kv_transfer_params"]
    for salt, sent in (("a", {**params, "remote_request_id": "cmpl-never-0"}), ("b", params), ("c", params)):
        answer = httpx.post(f"{consumer.url}/v1/completions", timeout=30, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt, "kv_transfer_params": sent}).json()  # a salt of its own: no prefix hit
        assert answer["choices"][0]["text"] == _alone(llm, prompt, SAMPLING[0]), salt
    assert idle_metrics(consumer)[failures] == before + 3


def test_producers_that_never_answer_delay_no_other_request_s_pull(exported, servers, client):
    """From an adversarial trial: requests naming a listener that accepts and never answers took the
    decode server's 4 pull threads (other requests' latency 0.21 s -> 19 s). Each pull now starts at once
    in a thread of its own and fails by ``transfer_timeout_s`` (3 s here): a request sent through the proxy
    after 6 stalled pulls started is answered before any of them, and they are computed by the decode
    server (the one process's answer)."""
    llm, _, _ = exported
    proxy, producer, consumer = servers
    failures = "pagedpack:kv_transfer_failures_total{direction=received}"
    before = server_metrics(consumer)[failures]
    stalled, fresh = random_prompts((40, 40), seed=21)
    hole = socket.create_server(("127.0.0.1", 0), backlog=16)  # accepts, never answers
    hole.settimeout(10)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": hole.getsockname()[1],
              "remote_num_tokens": len(stalled)}
    answered: dict[int, tuple[float, str]] = {}

    def ask(i: int) -> None:
        answer = httpx.post(f"{consumer.url}/v1/completions", timeout=30, json={
            "prompt": stalled, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": {**params, "remote_request_id": f"cmpl-hole-{i}"}})
        answered[i] = (time.monotonic(), answer.json()["choices"][0]["text"])

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    try:
        held = [hole.accept()[0] for _ in threads]  # every pull connected: none waits for another's slot
        good = client.completions.create(model="tiny", prompt=fresh, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
        good_at = time.monotonic()
        for thread in threads:
            thread.join(30)
    finally:
        hole.close()
    assert good.choices[0].text == _alone(llm, fresh, SAMPLING[0])
    assert sorted(answered) == list(range(6)) and all(at > good_at for at, _ in answered.values())
    assert {text for _, text in answered.values()} == {_alone(llm, stalled, SAMPLING[0])}
    assert idle_metrics(consumer)[failures] == before + 6
    for conn in held:
        conn.close()


def test_a_consumer_that_dies_mid_transfer_costs_the_producer_nothing(servers, client):
    proxy, producer, consumer = servers
    failures = "pagedpack:kv_transfer_failures_total{direction=sent}"
    before = server_metrics(producer)[failures]
    # a consumer that takes the header and goes away mid-payload
    prefilled = httpx.post(f"{producer.url}/v1/completions", timeout=30, json={
        "prompt": PROMPTS[3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = prefilled["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(PROMPTS[3])
    with socket.create_connection((params["remote_host"], params["remote_port"]), timeout=10) as conn:
        pull = _encoder.encode(Pull(params["remote_request_id"], 0, 2))
        conn.sendall(struct.pack(">4sI", b"PPKV", len(pull)) + pull)
        assert conn.recv(64)
    # the real consumer killed while it streams: the proxy's client gets an error, not a hang
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices
    consumer.process.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="decode server .* (ended the stream|failed mid-stream)"):
        for _ in stream:
            pass
    with pytest.raises(openai.InternalServerError, match="could not be reached"):  # 502 naming it
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2)
    settled = idle_metrics(producer)
    assert settled[failures] == before + 1
    later = httpx.post(f"{producer.url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 3,
                                                               "ignore_eos": True}, timeout=30)
    assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 3


def test_the_proxy_answers_for_servers_it_cannot_reach_and_bodies_it_will_not_read(capsys):
    proxy = _Proxy(f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}", max_body_bytes=1000)
    try:
        _started(proxy)
        assert httpx.get(f"{proxy.url}/health").status_code == 503  # neither server is there
        declared = httpx.post(f"{proxy.url}/v1/completions", content=b"x" * 1001)
        streamed = httpx.post(f"{proxy.url}/v1/completions", content=iter([b"y" * 600, b"y" * 600]))
        assert declared.status_code == streamed.status_code == 413
        assert "more than the 1000 bytes" in declared.json()["error"]["message"]
        assert "expected a JSON object" in httpx.post(f"{proxy.url}/v1/completions", content=b"[1]").text
        gone = httpx.post(f"{proxy.url}/v1/chat/completions", json={"messages": []})
        assert gone.status_code == 502 and "could not be reached" in gone.json()["error"]["message"]
    finally:
        proxy.stop()
    code, _, err = run_cli(capsys, "disagg-proxy", "--prefill", "127.0.0.1:8100", "--decode", "http://127.0.0.1:8200")
    assert code == 2 and "--prefill: expected an http:// or https:// URL, got '127.0.0.1:8100'" in err



class _StalledServer:
    """A "prefill server" that reads each HTTP request and never answers; ``closed`` is set when the
    proxy closes a connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn):
        with conn:
            while conn.recv(65536):  # the request, then nothing until the proxy hangs up
                pass
            self.closed.set()


def test_a_stalled_prefill_server_is_a_504_and_its_request_is_aborted(capsys):
    """From an adversarial trial: the proxy waited for a stalled prefill server as long as the client did.
    Past --prefill-timeout the client gets a 504 with OpenAI's error body, the prefill request's
    connection is closed (what aborts it on a pagedpack server), and the proxy serves on."""
    stalled = _StalledServer()
    proxy = _Proxy(stalled.url, f"http://127.0.0.1:{free_port()}", proxy_options={"prefill_timeout_s": 0.5})
    try:
        _started(proxy)
        for _ in range(2):  # the proxy is not wedged by the first
            stalled.closed.clear()
            start = time.monotonic()
            answer = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
            assert 0.5 <= time.monotonic() - start < 5
            assert answer.status_code == 504 and answer.json() == {"error": {
                "message": f"the prefill server at {stalled.url} did not answer /v1/completions within 0.5 s "
                           "(--prefill-timeout); the request there was aborted",
                "type": "InternalServerError", "param": None, "code": 504}}
            assert stalled.closed.wait(5)
        assert httpx.get(f"{proxy.url}/v1/models", timeout=30).status_code == 502  # others still answered
    finally:
        proxy.stop()
        stalled.sock.close()
    code, _, err = run_cli(capsys, "disagg-proxy", "--prefill", stalled.url, "--decode", stalled.url,
                           "--prefill-timeout", "nan")
    assert code == 2 and "--prefill-timeout: expected seconds > 0, got nan" in err
