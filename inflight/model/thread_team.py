"""The model's CPU threads: as many as the CPUs other processes leave it, re-read as it runs.

Why (issue 51, docs/performance.md "Threads"): the model's kernels and PyTorch's ops run on
one OpenMP team, and a decode step opens and closes a parallel region per kernel (about 120
with two threads for the bundled model). Between regions libgomp's workers spin
(``GOMP_SPINCOUNT``, 300,000 pauses by default) and then sleep; on a KVM guest waking a
sleeping worker took 80 us a region, so a bounded spin (the CLI's ``GOMP_SPINCOUNT=300``
until issue 51) made one stream 2.3x slower on an Intel host. Spinning is wrong only while
another process holds one of the team's cores: the team's thread there runs part of the
time, its teammate spins at every barrier, and a step collapses (50-80x). No spin setting
fixed at import serves both, so the spin stays libgomp's and the team changes size instead:
it drops the cores others hold and takes them back once they are free. A team of one has no
barriers to spin at, and beside a busy neighbour runs at the speed of the core it has.

The measure (``HostSampler``, one daemon thread a process, 10 readings a second whether or
not the engine is busy, so a request that arrives beside a new neighbour starts on the right
team): over each window, the busy ticks of the CPUs this process may run on minus this
process's own (``host_cpu``): the cores' worth others took; and the seconds this process's
threads waited in the run queue. Others holding half a core or more cost the team a thread
(rounded half up), and so do others holding a quarter while our threads waited a quarter of
a core's time: beside a pinned busy loop libgomp's spinning worker can win more than half
of the shared core, the loop less, and the step still collapses. A core comes back once
others hold less than 40 % of it (``GROW_MARGIN``: a neighbour at 40-50 % does not make the
team flip each window; a bench client's 20-35 % while it streams does not keep a core away
after its start-up burst). The user's ``--num-threads`` (or ``torch.get_num_threads()`` at
start) is the most it takes; ``INFLIGHT_THREADS=fixed`` keeps that many whatever the host
does.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from inflight.host_cpu import CLOCK_TICKS, busy_ticks, cpu_ticks, process_ticks, run_queue_wait_s

logger = logging.getLogger(__name__)

INTERVAL_S = 0.1    # a window: 10 ticks a CPU at 100 Hz; a reading costs ~0.2 ms
GROW_MARGIN = 0.4   # a core lost at half held by others comes back under 40 %
CONTENDED = 0.25    # others' cores and our run-queue wait (cores) that together cost a thread


def team_size(others_cores: float, cpus: int, max_threads: int, current: int | None = None,
              waiting_cores: float = 0.0) -> int:
    """Threads for a team when other processes took ``others_cores`` cores' worth of the
    ``cpus`` it may run on: one fewer per core they hold (half a core or more counts as
    one; a quarter, when this process's threads waited ``waiting_cores`` >= a quarter in the
    run queue), at least 1, at most ``max_threads``. From a ``current`` size, a lost core
    comes back only once others hold less than ``GROW_MARGIN`` of it."""
    others = max(0.0, others_cores)
    lost = math.floor(others + 0.5)
    if lost == 0 and others >= CONTENDED and waiting_cores >= CONTENDED:
        lost = 1
    size = max(1, min(max_threads, cpus - lost))
    if current is not None and size > current:
        # cores others still hold by the growing rule: whole ones, and a part of GROW_MARGIN
        held = math.floor(others) + (others - math.floor(others) >= GROW_MARGIN)
        size = max(current, min(size, cpus - held))
    return size


@dataclass
class Window:
    """One reading: the CPUs' busy ticks, this process's ticks, their total ticks, and the
    seconds this process's threads have waited in the run queue (0 where unknown)."""

    busy: int
    ours: int
    total: int
    waited_s: float = 0.0


def read_window(cpus: frozenset[int]) -> Window | None:
    """The counters now, over ``cpus``; None off Linux."""
    ticks = cpu_ticks(cpus)
    if ticks is None:
        return None
    pid = os.getpid()
    return Window(busy_ticks(ticks), process_ticks(pid, tree=False), sum(ticks.values()),
                  run_queue_wait_s(pid) or 0.0)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity; a cgroup's cpuset shows there)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class HostSampler:
    """The last window's ``others_cores`` and ``waiting_cores`` over ``cpus``, refreshed by
    ``sample`` (every ``interval_s`` on a daemon thread once ``start`` is called).

    Args:
        reader: the counters (``read_window``; injectable for tests).
    """

    def __init__(self, cpus: frozenset[int], interval_s: float = INTERVAL_S,
                 reader: Callable[[frozenset[int]], Window | None] = read_window) -> None:
        self.cpus, self.interval_s, self._reader = cpus, interval_s, reader
        self.others_cores = 0.0
        self.waiting_cores = 0.0
        self.readings = 0  # windows judged so far
        self._last: Window | None = None
        self._stop = threading.Event()

    def sample(self) -> None:
        """Read the counters and judge the window since the last reading."""
        window = self._reader(self.cpus)
        if window is None:
            return
        last, self._last = self._last, window
        if last is None or window.total <= last.total:
            return
        elapsed = window.total - last.total
        others = max(0, (window.busy - last.busy) - (window.ours - last.ours))
        seconds = elapsed / len(self.cpus) / CLOCK_TICKS
        self.others_cores = others / elapsed * len(self.cpus)
        self.waiting_cores = max(0.0, window.waited_s - last.waited_s) / seconds
        self.readings += 1

    def start(self) -> HostSampler:
        threading.Thread(target=self._run, name="inflight-host-sampler", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a reading must never take the process down
                logger.exception("reading the host's CPU counters failed; the team stays as it is")
                return


_shared: HostSampler | None = None
_shared_lock = threading.Lock()


def shared_sampler() -> HostSampler:
    """The process's one sampler (every engine of the process reads the same host),
    started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = HostSampler(allowed_cpus()).start()
        return _shared


class ThreadTeam:
    """Sizes the model's threads (``torch.set_num_threads``, which the native kernels read
    too) to the CPUs free of other processes. ``adapt`` runs on the thread that runs the
    model (OpenMP's thread count is that thread's setting), before each step.

    Args:
        max_threads: the most threads (``--num-threads``; default the threads torch has).
        sampler: the host's readings (default the process's shared one).
    """

    def __init__(self, max_threads: int | None = None, sampler: HostSampler | None = None) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.sampler = shared_sampler() if sampler is None else sampler
        self.threads = self.max_threads
        self.changes = 0
        self._judged = 0

    def adapt(self) -> int:
        """Apply the latest window's verdict (once per window). Returns the size in force."""
        s = self.sampler
        if s.readings == self._judged:
            return self.threads
        self._judged = s.readings
        target = team_size(s.others_cores, len(s.cpus), self.max_threads, self.threads,
                           s.waiting_cores)
        if target != self.threads:
            logger.info("threads %d -> %d: other processes took %.2f of %d cores, this one's "
                        "threads waited %.2f", self.threads, target, s.others_cores,
                        len(s.cpus), s.waiting_cores)
            self.threads = target
            self.changes += 1
            torch.set_num_threads(target)
        return self.threads


def thread_policy(environ: Mapping[str, str] | None = None) -> str:
    """``INFLIGHT_THREADS``: ``adaptive`` (the default) or ``fixed``.

    Raises:
        ValueError: any other value (checked at start, before the model loads).
    """
    policy = (os.environ if environ is None else environ).get("INFLIGHT_THREADS", "adaptive")
    if policy not in ("adaptive", "fixed"):
        raise ValueError(f"INFLIGHT_THREADS={policy!r}: adaptive (the default) or fixed")
    return policy


def make_team(device: torch.device, environ: Mapping[str, str] | None = None) -> ThreadTeam | None:
    """The team for a model on ``device``: None off CPU, or where ``INFLIGHT_THREADS=fixed``
    asks for the thread count to stay as it is.

    Raises:
        ValueError: ``INFLIGHT_THREADS`` other than ``adaptive`` or ``fixed``.
    """
    if device.type != "cpu" or thread_policy(environ) == "fixed":
        return None
    return ThreadTeam()


def describe_threads(device: torch.device) -> str:
    """The start-up line's account of the threads and the CPU path: count, policy, the
    instruction-set path the kernels take and the prompt GEMM's."""
    from inflight.model.kernels.gemm import gemm_path
    from inflight.model.kernels.native_lib import isa_path

    if device.type != "cpu":
        return f"on {device}"
    policy = thread_policy()
    how = ("sized to the cores other processes leave" if policy == "adaptive"
           else "fixed (INFLIGHT_THREADS=fixed)")
    return (f"{torch.get_num_threads()} CPU threads, {how}; kernels' path {isa_path()}, "
            f"prompt GEMM {gemm_path(torch.bfloat16)} (bfloat16) / {gemm_path(torch.float32)} "
            f"(float32)")
