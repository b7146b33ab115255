"""The engine loop: schedule a step, build its metadata, run the graph, sample, update."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.model_runner import ModelRunner
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import Sampler
from pagedpack.runtime.scheduler import Scheduler


@dataclass
class EngineStats:
    """Counters over the engine's life (what ``pagedpack generate`` summarises)."""

    num_steps: int = 0
    num_batched_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # tokens at positions < the prompt length (recomputes too)
    num_preemptions: int = 0
    # Distinct batch compositions seen: each step's tuple of per-sequence query lengths.
    compositions: set = field(default_factory=set)


@dataclass(frozen=True)
class Stats:
    """A snapshot of the engine's counters (``LLM.get_stats()``, the CLI summary).

    Steps and tokens: ``num_steps``; ``num_batched_tokens`` (tokens computed, all steps);
    ``num_prompt_tokens_computed`` (of those, prompt tokens, recomputed ones included);
    ``num_preemptions``. Prefix cache, in tokens of admitted requests as vLLM counts them:
    ``prefix_cache_queries``, ``prefix_cache_hits``, ``prefix_cache_hit_rate`` (0 with no
    query); ``num_evictions`` (cached blocks handed out for other contents). KV blocks now:
    ``kv_blocks_used`` (owned by requests) + ``kv_blocks_cached_free`` (owned by nobody, cached:
    reusable by a hit) + ``kv_blocks_free`` (neither) == ``kv_blocks_total``; ``kv_blocks_cached``
    (owned or not); ``kv_blocks_peak_used``.
    """

    num_steps: int
    num_batched_tokens: int
    num_prompt_tokens_computed: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_evictions: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_cached_free: int
    kv_blocks_free: int
    kv_blocks_peak_used: int


class LLMEngine:
    """Drives requests to completion with continuous batching over one step graph."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler | None = None):
        self.runner, self.scheduler = runner, scheduler
        self.sampler = sampler or Sampler()
        self.stats = EngineStats()
        self.step_observers: list = []  # called with the engine after every step that ran

    def add_request(self, request: Request) -> None:
        """Queue ``request``; ``ValueError`` (from the scheduler's checks) if it can never run."""
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_stats(self) -> Stats:
        kv = self.scheduler.kv_cache_manager
        pool, prefix = kv.pool, kv.prefix_cache_stats
        cached_free = pool.num_cached_free_blocks
        return Stats(
            num_steps=self.stats.num_steps, num_batched_tokens=self.stats.num_batched_tokens,
            num_prompt_tokens_computed=self.stats.num_prompt_tokens_computed,
            num_preemptions=self.stats.num_preemptions, prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits, prefix_cache_hit_rate=prefix.hit_rate, num_evictions=pool.num_evictions,
            kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_blocks, kv_blocks_cached_free=cached_free,
            kv_blocks_free=pool.num_free_blocks - cached_free, kv_blocks_peak_used=pool.peak_used_blocks)

    def step(self) -> list[Request]:
        """One scheduled step; returns the requests that finished in it."""
        output = self.scheduler.schedule()
        if not output.scheduled:
            return []
        if output.blocks_to_copy:
            self.runner.copy_blocks(output.blocks_to_copy)
        batch = build_batch(output.scheduled, block_size=self.runner.block_size,
                            num_blocks=self.runner.num_blocks, device=self.runner.device)
        logits = self.runner.execute(batch)
        rows, to_sample = [], []
        for i, s in enumerate(output.scheduled):
            rows += [i] * len(s.sample_requests)
            to_sample += s.sample_requests
        if rows:
            tokens = self.sampler(logits if rows == list(range(logits.shape[0])) else logits[rows], to_sample)
        else:
            tokens = []
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += output.num_batched_tokens
        self.stats.num_prompt_tokens_computed += sum(
            max(0, min(s.request.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens)
                - s.request.num_computed_tokens) for s in output.scheduled)
        self.stats.num_preemptions += len(output.preempted)
        self.stats.compositions.add(tuple(s.num_new_tokens for s in output.scheduled))
        sampled = {r.request_id: t for r, t in zip(to_sample, tokens)}
        finished = self.scheduler.update_from_output(output, sampled)
        for observe in self.step_observers:
            observe(self)
        return finished
