"""LoRA adapters in ``pagedpack serve``, as a client of vLLM's OpenAI server sees them: one live
server (the built-in tiny model, ``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``)
serving adapters that peft made here (random weights, ``init_lora_weights=False``; different ranks
and target modules), talked to with the official ``openai`` client and raw HTTP. Reference: the
same model and adapters run offline in this process, ``LLM.generate(..., lora_request=...)``."""
import asyncio
import shutil
import socket
import sys
import types

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from peft import LoraConfig, get_peft_model

from pagedpack import LLM, SamplingParams
from pagedpack.models.tiny import default_model
from pagedpack.runtime.lora import LoRARequest
from pagedpack.serve.app import build_app
from pagedpack.serve.remote import RemoteServer, pagedpack_serve_command

from conftest import random_prompts, run_cli, server_metrics

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"
PROMPTS = random_prompts((5, 13, 30, 3), seed=11)
MAX_TOKENS = 8
# name -> (seed, LoraConfig fields); "broken" is loaded at start, dropped from host memory (--max-cpu-loras 2)
# and then damaged: a request for it must fail alone; "C" is loaded at run time
ADAPTERS = {"broken": (3, dict(r=2, lora_alpha=4, target_modules=["k_proj"])),
            "A": (1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
            "B": (2, dict(r=8, lora_alpha=32, target_modules=["o_proj", "gate_proj", "down_proj"])),
            "C": (4, dict(r=6, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"]))}
LORA = ("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The ``--lora-root`` holding one PEFT directory per adapter of :data:`ADAPTERS`."""
    folder = tmp_path_factory.mktemp("adapters")
    for name, (seed, config) in ADAPTERS.items():
        torch.manual_seed(seed)
        get_peft_model(default_model()[0], LoraConfig(init_lora_weights=False, **config)).save_pretrained(folder / name)
    return folder


@pytest.fixture(scope="module")
def reference(root):
    """``reference(model, prompt ids)``: the greedy text of ``LLM.generate`` with that adapter (or the base)."""
    llm = LLM("tiny", enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=8, num_blocks=64)
    loras = {name: LoRARequest(name, i, str(root / name)) for i, name in enumerate(ADAPTERS, start=1)}
    cache = {}

    def text(model: str, prompt: list[int]) -> str:
        if (model, tuple(prompt)) not in cache:
            out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                               lora_request=loras.get(model), use_tqdm=False)[0]
            cache[model, tuple(prompt)] = out.outputs[0].text
        return cache[model, tuple(prompt)]

    return text


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "chat.jinja").write_text(TEMPLATE)
    b = '{"name": "B", "path": "%s", "base_model_name": "tiny-base"}' % (root / "B")
    args = ("tiny", *LORA, "--lora-modules", f"broken={root / 'broken'}", f"A={root / 'A'}", "--lora-modules", b,
            "--lora-root", str(root), "--chat-template", str(folder / "chat.jinja"), "--num-blocks", "256")
    with RemoteServer(lambda port: pagedpack_serve_command(*args, port=port), log_path=folder / "server.log",
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as remote:
        yield remote
    assert "Traceback" not in remote.log, remote.log[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _chat_ids(content: str) -> list[int]:
    tokenizer = default_model()[1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_models_lists_the_base_model_and_each_adapter(client, root):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "broken", "A", "B"]
    assert (cards["A"].root, cards["A"].parent) == (str(root / "A"), "tiny")
    assert (cards["B"].root, cards["B"].parent) == (str(root / "B"), "tiny-base")


def test_adapters_and_the_base_interleaved_concurrently_equal_offline_generate(server, reference):
    async def completion(client, model, prompt, stream):
        if stream:
            chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
            return model, prompt, ["".join([c.choices[0].text async for c in chunks])]
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2)
        assert out.model == model
        return model, prompt, [c.text for c in out.choices]

    async def chat(client, model, stream):
        messages = [{"role": "user", "content": f"Hello {model}"}]
        if stream:
            chunks = await client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                          temperature=0, stream=True)
            return model, _chat_ids(messages[0]["content"]), ["".join(
                [c.choices[0].delta.content or "" async for c in chunks if c.choices])]
        out = await client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                   temperature=0)
        return model, _chat_ids(messages[0]["content"]), [out.choices[0].message.content]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        jobs = [completion(client, model, prompt, stream=(i + j) % 2 == 1)
                for i, prompt in enumerate(PROMPTS) for j, model in enumerate(("A", "B", "tiny"))]
        jobs += [chat(client, model, stream=j == 1) for j, model in enumerate(("A", "B", "tiny"))]
        return await asyncio.gather(*jobs)

    for model, prompt, texts in asyncio.run(run()):
        assert texts == [reference(model, prompt)] * len(texts), (model, prompt)
    assert any(reference("A", p) != reference("tiny", p) for p in PROMPTS)  # the adapter does something
    assert any(reference("B", p) != reference("A", p) for p in PROMPTS)


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)


def test_adapters_load_and_unload_at_run_time_from_inside_the_lora_root_only(server, client, root, reference,
                                                                             tmp_path):
    def post(route, body):
        return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)

    loaded = post("load_lora_adapter", {"lora_name": "R", "lora_path": "C"})  # relative to --lora-root
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'R' added successfully.")
    assert [m.id for m in client.models.list().data][-1] == "R"
    out = client.completions.create(model="R", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == reference("C", PROMPTS[1])

    shutil.copytree(root / "C", tmp_path / "outside")  # an adapter outside the root, links to it inside
    (root / "link").symlink_to(tmp_path / "outside")
    (root / "sneaky").mkdir()
    for file in (tmp_path / "outside").iterdir():
        (root / "sneaky" / file.name).symlink_to(file)
    refused = {"R": "C", "tiny": "C", "X1": str(tmp_path / "outside"), "X2": "../" + tmp_path.name, "X3": "link",
               "X4": "/etc", "X5": "missing", "bad\x01name": "C", "X6": "A/adapter_config.json",
               "X7": "sneaky"}
    for name, path in refused.items():
        answer = post("load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert answer.status_code == 400, (name, answer.text)
        assert answer.json()["error"]["param"] in ("lora_name", "lora_path"), answer.json()
    assert "already been loaded" in post("load_lora_adapter", {"lora_name": "R", "lora_path": "C"}).text
    assert "inside --lora-root" in post("load_lora_adapter", {"lora_name": "X", "lora_path": "/etc"}).text

    removed = post("unload_lora_adapter", {"lora_name": "R"})
    assert (removed.status_code, removed.text) == (200, "Success: LoRA adapter 'R' removed successfully.")
    assert post("unload_lora_adapter", {"lora_name": "R"}).status_code == 404
    assert post("unload_lora_adapter", {}).status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="R", prompt="Hi", max_tokens=2)


def test_an_adapter_that_cannot_be_loaded_fails_its_requests_alone(server, root, reference):
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"not an adapter any more")

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)

        async def one(model, prompt):
            try:
                out = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            except openai.InternalServerError as err:
                return err
            return out.choices[0].text

        return await asyncio.gather(*(one(model, p) for p in PROMPTS[:2] for model in ("broken", "A", "tiny")))

    answers = asyncio.run(run())
    for (model, prompt), answer in zip([(m, p) for p in PROMPTS[:2] for m in ("broken", "A", "tiny")], answers):
        if model == "broken":
            assert isinstance(answer, openai.InternalServerError) and "`broken` cannot be loaded" in answer.message
        else:
            assert answer == reference(model, prompt)
    # unloaded by its id, as vLLM's unload_lora_adapter takes it
    removed = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_int_id": 1}, timeout=60)
    assert removed.text == "Success: LoRA adapter 'broken' removed successfully."


def test_metrics_show_the_adapters_requests(server, client):
    counted = server_metrics(server)
    assert counted["pagedpack:lora_requests_total{lora_name=A}"] >= len(PROMPTS) * 1.5  # n = 2 every other one
    assert counted["pagedpack:lora_requests_total{lora_name=R}"] == 1
    assert 1 <= counted["pagedpack:lora_adapters_loaded{}"] <= 2  # --max-cpu-loras
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": "B", "prompt": "Hello", "max_tokens": 300, "ignore_eos": True,
                            "stream": True}) as response:
        events = (line for line in response.iter_lines() if line)
        for _ in range(10):  # read as it runs (a stream not read is paused: flow control)
            assert next(events).startswith("data: ")
        info = [k for k in server_metrics(server) if k.startswith("pagedpack:lora_requests_info")]
    assert info == ["pagedpack:lora_requests_info{max_lora=2,running_lora_adapters=B,waiting_lora_adapters=}"], info


def test_the_runtime_routes_are_absent_without_the_environment_variable():
    app = build_app(types.SimpleNamespace(max_chat_body_bytes=2**20))  # what build_app reads of its serving
    with TestClient(app) as http:
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "a"}).status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_lora_flags_are_checked_before_the_port_is_bound(capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", "tiny", "--lora-modules", f"a={tmp_path}")
    assert code == 2 and "--enable-lora" in err
    code, _, err = run_cli(capsys, "serve", "tiny", "--enable-lora", "--lora-modules", "a")
    assert code == 2 and "--lora-modules: expected name=path" in err
    code, _, err = run_cli(capsys, "serve", "tiny", "--enable-lora", "--lora-modules", "a=x", "b=y", "a=z")
    assert code == 2 and "given twice" in err
    switch, taken = sys.getswitchinterval(), socket.create_server(("127.0.0.1", 0))
    try:  # an empty directory: the error names the entry and the file (the port is taken: never served)
        code, _, err = run_cli(capsys, "serve", "tiny", *LORA, "--port", str(taken.getsockname()[1]),
                               "--lora-modules", f"empty={tmp_path}")
    finally:
        sys.setswitchinterval(switch)
        taken.close()
    assert code == 2 and f"--lora-modules empty={tmp_path}" in err and "adapter_config.json" in err, err
