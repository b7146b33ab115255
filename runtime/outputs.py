"""What generation returns, per request (vLLM's ``RequestOutput`` / ``CompletionOutput``).

The engine hands out deltas (new token ids and text since the last output of that request);
:func:`merge` folds a delta into the request's whole output, which is what ``LLM.generate``
returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model (``log_softmax`` of its logits), its ``rank``
    (1: the most likely) and its text alone (vLLM's ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion (or its delta): generated ``token_ids`` and their decoded ``text``;
    ``finish_reason`` ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None while it runs;
    ``stop_reason``: the stop string or stop token id that finished it (None for EOS or length).
    With ``SamplingParams.logprobs``: ``logprobs``, one ``{token id: Logprob}`` per generated token
    (the top ``logprobs`` tokens and the sampled one), and ``cumulative_logprob``, their sum over the
    sampled tokens (of the whole completion so far, in a delta too)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one prompt (or its delta). ``error`` is set (and ``outputs[0]`` empty) if it
    failed; ``finished``: every completion has finished. With ``SamplingParams.prompt_logprobs``:
    ``prompt_logprobs``, None for the first prompt token, then one ``{token id: Logprob}`` per prompt
    token (the token itself and the top ``prompt_logprobs``); in the first delta that has them all
    (the one with the first output tokens), None in the others. ``kv_transfer_params``: what the engine's KV
    connector says of the request's KV blocks once it finished (vLLM's: where a decoding engine pulls them
    from), in its last delta; None without."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict | None = None

    @property
    def num_tokens(self) -> int:
        """Generated token ids over its completions (in a delta: the new ones)."""
        return sum(len(c.token_ids) for c in self.outputs)


def merge(whole: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """``whole`` with ``delta`` appended (a new output for the first delta), completions by index."""
    if whole is None:
        whole = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, finished=False)
    by_index = {c.index: c for c in whole.outputs}
    for part in delta.outputs:
        completion = by_index.get(part.index)
        if completion is None:
            completion = by_index[part.index] = CompletionOutput(part.index, "", [])
            whole.outputs.append(completion)
        completion.text += part.text
        completion.token_ids += part.token_ids
        if part.logprobs is not None:
            completion.logprobs = [*(completion.logprobs or []), *part.logprobs]
            completion.cumulative_logprob = part.cumulative_logprob
        completion.finish_reason, completion.stop_reason = part.finish_reason, part.stop_reason
    whole.outputs.sort(key=lambda c: c.index)
    whole.error = whole.error or delta.error
    if delta.prompt_logprobs is not None:
        whole.prompt_logprobs = delta.prompt_logprobs
    whole.kv_transfer_params = whole.kv_transfer_params or delta.kv_transfer_params
    whole.finished = delta.finished
    return whole
