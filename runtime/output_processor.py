"""From requests that advanced in a step to per-request deltas (vLLM's ``OutputProcessor``).

For every request the engine holds it keeps one state per completion (``SamplingParams.n``): an
incremental detokenizer (:mod:`pagedpack.runtime.detokenizer`), the stop strings and what was
already handed out. :meth:`OutputProcessor.process` turns the step's advanced requests into one
:class:`~pagedpack.runtime.outputs.RequestOutput` per request with the new token ids and text of
each completion that moved, and names the requests a stop string finished (the engine then
finishes them in the scheduler, freeing their blocks).

Stop strings (vLLM's semantics): searched in the completion's text from where a match could
start after the last search, so one that straddles two tokens or two deltas is found; the text is
cut before the string (after it with ``include_stop_str_in_output``) and ``stop_reason`` is the
string. While a request runs, the last ``len(longest stop string) - 1`` characters are held
back, so a streamed delta never shows part of a stop string that the next token completes.

Prompt logprobs (``SamplingParams.prompt_logprobs``) go out once per request, in its first delta
after the last prompt row was computed (the step sampling its first tokens); an abort before that
hands out none.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from pagedpack.runtime.detokenizer import IncrementalDetokenizer
from pagedpack.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from pagedpack.runtime.request import Request

log = logging.getLogger("pagedpack.engine")


@dataclass
class _Completion(CompletionOutput):
    """A completion's state: its ``text`` (cut at a stop string), finish and stop reasons, and how
    many output tokens and characters were handed out (``token_ids`` stay the request's own);
    ``num_taken``: once a stop string ended it, the output tokens it keeps (up to the one completing it);
    ``held``: the characters held back while it runs, ``len(longest stop string) - 1``."""

    detokenizer: IncrementalDetokenizer | None = None
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    num_tokens: int = 0
    num_chars: int = 0
    num_taken: int | None = None  # set by a stop string: the output tokens up to the one completing it
    held: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.held = max((len(s) for s in self.stop), default=1) - 1


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: dict[str, _Completion] = field(default_factory=dict)  # by the scheduler's request id
    prompt_source: Request | None = None  # the request taking prompt logprobs, until they are handed out


class OutputProcessor:
    """Per-request output state; ``tokenizer`` None: token ids only (empty text, no stop strings).
    ``tokenizer_lock`` is held around every use of the tokenizer (encoding runs in other threads)."""

    def __init__(self, tokenizer=None, tokenizer_lock: threading.Lock | None = None):
        self.tokenizer, self.tokenizer_lock = tokenizer, tokenizer_lock or threading.Lock()
        self._states: dict[str, _RequestState] = {}
        self._by_child: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(self, request_id: str, request: Request, prompt: str | None) -> None:
        """Keep the state of ``request`` (and its ``forks``) under ``request_id``."""
        params = request.sampling_params  # stop strings need the tokenizer: LLMEngine.make_request checks
        state = _RequestState(request_id, prompt, request.prompt_token_ids,
                              prompt_source=request if params.prompt_logprobs is not None else None)
        for index, child in enumerate([request, *request.forks]):
            detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, lock=self.tokenizer_lock)
            state.completions[child.request_id] = _Completion(index, "", [], detokenizer=detokenizer, stop=params.stop,
                                                              include_stop=params.include_stop_str_in_output)
            self._by_child[child.request_id] = state
        self._states[request_id] = state

    def child_ids(self, request_id: str) -> list[str]:
        """The scheduler's request ids of ``request_id``'s unfinished completions."""
        state = self._states.get(request_id)
        return [] if state is None else [i for i, c in state.completions.items() if not c.finished]

    def process(self, requests: list[Request]) -> tuple[list[RequestOutput], list[Request], list[Request]]:
        """``(outputs, stopped, failed)``: one delta per request among ``requests`` (each advanced or
        finished this step); those a stop string finished, and those whose output could not be made
        (an exception detokenizing or matching stop strings: their delta ends them with ``"error"``),
        both still to finish in the scheduler."""
        moved: dict[str, list[CompletionOutput]] = {}
        errors: dict[str, str] = {}
        prompt_logprobs: dict[str, list] = {}
        transfer: dict[str, dict] = {}  # a KV connector's kv_transfer_params of a finished request
        stopped, failed = [], []
        for request in requests:
            state = self._by_child.get(request.request_id)
            if state is None:
                continue
            completion = state.completions[request.request_id]
            if completion.finished:
                continue
            try:
                if self._advance(completion, request):
                    stopped.append(request)
                delta = self._delta(completion, request)
                ready = self._prompt_logprobs(state)  # decoded here: a failure is this request's alone
                if ready is not None:
                    prompt_logprobs[state.request_id] = ready
            except Exception as err:  # noqa: BLE001 -- this request's output alone
                log.exception("the output of request %r failed", request.request_id)
                request.fail(f"output: request {request.request_id!r}'s text could not be made ({type(err).__name__})")
                completion.finish_reason = "error"
                delta = CompletionOutput(completion.index, "", [], "error")
                failed.append(request)
            if request.error:
                errors[state.request_id] = request.error
            if request.is_finished and request.kv_transfer_params is not None:
                transfer.setdefault(state.request_id, request.kv_transfer_params)
            moved.setdefault(state.request_id, []).append(delta)
        outputs = [self._output(self._states[rid], deltas, errors.get(rid), prompt_logprobs.get(rid), transfer.get(rid))
                   for rid, deltas in moved.items()]
        return outputs, [r for r in stopped if r not in failed], failed

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final delta of an aborted request (its unfinished completions end with ``"abort"``)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        deltas = []
        for completion in state.completions.values():
            if not completion.finished:
                completion.finish_reason = "abort"
                deltas.append(CompletionOutput(completion.index, "", [], "abort"))
        return self._output(state, deltas, None)

    def _advance(self, completion: _Completion, request: Request) -> bool:
        """Take ``request``'s new tokens into ``completion``; True if a stop string finished it. Several new
        tokens (a speculative step's) are searched one by one where there are stop strings, so the
        completion ends with the token that completed the string, as without speculation."""
        new = request.output_token_ids[completion.num_tokens:]
        detokenizer = completion.detokenizer
        if detokenizer is not None:
            chunks = [[token] for token in new] if completion.stop and len(new) > 1 else [new]
            for taken, chunk in enumerate(chunks, start=completion.num_tokens + len(chunks[0])):
                searched = max(0, len(completion.text) - completion.held)
                detokenizer.push(chunk)
                if request.is_finished and chunk is chunks[-1]:
                    detokenizer.finish()
                completion.text = detokenizer.text
                # stop strings wait for min_tokens
                hit = _find_stop(completion.text, completion.stop, searched) if completion.stop and \
                    taken >= request.sampling_params.min_tokens else None
                if hit is not None:
                    at, stop = hit
                    completion.text = completion.text[:at + len(stop) if completion.include_stop else at]
                    completion.finish_reason, completion.stop_reason = "stop", stop
                    completion.num_taken = taken
                    return True
        if request.is_finished:
            completion.finish_reason = request.finish_reason
            last = request.output_token_ids[-1] if request.output_token_ids else None
            completion.stop_reason = last if request.finish_reason == "stop" and last in \
                request.sampling_params.stop_token_ids else None
        return False

    def _delta(self, completion: _Completion, request: Request) -> CompletionOutput:
        end = completion.num_taken or request.num_output_tokens
        token_ids = request.output_token_ids[completion.num_tokens:end]
        held = 0 if completion.finished else completion.held
        chars = max(completion.num_chars, len(completion.text) - held)
        text = completion.text[completion.num_chars:chars]
        completion.num_chars = chars
        logprobs = None
        if request.sampling_params.logprobs is not None:
            first = len(request.output_logprobs) - request.num_output_tokens + completion.num_tokens
            logprobs = [self._logprobs(token, entry) for token, entry in
                        zip(token_ids, request.output_logprobs[first:first + len(token_ids)])]
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                entry[token].logprob for token, entry in zip(token_ids, logprobs))
        completion.num_tokens = end
        return CompletionOutput(completion.index, text, token_ids, completion.finish_reason,
                                completion.stop_reason, logprobs, completion.cumulative_logprob)

    def _logprobs(self, token: int, entry: tuple) -> dict[int, Logprob]:
        """``{token id: Logprob}`` of one generated (or prompt) token: the top-k and that token."""
        logprob, rank, top = entry
        ranked = {t: Logprob(lp, r) for r, (t, lp) in enumerate(top, start=1)}
        ranked.setdefault(token, Logprob(logprob, rank))
        if self.tokenizer is None:
            return ranked
        with self.tokenizer_lock:
            return {t: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([t])) for t, lp in ranked.items()}

    def _prompt_logprobs(self, state: _RequestState) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs once all are computed and not yet handed out, else None."""
        source = state.prompt_source
        if source is None or len(source.prompt_logprobs) < source.num_prompt_tokens - 1:
            return None
        state.prompt_source = None
        return [None, *(self._logprobs(token, entry)
                        for token, entry in zip(source.prompt_token_ids[1:], source.prompt_logprobs))]

    def _output(self, state: _RequestState, deltas: list[CompletionOutput], error: str | None,
                prompt_logprobs: list | None = None, kv_transfer_params: dict | None = None) -> RequestOutput:
        finished = all(c.finished for c in state.completions.values())
        if finished:
            del self._states[state.request_id]
            for child in state.completions:
                self._by_child.pop(child, None)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, deltas, error=error,
                             finished=finished, prompt_logprobs=prompt_logprobs, kv_transfer_params=kv_transfer_params)


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The first stop string in ``text[start:]`` as ``(index, string)`` (the earliest; the longest at a tie)."""
    hits = [(text.find(stop, start), -len(stop), stop) for stop in stops]
    hits = [h for h in hits if h[0] >= 0]
    if not hits:
        return None
    at, _, stop = min(hits)
    return at, stop
