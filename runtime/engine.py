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
    num_preemptions: int = 0
    # Distinct batch compositions seen: each step's tuple of per-sequence query lengths.
    compositions: set = field(default_factory=set)


class LLMEngine:
    """Drives requests to completion with continuous batching over one step graph."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler | None = None):
        self.runner, self.scheduler = runner, scheduler
        self.sampler = sampler or Sampler()
        self.stats = EngineStats()

    def add_request(self, request: Request) -> None:
        """Queue ``request``; ``ValueError`` (from the scheduler's checks) if it can never run."""
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One scheduled step; returns the requests that finished in it."""
        output = self.scheduler.schedule()
        if not output.scheduled:
            return []
        batch = build_batch(output.scheduled, block_size=self.runner.block_size,
                            num_blocks=self.runner.num_blocks, device=self.runner.device)
        logits = self.runner.execute(batch)
        rows = [i for i, s in enumerate(output.scheduled) if s.needs_sample]
        to_sample = [output.scheduled[i].request for i in rows]
        if rows:
            tokens = self.sampler(logits if len(rows) == logits.shape[0] else logits[rows], to_sample)
        else:
            tokens = []
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += output.num_batched_tokens
        self.stats.num_preemptions += len(output.preempted)
        self.stats.compositions.add(tuple(s.num_new_tokens for s in output.scheduled))
        sampled = {r.request_id: t for r, t in zip(to_sample, tokens)}
        return self.scheduler.update_from_output(output, sampled)
