"""The CPU step's thread policy (``runtime/cpu_threads.py``): the count follows what other
processes leave free, with two agreeing readings per change; fixed counts and ``OMP_NUM_THREADS``
win; bad arguments are refused by name. Readings are made up here (a real machine's load is not
the test's to set); ``read_cpu_times`` is checked against this process's own CPU time."""
import argparse
import time

import pytest
import torch

from pagedpack import EngineArgs
from pagedpack.runtime import cpu_threads
from pagedpack.runtime.cpu_threads import CpuThreads, read_cpu_times


@pytest.fixture
def four_cpus(monkeypatch):
    """Four CPUs allowed, readings at every call, no OMP_NUM_THREADS (the suite sets it); torch's
    thread count restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_threads, "INTERVAL_S", 0.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


class Readings:
    """Cumulative ``(busy, total, own)`` ticks over 4 CPUs, 100 ticks of wall time per CPU per
    reading: ``others`` CPUs kept busy by other processes, ``own`` by this one."""

    def __init__(self):
        self.busy = self.total = self.own_ticks = 0
        self.others, self.own = 0.0, 2.0

    def __call__(self, cpus):
        assert cpus == {0, 1, 2, 3}
        self.busy += round(100 * (self.others + self.own))
        self.total += 400
        self.own_ticks += round(100 * self.own)
        return self.busy, self.total, self.own_ticks


def test_the_count_follows_the_cpus_others_leave_free(four_cpus):
    readings = Readings()
    policy = CpuThreads(read=readings)
    assert (policy.adaptive, policy.ceiling, policy.apply()) == (True, 4, 4)  # the first reading
    readings.others = 2.0  # two CPUs taken: the first reading asking for 2 only marks it
    assert policy.apply() == 4
    assert policy.apply() == 2 and torch.get_num_threads() == 2
    readings.others = 1.1  # one CPU and a bit: 4 - 1.1 + 0.35 -> 3
    policy.apply()
    assert policy.apply() == 3
    readings.others = 3.9  # every CPU but a sliver: still one thread
    policy.apply()
    assert policy.apply() == 1 and torch.get_num_threads() == 1
    readings.others = 0.0
    assert policy.apply() == 1  # one idle reading is not enough
    readings.others = 3.9
    assert policy.apply() == 1  # and the pending change is dropped
    readings.others = 0.3  # below SLACK of a CPU: every CPU counts as free
    policy.apply()
    assert policy.apply() == 4 and torch.get_num_threads() == 4


def test_own_time_is_not_counted_as_others(four_cpus):
    readings = Readings()
    readings.own = 4.0  # this process alone keeps every CPU busy
    policy = CpuThreads(read=readings)
    for _ in range(4):
        assert policy.apply() == 4


def test_reserved_cpus_lower_the_ceiling(four_cpus):
    policy = CpuThreads(reserved_cpus=1, read=Readings())
    assert (policy.ceiling, policy.apply(), torch.get_num_threads()) == (3, 3, 3)
    assert policy.describe() == "1-3 threads, following the load (--num-threads fixes it)"
    assert CpuThreads(1, read=Readings()).describe() == "1 thread"


@pytest.mark.parametrize("given", ["num_threads", "OMP_NUM_THREADS"])
def test_a_count_the_user_gives_is_kept(four_cpus, monkeypatch, given):
    def no_reading(cpus):
        raise AssertionError("a fixed count reads no CPU times")

    if given == "num_threads":
        policy = CpuThreads(3, read=no_reading)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        policy = CpuThreads(read=no_reading)
    assert not policy.adaptive
    for _ in range(3):
        assert policy.apply() == 3 and torch.get_num_threads() == 3


def test_without_proc_the_count_stays(four_cpus):
    policy = CpuThreads(read=lambda cpus: None)
    assert policy.apply() == 4 and not policy.adaptive


def test_read_cpu_times_counts_this_process():
    cpus = cpu_threads.allowed_cpus()
    before = read_cpu_times(cpus)
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU time
        pass
    after = read_cpu_times(cpus)
    busy, total, own = (a - b for a, b in zip(after, before))
    assert 20 <= own <= total and own <= busy + 5  # clock ticks (100 per second); /proc rounds per CPU


@pytest.mark.parametrize("kwargs, message", [
    ({"num_threads": 0}, "num_threads: expected a positive int or None"),
    ({"num_threads": "2"}, "num_threads: expected a positive int or None"),
    ({"num_threads": True}, "num_threads: expected a positive int or None"),
    ({"reserved_cpus": -1}, "reserved_cpus: expected an int in [0, "),
    ({"reserved_cpus": len(cpu_threads.allowed_cpus())}, "reserved_cpus: expected an int in [0, "),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        EngineArgs(model="tiny", **kwargs)


def test_cli_options():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    cli = ["--model", "tiny", "--num-threads", "1", "--reserved-cpus", "1"]
    args = EngineArgs.from_cli_args(parser.parse_args(cli))
    assert (args.num_threads, args.reserved_cpus) == (1, 1)
