"""Continuous batching with chunked prefill and recompute preemption (vLLM v1 style).

There are no prefill and decode phases: every request simply has
``num_tokens - num_computed_tokens`` tokens whose KV is not cached yet, and each step gives
each scheduled request a chunk of them, within a token budget. A prompt longer than the budget
is computed in several steps (chunked prefill); a request generating tokens has one new token
per step (decode); both mix freely in one step.

Priority is first come, first served. ``running`` stays in arrival order (a preempted request
goes back to the front of ``waiting``, and waiting requests are admitted in order, never
skipping one), so the last running request is always the latest arrived one, which is the one
preempted when the KV pool runs out.

With prefix caching (``KVCacheManager(enable_prefix_caching=True)``) a request being admitted
first takes the longest cached prefix of its tokens and computes only the rest; blocks are
offered to the cache when the step that fills them is scheduled (as vLLM does); preemption frees
blocks into the cache, so a preempted request coming back finds its own blocks unless they were
evicted.

With a KV connector (its ``SCHEDULER`` half, :mod:`pagedpack.runtime.kv_connector.base`) a request being
admitted is also offered the tokens past its local prefix that the connector can load
(``get_num_new_matched_tokens``, then ``update_state_after_alloc``); each step's output carries the
connector's metadata (``build_connector_meta``); a finished request's blocks stay allocated while the
connector saves them if it asks (``request_finished``), until the worker names it in
``finished_sending``; a request whose external tokens load asynchronously waits, holding its blocks,
until the worker names it in ``finished_recving``; a block whose load failed rolls the requests holding it
back to that block's first token (vLLM's ``get_block_ids_with_load_errors``), so they recompute it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedpack.runtime.kv_cache_manager import NO_PREFIX, KVCacheManager, PrefixCacheStats
from pagedpack.runtime.request import Request, RequestStatus, ScheduledRequest  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from pagedpack.runtime.kv_connector.base import KVConnectorBase_V1


@dataclass
class SchedulerOutput:
    """One step: what to compute, who was preempted to make room, and the ``(src, dst)`` KV
    block copies (every layer's K and V) and recurrent-state slot copies to make before the step runs.

    evicted_blocks: ``(hash, block_id)`` of the cached blocks this step's allocations took over (their
    old K/V are in the blocks until the step runs). finished_req_ids: requests finished since the last
    step (vLLM's; the worker's ``get_finished`` takes them). kv_connector_metadata: the connector's
    instructions for the step (None without a connector)."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_batched_tokens: int
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    states_to_copy: list[tuple[int, int]] = field(default_factory=list)
    evicted_blocks: list[tuple[bytes, int]] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None


@dataclass
class KVConnectorOutput:
    """What the worker half of a KV connector reported after a step (vLLM's ``KVConnectorOutput``):
    requests whose delayed blocks may be freed, requests whose asynchronous load is done, and the
    ids of blocks whose load failed."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    max_num_batched_tokens: token budget of one step (``T`` of the packed batch).
    max_num_seqs: most requests running at once (``B`` of the packed batch).
    max_model_len: most tokens (prompt + output) of one request.
    max_loras: most LoRA adapters among the running requests (0: no limit, no LoRA); a waiting request
        of another adapter waits, and later ones are admitted past it, as vLLM's scheduler does.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        connector: KVConnectorBase_V1 | None = None,
        max_loras: int = 0,
    ) -> None:
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: dict[str, Request] = {}  # taken out of scheduling by pause_requests, holding no blocks
        self.connector = connector  # a KV connector's SCHEDULER half, or None
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # holding blocks an asynchronous load fills
        self.finished_sending: dict[str, Request] = {}  # finished, blocks held until the connector saved them
        self._finished_req_ids: set[str] = set()  # since the last step
        # the tokens of admitted requests (queries) and those a connector supplied (hits), as vLLM's
        # connector_prefix_cache_stats
        self.connector_prefix_cache_stats = PrefixCacheStats()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """Requests to schedule or waiting for a connector (paused ones are not)."""
        return bool(self.waiting or self.running or self.waiting_for_remote_kvs or self.finished_sending)

    def live_request_ids(self) -> set[str]:
        """The ids of every request not finished: waiting, running, paused or waiting for a connector."""
        return {r.request_id for r in [*self.waiting, *self.running, *self.paused.values(),
                                       *self.waiting_for_remote_kvs.values()]}

    def check_request(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` could never be served by this scheduler."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {num_prompt} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        kv = self.kv_cache_manager
        max_len = min(num_prompt + request.sampling_params.max_tokens, self.max_model_len)
        needed = kv.num_blocks_for(max_len)
        if needed > kv.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: up to {max_len} tokens need {needed} KV blocks of "
                f"block_size={kv.block_size}, more than the whole pool of num_blocks={kv.num_blocks}"
            )

    def add_request(self, request: Request) -> None:
        """Check ``request`` (``ValueError`` if it can never run) and queue it, WAITING."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks: running requests first, then waiting ones in order."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._take_drafts(request, num_new, budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new + len(drafts)):
                if drafts:  # verify none rather than preempt anyone
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                i += 1

        # As vLLM: a step that had to preempt admits nobody (the pool is under pressure).
        other_adapter: list[Request] = []  # waiting for an adapter slot: they keep their place
        loras = {_adapter(r) for r in [*self.running, *self.waiting_for_remote_kvs.values()]
                 if r.lora_request is not None}
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            lora = _adapter(request) if request.lora_request is not None else None
            if lora is not None and self.max_loras and lora not in loras and len(loras) >= self.max_loras:
                other_adapter.append(self.waiting.popleft())
                continue
            num_new = self._admit(request, budget)
            if num_new is None and not self.running and self._release_a_waiting_holder(request):
                continue
            if num_new is None:
                break
            self.waiting.popleft()
            if lora is not None:
                loras.add(lora)
            if not num_new:  # its external tokens load asynchronously
                self.waiting_for_remote_kvs[request.request_id] = request
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(other_adapter))

        kv = self.kv_cache_manager
        output = SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget,
                                 kv.take_block_copies(), kv.take_state_copies(), kv.pool.take_evicted(),
                                 self._finished_req_ids)
        self._finished_req_ids = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _take_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The draft tokens (``Request.spec_token_ids``, taken from it) that ``request`` verifies in this
        step after its ``num_new`` tokens: none unless those reach its last known token; at most what the
        budget leaves, and fewer than the outputs ``max_tokens`` and ``max_model_len`` still allow (a step
        takes one token more than the drafts it accepts)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or request.num_computed_tokens + num_new != request.num_tokens:
            return []
        room = min(budget - num_new, self.max_model_len - request.num_tokens - 1,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def _release_a_waiting_holder(self, head: Request) -> bool:
        """With nothing running, the blocks ``head`` lacks can only be held by waiting requests whose
        connector load is done (an asynchronous load allocates blocks for the loaded tokens alone): free
        the last such request's, as a preemption frees a running one's, so that the queue moves (it
        computes its tokens again). False if no other waiting request holds blocks."""
        for victim in reversed(self.waiting):
            if victim is not head and victim.block_ids:
                self.kv_cache_manager.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                return True
        return False

    def _admit(self, request: Request, budget: int) -> int | None:
        """Give a waiting ``request`` its cached prefix (if any), the tokens a connector loads, and
        blocks for its next chunk; returns the chunk's token count (0: it waits for an asynchronous
        load), None if it cannot be admitted now."""
        for prefix in self.kv_cache_manager.find_cached_prefix(request):
            num_external, load_async = self._external_tokens(request, prefix)
            if num_external is None:
                return None
            computed = max(prefix.num_tokens, request.num_computed_tokens) + num_external  # resumed: its own
            num_new = 0 if load_async else min(request.num_tokens - computed, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, prefix, num_external,
                                                    name_external=not load_async):
                if load_async and not self.connector.cache_loaded_blocks:  # never offered to the prefix cache
                    request.num_cached_blocks = request.num_computed_tokens // self.kv_cache_manager.block_size
                if self.connector is not None:
                    self.connector_prefix_cache_stats.queries += request.num_tokens
                    self.connector_prefix_cache_stats.hits += num_external
                    self.connector.update_state_after_alloc(request, list(request.block_ids), num_external)
                return num_new
        return None

    def _external_tokens(self, request: Request, prefix) -> tuple[int | None, bool]:
        """``(tokens, load_async)`` the connector supplies past ``prefix`` (a whole number of blocks,
        leaving the last token to compute); ``(0, False)`` without a connector, for a request holding
        blocks (resumed from an asynchronous load) or one whose prefix copies its last block."""
        if (self.connector is None or request.block_ids or request.first_missing_prompt_logprob is not None
                or prefix.copies_last_block(self.kv_cache_manager.block_size)):
            return 0, False
        start = prefix.num_tokens if prefix is not NO_PREFIX else 0
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, start)
        if num_external is None:
            return None, False
        size = self.kv_cache_manager.block_size
        num_external = max(0, min(num_external, request.num_tokens - 1 - start)) // size * size
        return num_external, load_async and num_external > 0

    def abort_all(self) -> list[Request]:
        """Drop every queued, running and paused request (freeing their blocks); returns them."""
        aborted = [*self.running, *self.waiting, *self.paused.values(), *self.waiting_for_remote_kvs.values()]
        for request in [*self.running, *self.waiting_for_remote_kvs.values(), *self.finished_sending.values()]:
            self.kv_cache_manager.free(request)
        self.kv_cache_manager.reset()
        self.running, self.waiting, self.paused = [], deque(), {}
        self.waiting_for_remote_kvs, self.finished_sending = {}, {}
        return aborted

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish the queued, running or paused requests of ``request_ids`` with ``status`` (an abort,
        a stop string found in the text) and free their blocks at once (prefix-cache blocks go back
        to the LRU); their parallel samples not yet started go with them. Returns them."""
        ids = set(request_ids)
        done = [r for r in [*self.running, *self.waiting] if r.request_id in ids]
        done += [self.paused.pop(i) for i in ids & self.paused.keys()]
        done += [self.waiting_for_remote_kvs.pop(i) for i in ids & self.waiting_for_remote_kvs.keys()]
        for request in done:
            request.finish(status)
            self._free_finished(request)
            request.forks = []
        if done:
            self.running = [r for r in self.running if r.request_id not in ids]
            self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        return done

    def pause_requests(self, request_ids) -> None:
        """Take the running or queued requests of ``request_ids`` out of scheduling (their reader takes
        no output: :mod:`pagedpack.runtime.flow_control`) until :meth:`resume_requests`: a running
        one's blocks are freed as a preemption frees them, its K/V recomputed once resumed."""
        ids = set(request_ids)
        for request in [r for r in [*self.running, *self.waiting] if r.request_id in ids]:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.spec_token_ids = []
            request.status = RequestStatus.WAITING
            self.paused[request.request_id] = request
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)

    def resume_requests(self, request_ids) -> None:
        """Queue the paused requests of ``request_ids`` again, last in line (as new arrivals)."""
        for request_id in request_ids:
            request = self.paused.pop(request_id, None)
            if request is not None:
                self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        """Recompute-style eviction: drop its KV and drafts and queue it first among the waiting."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]],
                           failed: dict[str, str] | None = None, rolled_back: set[str] = frozenset()) -> list[Request]:
        """Record a computed step: advance ``num_computed_tokens``, append sampled tokens.

        ``sampled_token_ids`` maps ``request_id`` to the new token (a list: the tokens a speculative step
        took, its accepted drafts then one more; ``[token]`` without drafts), and ``failed`` to why it
        could take none (the sampler's error; it finishes with ``"error"``), for exactly the scheduled
        requests whose ``needs_sample`` is true, together (``ValueError`` otherwise; nothing changes
        then). A request's rejected drafts are not computed: its KV ends after its accepted ones, and the
        blocks only they reached go back to the pool (they were never offered to the prefix cache).
        Finished requests leave ``running`` and free their blocks; they are returned.
        ``rolled_back``: scheduled requests a failed KV load rolled back
        (:meth:`update_from_connector_output`): they take no tokens (none expected) and compute again.
        """
        failed = failed or {}
        sampled = [s for s in output.scheduled if s.needs_sample]
        expected = {r.request_id for s in sampled if s.request.request_id not in rolled_back for r in s.sample_requests}
        if expected != sampled_token_ids.keys() | failed.keys() or sampled_token_ids.keys() & failed.keys():
            raise ValueError(
                f"sampled_token_ids, failed: expected tokens or errors for exactly {sorted(expected)}, "
                f"got tokens for {sorted(sampled_token_ids)}, errors for {sorted(failed)}"
            )
        taken = {i: t if isinstance(t, list) else [t] for i, t in sampled_token_ids.items()}
        for s in output.scheduled:
            if s.request.request_id not in rolled_back:
                tokens = taken.get(s.request.request_id)
                rejected = len(s.spec_token_ids) - len(tokens) + 1 if s.spec_token_ids and tokens else 0
                s.request.num_computed_tokens += s.num_new_tokens - rejected
        self.kv_cache_manager.end_step()
        finished = []
        for s in sampled:
            request, forks = s.request, s.request.forks
            if request.request_id in rolled_back:
                continue
            if request.request_id in failed:
                request.fail(failed[request.request_id])
                finished.append(request)
            elif request.append_outputs(taken[request.request_id], self.max_model_len):
                finished.append(request)
            elif s.spec_token_ids:
                self.kv_cache_manager.free_blocks_past(request, request.num_tokens)
            if forks:
                request.forks = []
                finished += self._fork(request, forks, [taken.get(f.request_id, [None])[0] for f in forks], failed)
        if finished:
            for request in finished:
                self._free_finished(request)
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _free_finished(self, request: Request) -> None:
        """Free a finished ``request``'s blocks, unless the connector keeps them while it saves them."""
        self._finished_req_ids.add(request.request_id)
        if self.connector is not None and request.block_ids:
            delay, request.kv_transfer_params = self.connector.request_finished(request, list(request.block_ids))
            if delay:
                self.finished_sending[request.request_id] = request
                return
        self.kv_cache_manager.free(request)

    def update_from_connector_output(self, output: SchedulerOutput, connector_output: KVConnectorOutput) -> set[str]:
        """Apply the worker half's report of the step ``output`` (before :meth:`update_from_output`):
        free the blocks of requests done sending; queue first the requests whose asynchronous load is done;
        roll back every request holding a block whose load failed to that block's first token, forgetting
        the hashes of its blocks from there. Returns the ids of the scheduled requests rolled back: their
        step's tokens are not counted and what they sampled is dropped (:meth:`update_from_output`)."""
        for request_id in connector_output.finished_sending:
            request = self.finished_sending.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        invalid = connector_output.invalid_block_ids
        rolled_back = set()
        if invalid:
            holders = [*self.running, *self.waiting_for_remote_kvs.values()]
            for request in holders:
                first = next((j for j, b in enumerate(request.block_ids) if b in invalid), None)
                if first is None or first * self.kv_cache_manager.block_size >= request.num_computed_tokens:
                    continue
                self.kv_cache_manager.forget_blocks(request, first)
                request.num_computed_tokens = first * self.kv_cache_manager.block_size
                rolled_back.add(request.request_id)
        ready = [self.waiting_for_remote_kvs.pop(i) for i in connector_output.finished_recving
                 if i in self.waiting_for_remote_kvs]
        self.waiting.extendleft(reversed(ready))
        return rolled_back & {s.request.request_id for s in output.scheduled}

    def _fork(self, parent: Request, forks: list[Request], tokens: list[int | None],
              failed: dict[str, str]) -> list[Request]:
        """Start parallel samples off ``parent``'s computed prompt: each shares its full blocks,
        gets a copy of its partial last block, and takes its own first token (None: it failed, as
        ``failed`` says). One that finds no room (``max_num_seqs``, a free block) waits first in
        line, as if preempted. Returns those finished by their first token."""
        finished, queued = [], []
        at = self.running.index(parent) + 1 if parent in self.running else len(self.running)
        for fork, token in zip(forks, tokens):
            if token is None:
                fork.fail(failed[fork.request_id])
                finished.append(fork)
                continue
            fork.num_computed_tokens = parent.num_computed_tokens
            fork.status = RequestStatus.RUNNING
            if fork.append_output(token, self.max_model_len):
                fork.num_computed_tokens = 0
                finished.append(fork)
            elif len(self.running) < self.max_num_seqs and self.kv_cache_manager.fork_blocks(parent, fork):
                self.running.insert(at, fork)
                at += 1
            else:
                fork.num_computed_tokens = 0
                fork.status = RequestStatus.WAITING
                queued.append(fork)
        self.waiting.extendleft(reversed(queued))
        return finished


def _adapter(request: Request) -> int:
    """What tells a LoRA request's adapter apart: the adapter it holds (one that an id removed and added
    again with other files is another), else its ``LoRARequest``'s id."""
    return id(request.lora_adapter) if request.lora_adapter is not None else request.lora_request.lora_int_id
