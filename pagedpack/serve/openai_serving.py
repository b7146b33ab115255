"""The OpenAI endpoints' work: a request body in, the engine's deltas out as OpenAI responses
(``text_completion`` / ``chat.completion`` objects, or server-sent events of their chunks).

Every prompt is tokenized and checked (and every request added to the engine) before the first
byte goes out, so a bad request gets its 400 and never a half-sent stream. Each engine request's
id is ``<response id>-<prompt index>``; whatever ends a response (finished, client gone, error)
aborts the engine requests still live, freeing their KV blocks before the next step.

What reaches the tokenizer is counted first: a completion's text prompts; a chat's every string of
every message (role, name, content, any extra field, nested keys too; any other value counts as at
least one character), its ``chat_template_kwargs``, its ``tools`` and its own ``chat_template``, each refused (400
naming the field) past the characters the context can hold (``max_text_chars``), and then the
rendered text again, before it is tokenized. Rendering and tokenizing run in
``TOKENIZER_THREADS`` threads of their own, never the event loop's; when ``max_tokenize_queue``
requests are in or waiting for them, a new one gets 503 with ``Retry-After``.

A failure that is no request's fault (a bug, the engine's step failing) answers 500 with a generic
message and a short error id, its traceback logged (``pagedpack.serve``) with that id; an error the
engine gives one request (``RequestOutput.error``, written for users) is passed on, as 500 (the
request had been checked and taken: the server failed to serve it).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagedpack.async_llm import AsyncLLM
from pagedpack.chat import render_text
from pagedpack.inputs import Prompt
from pagedpack.runtime.engine import RequestRejected
from pagedpack.runtime.engine_loop import EngineDeadError
from pagedpack.runtime.lora import LoRARequest
from pagedpack.runtime.outputs import CompletionOutput, RequestOutput, merge
from pagedpack.serve.metrics import ServerMetrics
from pagedpack.serve.models import LoRAModulePath, ServingModels, lora_requests
from pagedpack.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from pagedpack.serve.tool_parsers import PARSERS, ToolParser
from pagedpack.serve.tools import ToolCalling, template_messages, template_tools

log = logging.getLogger("pagedpack.serve")
TOKENIZER_THREADS = 2  # rendering and tokenizing (encoding holds the engine's tokenizer lock)


class ServingError(Exception):
    """An error to answer with: HTTP ``status``, OpenAI's error ``type``, the ``param`` it is about."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.headers = status, param, headers

    @property
    def type(self) -> str:
        named = {401: "AuthenticationError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
        return named.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}

    @classmethod
    def bad_request(cls, err: ValueError) -> "ServingError":
        """A 400 from a ``ValueError`` whose message starts with the field's name (``"top_p: ..."``;
        ``param`` the body's field of a path: ``"tools"`` for ``"tools.0.function.name: ..."``,
        ``"structured_outputs"`` for ``"structured_outputs.regex: ..."``)."""
        message = str(err)
        field = message.split(":", 1)[0].split(".", 1)[0] if ":" in message else None
        return cls(400, message, param=field if field and field.isidentifier() else None)

    @classmethod
    def internal(cls, err: BaseException) -> "ServingError":
        """A 500 for a failure that is no request's fault: the client gets an error id, the log
        (``pagedpack.serve``) the traceback with that id."""
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s", error_id, exc_info=err)
        return cls(500, f"internal server error (error id {error_id}; the server's log has its details)")


@dataclass(frozen=True)
class ServingConfig:
    """What the endpoints need besides the engine: the name clients use, the chat template
    (None: the tokenizer's), whether a request may bring its own template, how many requests
    may wait for their first step, and how many may be in or wait for the tokenizer's threads,
    before new ones are refused (503); tool calling (vLLM's flags, :mod:`pagedpack.serve.tools`):
    whether ``tool_choice: "auto"`` is served, by which parser, and whether ``tool_choice:
    "none"`` leaves the tools out of the prompt; LoRA adapters (:mod:`pagedpack.serve.models`): those
    served from the start (``--lora-modules``) and the directory runtime ones may be read from
    (``--lora-root``)."""

    model_name: str
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_queue: int = 1024
    max_tokenize_queue: int = 256
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    lora_modules: tuple[LoRAModulePath, ...] = ()
    lora_root: str | None = None

    def __post_init__(self) -> None:
        lora_requests(self.lora_modules, self.model_name)  # the names, before the model is loaded
        if self.lora_root is not None and not os.path.isdir(self.lora_root):
            raise ValueError(f"--lora-root: expected a directory, got {self.lora_root!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser: expected one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:  # vLLM's rule
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser (the format the model writes "
                             f"its calls in: {', '.join(PARSERS)})")
        try:  # every response and /metrics carries it: a name that cannot be encoded would fail them all
            self.model_name.encode()
        except UnicodeEncodeError:
            raise ValueError(f"--served-model-name: expected a name encodable as UTF-8, got {self.model_name!r} "
                             "(a model path's undecodable bytes: pass --served-model-name NAME)") from None


class OpenAIServing:
    """``completions(body)`` / ``chat(body)`` -> a response body (dict) or an async iterator of
    server-sent events (str), for one :class:`~pagedpack.async_llm.AsyncLLM`; the models it answers
    to are ``models``, the ``--lora-modules`` adapters loaded when it is made (a bad one raises
    ``ValueError`` naming the entry, the file and the field)."""

    def __init__(self, engine: AsyncLLM, config: ServingConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.llm = engine.llm
        # the context a request may use: the model's, unless the KV pool holds fewer tokens (a request
        # larger than the pool could never run; vLLM refuses to start then, this server serves less)
        self.max_model_len = min(self.llm.max_model_len, self.llm.num_blocks * self.llm.block_size)
        tokenizer = self.llm.tokenizer
        # text longer than this can never fit the context (a token is at most the longest vocabulary
        # entry long): refused before it is tokenized, which could take the CPU for seconds
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.max_text_chars = self.max_model_len * max(1, max(map(len, vocab), default=1))
        # a chat body larger than this holds more than a request could use: what the template reads
        # (messages, chat_template_kwargs, chat_template, tools) at 12 bytes of JSON a character (an escaped
        # surrogate pair), 32 bytes per vocabulary token (logit_bias and stop_token_ids may name each)
        # and 1 MiB for the rest; refused before it is read (parsing 30 MB holds the event loop ~0.1 s)
        self.max_chat_body_bytes = 12 * 4 * self.max_text_chars + 32 * len(vocab) + 2**20
        self._tokenizer_threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagedpack-tokenize")
        self._tokenize_slots = threading.BoundedSemaphore(config.max_tokenize_queue)
        self.models = ServingModels(config.model_name, config.lora_modules, config.lora_root)
        self.models.load_static(self.llm.llm_engine.add_lora)

    # -- the two endpoints ---------------------------------------------------------------------
    async def completions(self, body: CompletionRequest):
        lora = self._lora_request(body.model)
        _checked(body.check_unsupported)
        texts = _checked(body.prompts)
        self._check_length("prompt", sum(len(p) for p in texts if isinstance(p, str)))
        if any(isinstance(p, str) for p in texts):
            if self.llm.tokenizer is None:
                raise ServingError(400, "prompt: the model has no tokenizer; send token ids", param="prompt")
            prompts = await self._tokenizing(lambda: [self._prompt(p, body.cache_salt) for p in texts])
        else:  # token ids: nothing to tokenize
            prompts = [Prompt(p, body.cache_salt) for p in texts]
        return await self._respond(body, prompts, f"cmpl-{uuid.uuid4().hex}", logprobs=body.logprobs, chat=False,
                                   lora=lora)

    async def chat(self, body: ChatCompletionRequest):
        lora = self._lora_request(body.model)
        _checked(body.check_unsupported)
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise ServingError(400, "chat_template: a template in the request is refused (the server was not "
                                    "started with --trust-request-chat-template)", param="chat_template")
        kwargs = body.chat_template_kwargs or {}
        taken = set(kwargs) & _APPLY_CHAT_TEMPLATE_ARGS
        if taken:
            raise ServingError(400, f"chat_template_kwargs: {sorted(taken)} are arguments of apply_chat_template, "
                                    "not template variables", param="chat_template_kwargs")
        in_strings = "at least {} characters in its strings"  # what _num_chars counted
        self._check_length("messages", _num_chars([m.model_dump(exclude_none=True) for m in body.messages],
                                                  self.max_text_chars), in_strings)
        self._check_length("chat_template_kwargs", _num_chars(kwargs, self.max_text_chars), in_strings)
        self._check_length("chat_template", len(body.chat_template or ""))
        self._check_length("tools", _num_chars([t.model_dump(exclude_none=True) for t in body.tools or ()],
                                               self.max_text_chars), in_strings)
        tools = _checked(lambda: ToolCalling.for_request(body, tool_call_parser=self.config.tool_call_parser
                                                         if self.config.enable_auto_tool_choice else None))

        def tokenized() -> Prompt:
            text = _tokenized("messages", lambda: chat_text(self.llm.tokenizer, body, self.config))
            self._check_length("messages", len(text), "the chat template renders {} characters")
            return self._prompt(text, body.cache_salt, special=False)  # the template wrote them

        prompt = await self._tokenizing(tokenized)
        return await self._respond(body, [prompt], f"chatcmpl-{uuid.uuid4().hex}", logprobs=body.requested_logprobs,
                                   chat=True, tools=tools, lora=lora)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """vLLM's ``/v1/load_lora_adapter``: checked and loaded in the tokenizer's threads (it reads files)."""
        await self._tokenizing(lambda: _served(lambda: self.models.load(body.lora_name, body.lora_path,
                                                                        self.llm.llm_engine.add_lora), "lora_name"))
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """vLLM's ``/v1/unload_lora_adapter``: the engine lets the adapter go (its running requests hold it)."""
        removed = _served(lambda: self.models.unload(body.lora_name, body.lora_int_id), "lora_name")
        self.llm.llm_engine.remove_lora(removed.lora_int_id)
        return f"Success: LoRA adapter '{removed.lora_name}' removed successfully."

    @property
    def healthy(self) -> bool:
        """False once the engine loop has died (``/health`` then answers 503)."""
        return self.llm._loop.error is None

    # -- shared ---------------------------------------------------------------------------------
    async def _respond(self, body, prompts: list[Prompt], response_id: str, *, logprobs: int | None, chat: bool,
                       tools: ToolCalling | None = None, lora: LoRARequest | None = None):
        """The answer's coroutine (a whole body) or async generator (a stream), the requests added
        (with ``lora``'s adapter)."""
        max_tokens = body.requested_max_tokens if chat else body.max_tokens
        if body.kv_transfer_params is not None and len(prompts) > 1:  # n > 1: the KV connector refuses it
            raise ServingError(400, f"kv_transfer_params: one sequence's KV moves at a time; expected one prompt "
                                    f"with kv_transfer_params, got {len(prompts)}", param="kv_transfer_params")
        constraint = tools.structured_outputs if tools is not None else None
        params = [self._params(body, prompt, max_tokens, logprobs, constraint) for prompt in prompts]
        demand, max_queue = len(prompts) * body.n, self.config.max_queue
        if demand > max_queue:  # could never be taken: not a retry
            name = "n" if body.n > 1 else ("messages" if chat else "prompt")
            raise ServingError(400, f"{name}: this request asks for {demand} completions, more than the "
                                    f"{max_queue} that may wait at once (--max-queue)", param=name)
        waiting = self.engine.llm._loop.num_waiting
        if waiting + demand > max_queue:
            raise ServingError(503, f"the server is busy: {waiting} requests wait to be scheduled (--max-queue "
                                    f"{self.config.max_queue}); retry later", headers={"Retry-After": "1"})
        if params[0].structured_outputs is not None:  # one constraint for the body's prompts
            await self._compiled(body, params[0].structured_outputs, from_tools=constraint is not None)
        if lora is not None:
            await self._loaded(lora)
        ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        timers = [self.metrics.request(p.n) for p in params]  # arrival: now
        streams = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                streams.append(self.engine.add_request(prompt, p, request_id, lora_request=lora))
        except BaseException as err:
            self._abort(ids)
            if isinstance(err, RequestRejected):  # a prompt that can never run (too long, ids outside the vocabulary)
                raise ServingError(400, str(err), param="messages" if chat else "prompt") from err
            if isinstance(err, ValueError):  # a schema, regex or grammar xgrammar refuses, ...
                raise ServingError.bad_request(body.renamed(err)) from err
            if isinstance(err, EngineDeadError):
                raise ServingError(503, str(err)) from err
            raise
        if lora is not None:
            self.metrics.adapter_requests(lora.lora_name, demand)
        response = _Response(response_id, lora.lora_name if lora else self.config.model_name, body.n, chat, logprobs,
                             body.return_tokens_as_token_ids, tools)
        deltas = _observed(_merged(streams), timers)
        if body.stream:
            return self._events(response, deltas, ids, body)
        return self._whole(response, deltas, ids, len(prompts))

    async def _compiled(self, body, constraint, *, from_tools: bool) -> None:
        """``constraint`` compiled into the engine's grammar cache in the tokenizer's threads (a large
        schema takes seconds, and the first one imports xgrammar: the event loop answers others
        meanwhile), so that adding the request finds it there; a 400 naming the field if xgrammar
        refuses it (``tools`` for the constraint a required or named ``tool_choice`` made of them)."""
        try:
            await self._tokenizing(lambda: self.llm.llm_engine.structured_outputs.compile(constraint))
        except ValueError as err:
            why = str(err).partition(": ")[2]
            raise ServingError.bad_request(ValueError(f"tools: the tool_choice's parameters schema: {why}")
                                           if from_tools else body.renamed(err)) from err

    def _params(self, body, prompt: Prompt, max_tokens: int | None, logprobs: int | None, structured_outputs=None):
        num_prompt = len(prompt.content)
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(1, self.max_model_len - num_prompt)
        elif isinstance(max_tokens, int) and max_tokens >= 1 and num_prompt <= self.max_model_len < \
                num_prompt + max_tokens:  # (a prompt too long alone is refused naming the prompt)
            name = "max_tokens" if not isinstance(body, ChatCompletionRequest) or body.max_tokens is not None \
                else "max_completion_tokens"
            raise ServingError(400, f"{name}: this model's maximum context length is {self.max_model_len} tokens; "
                                    f"the prompt has {num_prompt} and {max_tokens} more were requested",
                               param=name)
        return _checked(lambda: body.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                                     structured_outputs=structured_outputs))

    def _prompt(self, prompt: str | list[int], cache_salt: str | None, *, special: bool = True) -> Prompt:
        """Token ids, so the prompt's length is known before it is added (text tokenized here, with
        the tokenizer's special tokens unless ``special`` is False: call it in the tokenizer's
        threads, :meth:`_tokenizing`)."""
        engine, tokenizer = self.llm.llm_engine, self.llm.tokenizer
        if isinstance(prompt, str):  # a model without a tokenizer takes token ids only (refused before)
            with engine.tokenizer_lock:
                prompt = _tokenized("prompt", lambda: tokenizer(prompt, add_special_tokens=special).input_ids)
        return Prompt(prompt, cache_salt)

    async def _tokenizing(self, work):
        """``work()`` in the tokenizer's threads (the event loop answers others meanwhile); 503
        with ``Retry-After`` when ``max_tokenize_queue`` requests are already in or waiting for them.
        A request cancelled while it waits (its client gone) is dropped from the queue."""
        if not self._tokenize_slots.acquire(blocking=False):
            raise ServingError(503, f"the server is busy: the tokenizer's queue is full (--max-tokenize-queue "
                                    f"{self.config.max_tokenize_queue}); retry later", headers={"Retry-After": "1"})
        try:
            done = self._tokenizer_threads.submit(work)
        except BaseException:
            self._tokenize_slots.release()
            raise
        done.add_done_callback(lambda _: self._tokenize_slots.release())
        return await asyncio.wrap_future(done)

    def _check_length(self, name: str, num_chars: int, counted: str = "{} characters") -> None:
        """400 naming ``name`` when ``num_chars`` (``counted`` says of what) are more characters than
        the context can hold (``max_text_chars``: a token is at most the longest vocabulary entry)."""
        if num_chars > self.max_text_chars:
            raise ServingError(400, f"{name}: {counted.format(num_chars)}, more than the {self.max_text_chars} that "
                                    f"this model's maximum context length ({self.max_model_len} tokens) can hold",
                               param=name)

    def _lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter the body's ``model`` names (None: the base model); 404 for a model not served."""
        return _served(lambda: self.models.lora_request(model), "model")

    async def _loaded(self, lora: LoRARequest) -> None:
        """``lora``'s adapter in host memory before its requests are added: one ``--max-cpu-loras``
        dropped is read again in the tokenizer's threads, not the event loop's. 500 for this request
        alone if it cannot be (its files changed or went since it was first loaded)."""
        try:
            await self._tokenizing(lambda: self.llm.llm_engine.add_lora(lora))
        except (ValueError, OSError) as err:
            raise ServingError(500, f"model: the LoRA adapter `{lora.lora_name}` cannot be loaded ({err})",
                               param="model") from err

    def _abort(self, ids: list[str]) -> None:
        for request_id in ids:  # nothing for a finished one
            self.engine.abort(request_id)

    async def _whole(self, response: "_Response", deltas, ids: list[str], num_prompts: int) -> dict:
        whole: list[RequestOutput | None] = [None] * num_prompts
        try:
            async for i, delta in deltas:
                whole[i] = merge(whole[i], delta)
        finally:
            await deltas.aclose()
            self._abort(ids)
        if any(o.error for o in whole):
            raise ServingError(500, "; ".join(o.error for o in whole if o.error))
        if any(c.finish_reason == "abort" for o in whole for c in o.outputs):  # not by this client: it is here
            raise ServingError(503, "the request was aborted: the server is stopping")
        return response.whole(whole)

    async def _events(self, response: "_Response", deltas, ids: list[str], body) -> AsyncIterator[str]:
        prompt_tokens = completion_tokens = 0
        try:
            async for i, delta in deltas:
                if response.first(i):
                    prompt_tokens += len(delta.prompt_token_ids)
                if delta.error:
                    raise ServingError(500, delta.error)
                prompt_logprobs = delta.prompt_logprobs  # in one delta of the request: sent with its first chunk
                for completion in delta.outputs:
                    completion_tokens += len(completion.token_ids)
                    # a chunk per step that made tokens, their text empty while held back (a partial character,
                    # a stop string's start) or never made (no tokenizer), as vLLM's
                    if not (completion.text or completion.token_ids or completion.finished
                            or prompt_logprobs is not None):
                        continue  # nothing new (a prompt chunk)
                    chunk = response.chunk(i, completion, prompt_logprobs)
                    prompt_logprobs = None
                    if body.continuous_usage:
                        chunk["usage"] = _usage(prompt_tokens, completion_tokens)
                    yield _event(chunk)
            if body.include_usage:
                yield _event({**response.header(chunk=True), "choices": [],
                              "usage": _usage(prompt_tokens, completion_tokens)})
        except Exception as err:  # noqa: BLE001 -- the engine failed mid-stream: say so, then end the stream
            yield _event((err if isinstance(err, ServingError) else ServingError.internal(err)).body())
        finally:
            await deltas.aclose()
            self._abort(ids)
        yield "data: [DONE]\n\n"


def chat_text(tokenizer, body: ChatCompletionRequest, config: ServingConfig) -> str:
    """The text the chat request's messages (and tools) render to (its own ``chat_template``, else
    the server's, else the tokenizer's); tokenized without special tokens (the template wrote
    them). ``ValueError`` / ``TypeError`` as :func:`~pagedpack.chat.render_text` raises them."""
    return render_text(tokenizer, template_messages(body.messages),
                       chat_template=body.chat_template or config.chat_template,
                       add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message,
                       chat_template_kwargs=body.chat_template_kwargs or {},
                       tools=template_tools(body, exclude_when_none=config.exclude_tools_when_tool_choice_none))


_APPLY_CHAT_TEMPLATE_ARGS = {"conversation", "messages", "self", "tools", "documents", "chat_template",
                             "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
                             "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs"}


def _num_chars(value, limit: int) -> int:
    """Characters of every string in ``value`` (nested lists and dicts, keys too), any other value
    (a number, a bool, null, an empty string, list or dict) counted as at least one; counting stops
    past ``limit`` (what it returns then is a lower bound), so it costs at most ``limit`` items."""
    total, items = 0, [iter((value,))]
    while items and total <= limit:
        item = next(items[-1], _END)
        if item is _END:
            items.pop()
        elif isinstance(item, str):
            total += max(1, len(item))
        elif isinstance(item, dict):
            total += 1
            items.append(itertools.chain.from_iterable(item.items()))
        elif isinstance(item, (list, tuple)):
            total += 1
            items.append(iter(item))
        else:
            total += max(1, len(str(item)))
    return total


_END = object()


async def _observed(deltas, timers: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``deltas`` passed on, each seen by its prompt's metrics timer."""
    try:
        async with contextlib.aclosing(deltas):
            async for i, delta in deltas:
                timers[i].observe(delta)
                yield i, delta
    finally:
        for timer in timers:
            timer.close()


def _tokenized(name: str, make):
    """``make()`` (tokenizing or rendering ``name``), its errors answered with 400 naming ``name``:
    the tokenizer raises ``TypeError`` for text it cannot encode."""
    try:
        return _checked(make)
    except (TypeError, UnicodeError) as err:
        raise ServingError(400, f"{name}: the tokenizer cannot encode it ({type(err).__name__}: {err})",
                           param=name) from err


def _served(make, param: str):
    """``make()``, a ``LookupError`` from it (a model or adapter not served) answered with 404 naming
    ``param``, a ``ValueError`` with 400 naming the field."""
    try:
        return _checked(make)
    except LookupError as err:
        raise ServingError(404, str(err), param=param) from err


def _checked(make):
    """``make()``, a ``ValueError`` from it answered with 400 naming the field."""
    try:
        return make()
    except ValueError as err:
        raise ServingError.bad_request(err) from err


async def _merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(prompt index, delta)`` from every stream as they come; closing this cancels the readers
    (each stream's own ``finally`` then aborts its request). A reader waits while the queue holds a
    delta of every stream: a client that stops reading stops taking them (backpressure)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for delta in stream:
                yield 0, delta
        return
    arrived: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def read(i, stream):
        try:
            async for delta in stream:
                await arrived.put((i, delta))
            await arrived.put((i, None))
        except Exception as err:  # noqa: BLE001 -- handed to the reader
            await arrived.put((i, err))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await arrived.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for reader in readers:
            reader.cancel()


class _Response:
    """Builds one response's objects: OpenAI's completion or chat shapes, choice ``i * n + index``;
    with ``tools``, each chat choice's text read by its own tool parser."""

    def __init__(self, response_id: str, model: str, n: int, chat: bool, logprobs: int | None, token_ids: bool,
                 tools: ToolCalling | None = None):
        self.id, self.model, self.n, self.chat, self.logprobs = response_id, model, n, chat, logprobs
        self.token_ids, self.tools = token_ids, tools  # name tokens by id in logprobs
        self.created = int(time.time())
        self._started: set = set()  # prompts and choices that sent something
        self._offsets: dict[int, int] = {}  # completions' text offsets (completion logprobs)
        self._streamed: dict[int, tuple[ToolParser, str]] = {}  # a streamed choice's tool parser and text so far

    def header(self, *, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def first(self, key) -> bool:
        """True the first time ``key`` is seen."""
        if key in self._started:
            return False
        self._started.add(key)
        return True

    def chunk(self, prompt_index: int, part: CompletionOutput, prompt_logprobs=None) -> dict:
        """A chunk of one choice (``prompt_logprobs``: the request's, sent with its first chunk)."""
        index = prompt_index * self.n + part.index
        choice: dict = {"index": index, "logprobs": self._logprobs(index, part), "finish_reason": part.finish_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(prompt_logprobs)
        if self.chat:
            delta = {"content": part.text}
            if self.tools is not None:
                parser, previous = self._streamed.get(index) or (self.tools.parser(), "")
                self._streamed[index] = parser, previous + part.text
                delta = parser.extract_tool_calls_streaming(previous, previous + part.text, part.text,
                                                            finished=part.finished) or {}
                choice["finish_reason"] = self.tools.finish_reason(part.finish_reason, parser)
            choice["delta"] = {"role": "assistant", **delta} if self.first(("choice", index)) else delta
        else:
            choice["text"] = part.text
        choice["stop_reason"] = part.stop_reason
        return {**self.header(chunk=True), "choices": [choice]}

    def whole(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            for part in sorted(out.outputs, key=lambda c: c.index):
                index = i * self.n + part.index
                choice: dict = {"index": index}
                finish_reason = part.finish_reason
                if self.chat:
                    choice["message"], finish_reason = self._message(part)
                else:
                    choice["text"] = part.text
                choice.update(logprobs=self._logprobs(index, part), finish_reason=finish_reason,
                              stop_reason=part.stop_reason)
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
        num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        body = {**self.header(chunk=False), "choices": choices, "usage": _usage(num_prompt, num_out)}
        transfer = [o.kv_transfer_params for o in outputs if o.kv_transfer_params is not None]
        if transfer:  # vLLM's: one request's (a body of one prompt with n = 1 is what the connector serves)
            body["kv_transfer_params"] = transfer[0]
        return body

    def _message(self, part: CompletionOutput) -> tuple[dict, str | None]:
        """A whole chat choice's message (its text, or its tool calls and what text is left) and
        finish reason."""
        if self.tools is None:
            return {"role": "assistant", "content": part.text}, part.finish_reason
        parser = self.tools.parser()
        read = parser.extract_tool_calls(part.text)
        message = {"role": "assistant", "content": read.content}
        if read.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in read.tool_calls]
        return message, self.tools.finish_reason(part.finish_reason, parser)

    def _logprobs(self, index: int, part: CompletionOutput) -> dict | None:
        """OpenAI's logprobs of ``part``'s tokens: chat ``{"content": [...]}``; completions
        ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``. A token is its text
        (``"token_id:<id>"`` with vLLM's ``return_tokens_as_token_ids``: texts of different tokens
        can be equal, e.g. each half of a character is ``"\ufffd"``)."""
        if self.logprobs is None or part.logprobs is None:
            return None
        tokens = [((token, entry[token]), sorted(((t, lp) for t, lp in entry.items() if lp.rank <= self.logprobs),
                                                 key=lambda item: item[1].rank))
                  for token, entry in zip(part.token_ids, part.logprobs)]
        name = self._token_name
        if self.chat:
            return {"content": [{**_token(name(*sampled), sampled[1]), "top_logprobs": [_token(name(*t), t[1])
                                                                                        for t in top]}
                                for sampled, top in tokens]}
        offsets, at = [], self._offsets.get(index, 0)
        for (_, sampled), _ in tokens:
            offsets.append(at)
            at += len(sampled.decoded_token or "")
        self._offsets[index] = at
        top_logprobs = []
        for _, top in tokens:
            ranked: dict = {}
            for t in top:  # a name two tokens share keeps the more likely one
                ranked.setdefault(name(*t), t[1].logprob)
            top_logprobs.append(ranked)
        return {"tokens": [name(*s) for s, _ in tokens], "token_logprobs": [s[1].logprob for s, _ in tokens],
                "top_logprobs": top_logprobs, "text_offset": offsets}

    def _token_name(self, token_id: int, logprob) -> str:
        return f"token_id:{token_id}" if self.token_ids else logprob.decoded_token or ""


def _prompt_logprobs(entries: list) -> list:
    """vLLM's ``prompt_logprobs``: None for the first token, then ``{token id: {"logprob", "rank",
    "decoded_token"}}`` per prompt token."""
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in entries]


def _token(name: str, logprob) -> dict:
    return {"token": name, "logprob": logprob.logprob, "bytes": list((logprob.decoded_token or "").encode())}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
