"""Backpressure: a request whose reader stops taking its outputs stops being scheduled.

The engine hands each request's deltas to its reader through a queue; a reader that does not read
(an HTTP client that never reads its stream: the server's socket and write buffer fill, and the
server stops taking deltas) would let that queue grow by every step's tokens, with their logprobs,
for as long as the request runs. :class:`OutputFlows` counts each request's tokens handed out and
not yet taken: past ``max_unsent_tokens``, in more than one delta (a reader that takes each step's
delta is never paused, however large the step), the request is paused (taken out of the scheduler,
its KV blocks freed as a preemption frees them), and once its reader has taken the queue down to
half of that, or emptied it, it is resumed (queued again, its KV recomputed). A request paused for longer than
``stall_timeout_s`` is aborted (None: never). What a paused request holds is its unsent deltas
(at most ``max_unsent_tokens`` tokens, and one step's tokens more) and its tokens so far.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

MAX_UNSENT_TOKENS = 4096


@dataclass(frozen=True)
class FlowControl:
    """``max_unsent_tokens``: a request's tokens handed out and not taken by its reader (all its
    completions together) past which it is paused (None: never); ``stall_timeout_s``: seconds a
    request may stay paused before it is aborted (None: never)."""

    max_unsent_tokens: int | None = MAX_UNSENT_TOKENS
    stall_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_unsent_tokens is not None and (not isinstance(self.max_unsent_tokens, int)
                                                   or self.max_unsent_tokens < 1):
            raise ValueError(f"max_unsent_tokens: expected an int >= 1 or None, got {self.max_unsent_tokens!r}")
        if self.stall_timeout_s is not None and not (isinstance(self.stall_timeout_s, (int, float))
                                                     and self.stall_timeout_s > 0):
            raise ValueError(f"stall_timeout_s: expected a number > 0 or None, got {self.stall_timeout_s!r}")


class OutputFlows:
    """Per live request: tokens handed out and not yet taken, and since when it is paused. Not
    thread-safe: the engine loop calls it under its lock."""

    def __init__(self, control: FlowControl = FlowControl()):
        self.control = control
        self._unsent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, deltas) handed out, not taken
        self._paused_since: dict[str, float] = {}

    def delivered(self, request_id: str, num_tokens: int) -> bool:
        """A delta of ``num_tokens`` was handed to the reader of ``request_id``; True: pause it now."""
        tokens, deltas = self._unsent.get(request_id, (0, 0))
        tokens, deltas = self._unsent[request_id] = tokens + num_tokens, deltas + 1
        limit = self.control.max_unsent_tokens
        if limit is None or tokens <= limit or deltas < 2 or request_id in self._paused_since:
            return False
        self._paused_since[request_id] = time.monotonic()
        return True

    def taken(self, request_id: str, num_tokens: int) -> bool:
        """The reader took a delta of ``num_tokens``; True: resume the paused request now."""
        if request_id not in self._unsent:
            return False
        tokens, deltas = self._unsent[request_id]
        tokens, deltas = self._unsent[request_id] = max(0, tokens - num_tokens), max(0, deltas - 1)
        half = (self.control.max_unsent_tokens or 0) // 2
        if request_id in self._paused_since and (deltas == 0 or tokens <= half):
            del self._paused_since[request_id]
            return True
        return False

    def ended(self, request_id: str) -> None:
        """``request_id`` finished: forget it."""
        self._unsent.pop(request_id, None)
        self._paused_since.pop(request_id, None)

    def is_paused(self, request_id: str) -> bool:
        return request_id in self._paused_since

    def stalled(self) -> list[str]:
        """The requests paused for longer than ``stall_timeout_s`` (to abort)."""
        timeout = self.control.stall_timeout_s
        if timeout is None or not self._paused_since:
            return []
        now = time.monotonic()
        return [rid for rid, since in self._paused_since.items() if now - since > timeout]

    def until_stalled(self) -> float | None:
        """Seconds until the first paused request stalls (0 if one has), None if none can."""
        timeout = self.control.stall_timeout_s
        if timeout is None or not self._paused_since:
            return None
        return max(0.0, min(self._paused_since.values()) + timeout - time.monotonic())

    @property
    def num_paused(self) -> int:
        return len(self._paused_since)
