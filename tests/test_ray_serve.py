"""``pagedpack serve`` on Ray Serve (``pagedpack.serve.ray_app``): two replicas of the built-in tiny
model behind the prefix-aware router, on the session's local Ray cluster, talked to with the
official ``openai`` client through Ray Serve's HTTP proxy. References: the single engine's greedy
answer (``LLM.generate``, one prompt at a time); the replicas' own prefix-cache counters."""
import asyncio
import sys
import threading
import time

import httpx
import openai
import pytest

from pagedpack import LLM, SamplingParams
from pagedpack.engine_args import EngineArgs
from pagedpack.host.child_process import free_port
from pagedpack.runtime.block_hash import extend_block_hashes
from pagedpack.serve.openai_serving import ServingConfig

from conftest import random_prompts

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from pagedpack.serve.ray_app import APP_NAME, RayServeOptions, engine_replicas, pagedpack_app, prefix_cache_counters  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"
BLOCK_SIZE = 16
MAX_TOKENS = 400  # a stream's tokens in the kill test: still running when the replica dies, on a loaded host too
# (160 once all ended before the last stream's first chunk came; prompts of 20-40 tokens + 400 < the 512 positions)


@pytest.fixture(scope="module")
def app(ray_cluster):
    """The application (2 replicas, half a CPU each, this venv's Python) on a free port; the
    single-engine reference built meanwhile. Yields (base url, reference LLM)."""
    reference = {}
    built = threading.Thread(target=lambda: reference.setdefault("llm", LLM("tiny", num_blocks=64)))
    built.start()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = RayServeOptions(data_parallel_size=2, num_cpus=0.5, routing_stats_period_s=0.5,
                              runtime_env={"py_executable": sys.executable})
    application = pagedpack_app(EngineArgs(model="tiny", num_blocks=256, block_size=BLOCK_SIZE),
                                ServingConfig("tiny", chat_template=TEMPLATE), options)
    try:
        serve.run(application, name=APP_NAME, route_prefix="/")
        built.join()
        yield f"http://127.0.0.1:{port}", reference["llm"]
    finally:  # the application's replicas go; Serve's controller and proxy end with the session's cluster
        serve.delete(APP_NAME)


def _client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60, **kwargs)


def _greedy(llm, prompt, max_tokens: int, *, ignore_eos: bool = False) -> str:
    """The single engine's greedy answer to ``prompt`` alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return llm.generate([prompt], params)[0].outputs[0].text


def test_answers_equal_single_engine(app):
    url, llm = app
    client = _client(url)
    tokenizer = llm.tokenizer
    for prompt in ["The capital of France is", "def f(x):"]:
        expected = _greedy(llm, tokenizer(prompt).input_ids, 8)
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert whole.choices[0].text == expected
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    messages = [{"role": "user", "content": "Hello there"}]
    rendered = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    expected = _greedy(llm, tokenizer(rendered, add_special_tokens=False).input_ids, 8)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == expected
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    # the single server's error bodies: a field the engine refuses, a model not served
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=8, top_p=2.0)
    assert bad.value.body["param"] == "top_p" and "top_p" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:  # no block hash for it: routed without, refused by a replica
        client.completions.create(model="tiny", prompt=[2**70], max_tokens=1)
    assert bad.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert missing.value.body["param"] == "model"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 404  # each replica keeps its own


def test_app_builder_arguments():
    """``build_app`` (Ray Serve's application builder) takes the command line's strings and a config
    file's values; an unknown or malformed argument is refused by name."""
    from pagedpack.serve.ray_app import build_app

    assert build_app({"model": "tiny", "data_parallel_size": "2", "engine_args": '{"num_blocks": 64}'}) is not None
    assert build_app({"model": "tiny", "data_parallel_size": 2, "engine_args": {"num_blocks": 64}}) is not None
    assert build_app({"model": "tiny", "num_cpus": 1, "routing_stats_period_s": 2}) is not None  # YAML's whole numbers
    for args, name in [({"data_parallel_size": "2"}, "model"), ({"model": "tiny", "replicas": "2"}, "replicas"),
                       ({"model": "tiny", "data_parallel_size": "two"}, "data_parallel_size"),
                       ({"model": "tiny", "data_parallel_size": "0"}, "data_parallel_size"),
                       ({"model": "tiny", "request_router": "random"}, "request_router"),
                       ({"model": "tiny", "num_cpus": True}, "num_cpus"),
                       ({"model": "tiny", "engine_args": "[1]"}, "engine_args")]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            build_app(args)


def test_prefix_aware_routing_hits_the_cache(app):
    """8 shared prefixes (6 blocks each) x 8 requests, interleaved: each prefix's blocks are
    computed once, on one replica, and found there by the 7 later requests."""
    url, _ = app
    client = _client(url)
    prefixes = random_prompts([6 * BLOCK_SIZE] * 8, seed=11, vocab=200)
    queries, hits = prefix_cache_counters()
    for i in range(8):
        for j, prefix in enumerate(prefixes):
            client.completions.create(model="tiny", prompt=prefix + [200 + i, 210 + j], max_tokens=1)
    queries2, hits2 = prefix_cache_counters()
    hit_rate = (hits2 - hits) / (queries2 - queries)
    assert queries2 - queries == 64 * (6 * BLOCK_SIZE + 2)
    assert hit_rate >= 0.8, hit_rate


def test_replica_killed_in_flight(app):
    """A replica killed while a stream it runs has sent its first chunk, others arriving: that stream
    ends with OpenAI's error body, the rest complete as the single engine answers them alone (on the
    other replica, or retried there when the dead one had sent them nothing); later requests
    are all answered; Serve starts a replica in the dead one's place."""
    url, llm = app
    prompts = random_prompts([20, 24, 28, 32, 36, 40], seed=3, vocab=250)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    streaming = []

    async def one(prompt):
        text = []
        try:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                text.append(chunk.choices[0].text if chunk.choices else "")
                if len(text) == 1:
                    streaming.append(prompt)
        except openai.APIError as err:
            return err
        return "".join(text)

    before = engine_replicas()

    async def run():
        # the first stream alone until its first chunk: the one replica then running a request is its
        # (when every stream's first chunk was awaited, on a loaded host the first streams had ended)
        tasks = [asyncio.ensure_future(one(prompts[0]))]
        deadline = time.monotonic() + 60
        while not streaming and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # awaited, not ray.get: the stream keeps being read meanwhile
        running = {}
        while not any(running.values()) and time.monotonic() < deadline:
            running = {name: (await replica.record_routing_stats.remote())["num_running"]
                       for name, replica in before.items()}
        tasks += [asyncio.ensure_future(one(p)) for p in prompts[1:]]  # sent as it dies: routed past it, or retried
        ray.kill(before[max(running, key=running.get)], no_restart=True)
        return running, await asyncio.wait_for(asyncio.gather(*tasks), 120)

    running, results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, openai.APIError)]
    assert failed and len(failed) < len(results), (running, [type(r).__name__ for r in results])
    for got, prompt in zip(results, prompts):
        if isinstance(got, openai.APIError):
            assert "replica" in got.message, got
        else:
            assert got == _greedy(llm, prompt, MAX_TOKENS, ignore_eos=True)
    sync = _client(url)  # later requests are all answered (the router dropped the dead replica)
    for prompt in prompts[:3]:
        answer = sync.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert answer.choices[0].text == _greedy(llm, prompt, 16, ignore_eos=True)
    deadline = time.monotonic() + 30  # Serve starts a replica in the dead one's place
    while time.monotonic() < deadline and not set(engine_replicas()) - set(before):
        time.sleep(0.5)
    assert len(set(engine_replicas()) - set(before)) == 1 and len(engine_replicas()) == 2


def test_router_ranks_longest_cached_prefix():
    """PrefixAwareRouter.choose_replicas on stand-in replicas: the longest reported prefix first;
    no hit: every replica in one rank (the least loaded is then Ray's pick)."""
    from types import SimpleNamespace

    from pagedpack.serve.prefix_router import PrefixAwareRouter

    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(64)), BLOCK_SIZE)
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=name, routing_stats={"block_hashes": cached})
                for name, cached in (("a", hashes[:1]), ("b", hashes[:3]), ("c", hashes[1:]))]
    request = SimpleNamespace(kwargs={"block_hashes": hashes})
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["b"], ["a", "c"]]
    other: list[bytes] = []
    extend_block_hashes(other, list(range(64)), BLOCK_SIZE, ("salt",))  # another chain: no hit
    ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(kwargs={"block_hashes": other})))
    assert [sorted(r.replica_id for r in rank) for rank in ranks] == [["a", "b", "c"]]
