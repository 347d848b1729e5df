"""The model's thread team follows the CPUs other processes leave it (model/thread_team.py,
issue 51): exact sizes from injected readings on a virtual clock, and one real reading
beside a real busy loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from inflight.model import thread_team
from inflight.model.thread_team import HostSampler, ThreadTeam, Window, make_team, team_size


@pytest.mark.parametrize("others, cpus, most, expected", [
    (0.0, 2, 2, 2), (0.3, 2, 2, 2), (0.49, 2, 2, 2),  # a light neighbour costs nothing
    (0.5, 2, 2, 1), (0.67, 2, 2, 1), (1.0, 2, 2, 1),   # half a core or more costs a thread
    (2.0, 2, 2, 1),                                    # never fewer than one
    (1.4, 8, 8, 7), (3.6, 8, 8, 4), (0.0, 8, 4, 4),    # at most --num-threads
])
def test_team_size(others, cpus, most, expected):
    assert team_size(others, cpus, most) == expected


@pytest.mark.parametrize("others, current, expected", [
    (0.4, 1, 1), (0.49, 1, 1),  # a neighbour at 40-50 %: no flip back
    (0.39, 1, 2), (0.0, 1, 2),  # under 40 %: the core comes back
    (0.3, 2, 2), (0.6, 2, 1),   # from 2, the half-core rule alone
])
def test_a_lost_core_comes_back_under_40_percent(others, current, expected):
    assert team_size(others, 2, 2, current) == expected


@pytest.mark.parametrize("others, waiting, expected", [
    (0.4, 0.4, 1),   # a busy loop that libgomp's spinning worker keeps under half a core
    (0.4, 0.1, 2),   # a neighbour at 40 % whom our threads do not wait for
    (0.1, 0.6, 2),   # our own threads crowding each other: no neighbour to give way to
])
def test_our_threads_waiting_beside_a_neighbour_cost_a_thread(others, waiting, expected):
    assert team_size(others, 2, 2, 2, waiting) == expected


class Script:
    """Readings that advance by the given per-window others' cores, on 2 CPUs at 100 Hz."""

    def __init__(self):
        self.window = Window(busy=0, ours=0, total=0)

    def then(self, others_cores: float, ours_cores: float = 1.0, seconds: float = 0.25,
             waiting_cores: float = 0.0):
        ticks = int(seconds * 100)
        w = self.window
        self.window = Window(busy=w.busy + int((others_cores + ours_cores) * ticks),
                             ours=w.ours + int(ours_cores * ticks), total=w.total + 2 * ticks,
                             waited_s=w.waited_s + waiting_cores * seconds)

    def __call__(self, cpus):
        return self.window


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def scripted_team():
    # a team of two from two threads, whatever an earlier engine of this process left set
    torch.set_num_threads(2)
    script = Script()
    sampler = HostSampler(frozenset({0, 1}), reader=script)
    sampler.sample()  # the baseline
    return script, sampler, ThreadTeam(max_threads=2, sampler=sampler)


def test_each_window_decides_with_a_margin_to_grow(restore_threads):
    script, sampler, team = scripted_team()
    sizes = []
    for others in [0.0, 0.9, 1.0, 0.45, 0.1, 0.0]:
        script.then(others)
        sampler.sample()
        sizes.append(team.adapt())
    # 0.9 of a core busy -> 1 at once; 0.45 keeps it; 0.1 gives it back
    assert sizes == [2, 1, 1, 1, 2, 2]
    assert team.changes == 2 and torch.get_num_threads() == 2
    script.then(0.4, waiting_cores=0.45)  # the collapse: the loop held under half a core
    sampler.sample()
    assert team.adapt() == 1 and sampler.waiting_cores == pytest.approx(0.45)


def test_a_verdict_is_applied_once_and_only_by_adapt(restore_threads):
    script, sampler, team = scripted_team()
    script.then(1.0)
    sampler.sample()
    assert torch.get_num_threads() == 2  # the sampler decides nothing on its own
    assert team.adapt() == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(2)  # someone else's change is not fought step after step
    assert team.adapt() == 1 and torch.get_num_threads() == 2


def test_the_shared_sampler_reads_while_the_engine_is_idle():
    # A neighbour that arrives while no step runs is seen before the next request.
    sampler = thread_team.shared_sampler()
    assert sampler is thread_team.shared_sampler()
    before = sampler.readings
    time.sleep(3 * thread_team.INTERVAL_S)
    assert sampler.readings >= before + 1


def test_fixed_keeps_the_count_and_another_policy_is_refused():
    assert make_team(torch.device("cpu"), {"INFLIGHT_THREADS": "fixed"}) is None
    assert isinstance(make_team(torch.device("cpu"), {}), ThreadTeam)
    with pytest.raises(ValueError, match="adaptive .* or fixed"):
        make_team(torch.device("cpu"), {"INFLIGHT_THREADS": "spin"})


BUSY = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n    pass\n"


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads /proc; needs two CPUs")
def test_a_real_busy_loop_is_read_as_others():
    # The counters are real: a child holding a core shows as about one core of others,
    # while this process sleeps (a loaded CI host may add more, never less).
    cpus = frozenset(os.sched_getaffinity(0))
    before = thread_team.read_window(cpus)
    loop = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(1.5)
        after = thread_team.read_window(cpus)
    finally:
        loop.kill()
        loop.wait()
    others = ((after.busy - before.busy) - (after.ours - before.ours)) / (after.total - before.total)
    assert others * len(cpus) > 0.7
    assert after.waited_s >= before.waited_s  # the run-queue counters are read too

