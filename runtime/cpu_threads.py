"""How many intra-op threads the CPU step runs with, chosen from what the other processes leave.

A step's OpenMP threads meet at a barrier after every parallel op, so one thread that shares its
core with another busy process holds back all of them: on a 2-core machine with one other
CPU-bound process, W1 took 2.8x its idle time with 2 threads and 1.5x with 1 (docs/cpu-kernels.md).
vLLM's CPU backend fixes its threads at start (``VLLM_CPU_OMP_THREADS_BIND``, with
``VLLM_CPU_NUM_OF_RESERVED_CPU`` cores left to its frontend); a machine's load changes while a
server runs, so here the count follows it: every :data:`INTERVAL_S` the stepping thread reads
``/proc/stat`` (the time the CPUs it may run on were busy) and ``/proc/self/stat`` (this process's
own share of it), and runs with the CPUs the others left free, between 1 and its ceiling.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

INTERVAL_S = 1.0  # seconds between two readings of the CPU times
SLACK = 0.35      # CPUs: others' use below this much of a CPU leaves that CPU free


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def read_cpu_times(cpus: set[int]) -> tuple[int, int, int] | None:
    """``(busy, total, own)`` clock ticks so far: busy and total summed over ``cpus`` from
    ``/proc/stat`` (busy: user, nice, system, irq, softirq, steal; total adds idle and iowait), own
    this process's user + system time from ``/proc/self/stat``. None where there is no ``/proc``."""
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
                    continue
                user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
                busy += user + nice + system + irq + softirq + steal
                total += user + nice + system + idle + iowait + irq + softirq + steal
        with open("/proc/self/stat") as f:  # fields after the command name, which may hold spaces
            rest = f.read().rpartition(")")[2].split()
        own = int(rest[11]) + int(rest[12])  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None
    return busy, total, own


class CpuThreads:
    """The intra-op thread count of the thread that steps (``torch.set_num_threads`` is per thread).

    ``num_threads``: a fixed count, or None to follow the load between 1 and the ceiling: the
    thread count torch had when this was made (``OMP_NUM_THREADS`` or ``torch.set_num_threads``
    given by the user fix it: their choice wins, as in vLLM), less ``reserved_cpus`` left to the
    rest of the process (an HTTP server's threads, as vLLM's reserved CPU), at least 1.
    ``read`` is :func:`read_cpu_times` (tests pass their own).

    Raises:
        ValueError: ``num_threads`` not a positive int or None; ``reserved_cpus`` not an int in
            ``[0, CPUs this process may use)``.
    """

    def __init__(self, num_threads: int | None = None, reserved_cpus: int = 0, *,
                 read: Callable[[set[int]], tuple[int, int, int] | None] = read_cpu_times):
        self.check(num_threads, reserved_cpus)
        self.cpus, self._read = allowed_cpus(), read
        self.adaptive = num_threads is None and "OMP_NUM_THREADS" not in os.environ  # the user's count wins
        self.ceiling = num_threads or max(1, min(torch.get_num_threads(), len(self.cpus) - reserved_cpus))
        self.current = self.ceiling
        self._last: tuple[float, tuple[int, int, int]] | None = None
        self._pending: int | None = None  # a change seen once; made when the next reading agrees

    def describe(self) -> str:
        """What the count is, for a start-up line: ``"1-2 threads, following the load"`` or ``"2 threads"``."""
        if self.adaptive and self.ceiling > 1:
            return f"1-{self.ceiling} threads, following the load (--num-threads fixes it)"
        return f"{self.ceiling} thread{'s' if self.ceiling > 1 else ''}"

    @staticmethod
    def check(num_threads, reserved_cpus) -> None:
        """``ValueError`` naming the argument unless ``num_threads`` is a positive int or None and
        ``reserved_cpus`` an int in ``[0, CPUs this process may use)``."""
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads: expected a positive int or None (follow the load), got {num_threads!r}")
        n = len(allowed_cpus())
        if isinstance(reserved_cpus, bool) or not isinstance(reserved_cpus, int) or not 0 <= reserved_cpus < n:
            raise ValueError(f"reserved_cpus: expected an int in [0, {n}) (this process may use {n} CPUs), "
                             f"got {reserved_cpus!r}")

    def others_busy(self, before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
        """CPUs the other processes kept busy between two readings (0 .. len(cpus))."""
        busy, total, own = (a - b for a, b in zip(after, before))
        if total <= 0:
            return 0.0
        return max(0.0, (busy - own) * len(self.cpus) / total)

    def target(self, others: float) -> int:
        """Threads for ``others`` busy CPUs: the CPUs they leave free, between 1 and the ceiling."""
        return max(1, min(self.ceiling, math.floor(len(self.cpus) - others + SLACK)))

    def apply(self) -> int:
        """Set the calling thread's count (at the first call, and after a change); returns it.
        Call it from the thread that steps, before each step: it reads the CPU times at most every
        :data:`INTERVAL_S`, and changes the count only when two readings in a row ask for it."""
        now = time.monotonic()
        if self.adaptive and (self._last is None or now - self._last[0] >= INTERVAL_S):
            reading = self._read(self.cpus)
            if reading is None:
                self.adaptive = False
            elif self._last is None:
                self._last = (now, reading)
            else:
                want = self.target(self.others_busy(self._last[1], reading))
                self._last = (now, reading)
                if want == self.current:
                    self._pending = None
                elif self._pending == want:
                    self.current, self._pending = want, None
                else:
                    self._pending = want
        if torch.get_num_threads() != self.current:
            torch.set_num_threads(self.current)
        return self.current
