"""One generation request: its tokens, its place in the KV cache and its life cycle."""
from __future__ import annotations

import contextlib
import dataclasses
import enum

import torch

from pagedpack.inputs import check_cache_salt
from pagedpack.runtime.block_hash import first_block_keys
from pagedpack.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """A request's life cycle; the finished statuses come last (vLLM's ordering), so that
    ``is_finished`` is one integer comparison (it runs for every request in every step)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        """``status.is_finished()`` or, as in vLLM, ``RequestStatus.is_finished(status)``."""
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's name of a finished status ("stop", "length", "error", "abort"); None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ERROR: "error", RequestStatus.FINISHED_ABORTED: "abort"}


class Request:
    """A prompt being extended token by token.

    Attributes:
        request_id: caller's id, unique among live requests.
        prompt_token_ids / output_token_ids: the prompt and the tokens generated so far.
        num_computed_tokens: leading tokens of ``all_token_ids`` whose KV is in the cache.
        block_ids: physical KV blocks, in order (block ``j`` holds positions
            ``j * block_size ..``); owned by the ``KVCacheManager``.
        state_slot: its recurrent-state slot while it holds one (a model with recurrent layers),
            else -1; owned by the ``KVCacheManager``.
        status / finish_reason ("stop", "length", "error", "abort") / error (message for "error").
        generator: the request's own ``torch.Generator`` when it has a seed (created lazily by
            the sampler).
        num_preemptions: how often the scheduler evicted it (its KV is then recomputed).
        cache_salt: requests share cached KV blocks only if their salts are equal (None is a
            salt of its own), as vLLM's ``cache_salt``.
        lora_request: the LoRA adapter it runs with (:class:`~pagedpack.runtime.lora.LoRARequest`),
            None for the base model; its blocks are cached under its adapter's digest (``block_keys``,
            :meth:`set_lora_adapter`).
        block_hashes / num_cached_blocks: the content hashes of its full blocks and how many of
            its leading blocks were offered to the prefix cache (the ``KVCacheManager``'s).
        grammar: with ``SamplingParams.structured_outputs``, the completion's own matcher (an
            ``xgrammar.GrammarMatcher``: :mod:`pagedpack.runtime.structured_output`), which has
            accepted each output token; dropped when the request finishes. None otherwise.
        forks: parallel samples of the same prompt (``SamplingParams.n``), not yet scheduled:
            once this request's prompt is computed they take their first tokens from its last
            logits row, share its full blocks and run on their own (``Scheduler``).
        spec_token_ids: with speculative decoding, the draft tokens proposed to follow
            ``all_token_ids`` (:mod:`pagedpack.runtime.spec_decode`), until the next step scheduling it
            verifies them; ``spec_lookahead``: how many it may get (adapted to its acceptance).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> None:
        if cache_salt is not None:
            check_cache_salt("cache_salt", cache_salt)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids)  # checked per token: O(1), any length
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.state_slot = -1
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_adapter = None  # the adapter it holds while it lives (the engine's, runtime/lora.py)
        self.block_keys = first_block_keys(cache_salt)  # and the adapter's digest: set_lora_adapter
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.forks: list[Request] = []
        self.spec_token_ids: list[int] = []
        self.spec_lookahead = None  # a spec_decode.Lookahead, made by the first proposal
        self.grammar = None
        self.kv_transfer_params: dict | None = None  # what a KV connector's request_finished returned
        # per output token, with SamplingParams.logprobs: (logprob, rank, [(token id, logprob), ...])
        self.output_logprobs: list[tuple] = []
        # with SamplingParams.prompt_logprobs, the same for prompt tokens 1, 2, ... as their rows are computed
        self.prompt_logprobs: list[tuple] = []

    def set_lora_adapter(self, adapter) -> None:
        """Hold ``adapter`` (its :class:`~pagedpack.runtime.lora.LoRARequest`'s, loaded) and key the prefix
        cache by what it computes (:func:`~pagedpack.runtime.block_hash.first_block_keys`)."""
        self.lora_adapter = adapter
        self.block_keys = first_block_keys(self.cache_salt, adapter.digest)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_prompt_tokens}"
            f"+{self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The list is the request's own: read it, do not modify it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def first_missing_prompt_logprob(self) -> int | None:
        """The first position whose logits a prompt logprob of this request still needs, or None
        (none asked for, or all taken): ``len(prompt_logprobs)`` (:mod:`pagedpack.runtime.prompt_logprobs`;
        the KV cache manager takes no cached block past it)."""
        if self.sampling_params.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens - 1:
            return None
        return len(self.prompt_logprobs)

    def append_output(self, token_id: int, max_model_len: int) -> bool:
        """Append a generated token; finish the request if a stop condition holds.

        Stop conditions, in order: the EOS token (unless ``ignore_eos``), a ``stop_token_ids`` entry, or a
        token that terminated its grammar (``grammar``, which accepted it) -> "stop"; ``max_tokens`` outputs
        or ``max_model_len`` tokens in all -> "length". The stopping token stays in ``output_token_ids``.
        Returns whether the request finished. Raises ``RuntimeError`` if it already had.
        """
        return self.append_outputs([token_id], max_model_len)

    def append_outputs(self, token_ids: list[int], max_model_len: int) -> bool:
        """:meth:`append_output` for the tokens of one step in order (a speculative step's accepted drafts
        and the token after them), up to the first that stops the request (the rest are dropped). The
        grammar, which accepted them all, is asked whether it terminated only after the last."""
        if self.is_finished:
            raise RuntimeError(f"request {self.request_id!r} is already finished ({self.status.name})")
        for i, token_id in enumerate(token_ids, start=1):
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
            if self.stops_on(token_id, grammar=i == len(token_ids)):
                self.finish(RequestStatus.FINISHED_STOPPED)
            elif self.num_output_tokens >= self.sampling_params.max_tokens or self.num_tokens >= max_model_len:
                self.finish(RequestStatus.FINISHED_LENGTH)
            if self.is_finished:
                break
        return self.is_finished

    def stops_on(self, token_id: int, *, grammar: bool = True) -> bool:
        """Whether ``token_id``, just taken, stops the request: EOS (unless ``ignore_eos``), a
        ``stop_token_ids`` entry, or (``grammar``: the matcher's last accepted token is this one) a grammar
        it terminated."""
        return (token_id == self.eos_token_id and not self.sampling_params.ignore_eos) or \
            token_id in self._stop_token_ids or (grammar and self.grammar is not None and self.grammar.is_terminated())

    @contextlib.contextmanager
    def tentative_outputs(self, token_ids: list[int]):
        """Within the block, ``token_ids`` follow the output (what the logits processors see while a
        speculative step's later positions are sampled: the tokens accepted before them); removed after."""
        if not token_ids:
            yield
            return
        self.output_token_ids += token_ids
        self._all_token_ids += token_ids
        try:
            yield
        finally:
            del self.output_token_ids[-len(token_ids):], self._all_token_ids[-len(token_ids):]

    def fail(self, error: str) -> None:
        """Finish the request with ``finish_reason="error"`` and the given message."""
        self.error = error
        self.finish(RequestStatus.FINISHED_ERROR)

    def finish(self, status: RequestStatus) -> None:
        """End the request with a finished ``status`` (its ``finish_reason`` follows); its grammar
        matcher and draft tokens go."""
        self.status = status
        self.grammar = None
        self.spec_token_ids = []
        self.finish_reason = status.finish_reason


def make_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 eos_token_ids: list[int], cache_salt: str | None = None, lora_request=None) -> Request:
    """The request of one prompt: it stops on the first of ``eos_token_ids`` (the others join its
    ``stop_token_ids`` unless ``ignore_eos``); with ``params.n > 1`` it is the first of the ``n``
    completions (id ``"0_<request_id>"``, as vLLM's child requests) and carries the others as its
    ``forks``, seeded ``seed + i``; only the first computes ``prompt_logprobs`` (once per request)."""
    eos = eos_token_ids[0] if eos_token_ids else None
    if len(eos_token_ids) > 1 and not params.ignore_eos:
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *eos_token_ids[1:]])
    if params.n == 1:
        return Request(request_id, prompt_token_ids, params, eos_token_id=eos, cache_salt=cache_salt,
                       lora_request=lora_request)
    first, *forks = [
        Request(f"{i}_{request_id}", prompt_token_ids, dataclasses.replace(
            params, n=1, seed=None if params.seed is None else params.seed + i,
            prompt_logprobs=params.prompt_logprobs if i == 0 else None),
            eos_token_id=eos, cache_salt=cache_salt, lora_request=lora_request)
        for i in range(params.n)]
    first.forks = forks
    return first


@dataclasses.dataclass
class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request`` to compute this step, starting at
    ``request.num_computed_tokens`` (which the scheduler advances only in
    ``update_from_output``); with speculative decoding the last ``len(spec_token_ids)`` of them are
    draft tokens following the request's known ones, each verified by the row before it.
    ``ValueError`` unless ``1 <= num_new_tokens <= `` the tokens left plus the drafts, and drafts
    come only after the last known token."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    _needs_sample: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        known = self.num_new_tokens - len(self.spec_token_ids)
        end = self.request.num_computed_tokens + known
        if known < 1 or end > self.request.num_tokens or (self.spec_token_ids and end != self.request.num_tokens):
            raise ValueError(
                f"num_new_tokens: expected 1 .. {self.request.num_tokens - self.request.num_computed_tokens} "
                f"for request {self.request.request_id!r} ({self.request.num_computed_tokens} of "
                f"{self.request.num_tokens} tokens computed) plus its {len(self.spec_token_ids)} draft tokens "
                f"(drafts only after the last known token), got {self.num_new_tokens}"
            )
        self._needs_sample = end == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds: the request's from ``num_computed_tokens`` on, then the drafts."""
        start = self.request.num_computed_tokens
        known = self.request.all_token_ids[start:start + self.num_new_tokens - len(self.spec_token_ids)]
        return known + self.spec_token_ids if self.spec_token_ids else known

    @property
    def needs_sample(self) -> bool:
        """This chunk reaches the request's last known token, so its last row is sampled
        (``num_computed_tokens + num_new_tokens == num_tokens`` when scheduled, drafts aside; fixed then,
        so it stays valid after ``update_from_output``)."""
        return self._needs_sample

    @property
    def sample_requests(self) -> list[Request]:
        """Who takes a token from this chunk's last row: nobody unless ``needs_sample``; else
        the request and the parallel samples still to be forked off it (``Request.forks``)."""
        return [self.request, *self.request.forks] if self._needs_sample else []
