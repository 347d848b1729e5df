"""What machine a benchmark ran on, and how busy it was: saved with every report.

A step on a 2-core machine takes twice as long when another process holds the second core,
so a capacity figure without the load average beside it cannot be compared. On a virtual
machine the host can also take CPU time from every process at once (``steal`` in
``/proc/stat``, the ``st`` column of ``top``); the load average does not show it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Sequence

from inflight.host_cpu import STAT_FIELDS, isa_summary, process_ticks
from inflight.host_cpu import cpu_ticks as _all_cpu_ticks


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def cpu_ticks() -> dict[str, int] | None:
    """Cumulative CPU time of all cores by state, in clock ticks (``/proc/stat``'s ``cpu``
    line: user, nice, system, idle, iowait, irq, softirq, steal); None off Linux."""
    return _all_cpu_ticks()


def cpu_shares(start: dict[str, Any] | None, end: dict[str, Any] | None) -> dict[str, float] | None:
    """Fractions of all cores' time between two :func:`describe_machine` snapshots: ``busy``
    (not idle, iowait or stolen), ``idle`` and ``steal`` (taken by the hypervisor). None when
    either snapshot lacks ``cpu_ticks`` or no time passed."""
    a, b = (start or {}).get("cpu_ticks"), (end or {}).get("cpu_ticks")
    if not a or not b:
        return None
    d = {k: b.get(k, 0) - a.get(k, 0) for k in STAT_FIELDS}
    total = sum(d.values())
    if total <= 0:
        return None
    idle = d["idle"] + d["iowait"]
    return {"busy": round((total - idle - d["steal"]) / total, 4), "idle": round(idle / total, 4),
            "steal": round(d["steal"] / total, 4)}


def describe_machine() -> dict[str, Any]:
    """CPU model, its instruction-set flags (``isa``) and whether it is a virtual machine
    (``vm``), logical cores, memory (GiB), OS, Python, 1/5/15-minute load averages, time,
    the thread settings in force (``threads``), and ``cpu_ticks`` (for :func:`cpu_shares`
    between two snapshots)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"time": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": _cpu_model(),
            **isa_summary(), "cores": os.cpu_count(), "memory_gib": _mem_total_gib(),
            "os": platform.platform(), "python": platform.python_version(), "loadavg": load,
            "threads": thread_settings(), "cpu_ticks": cpu_ticks()}


# What sets a run's threads and how they wait: two figures taken under different ones are
# not comparable (issue 51).
THREAD_SETTINGS = ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "INFLIGHT_THREADS",
                   "INFLIGHT_CPU_AMX", "INFLIGHT_CPU_ISA", "ONEDNN_MAX_CPU_ISA")


def thread_settings() -> dict[str, str]:
    """The thread and instruction-set settings in this process's environment (unset ones
    left out), and the CPUs it may run on."""
    out = {k: os.environ[k] for k in THREAD_SETTINGS if k in os.environ}
    try:
        out["cpus_allowed"] = str(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        pass
    return out


# A host is busy above these (the search's own 10 % tolerance for stolen time; an idle VM
# stays well under both). Also what makes a fitted profile untrusted (sim.profile).
BUSY_OTHERS_CORES = 0.2
BUSY_STEAL = 0.10


@dataclass
class HostLoad:
    """CPU time on this machine over an interval that processes other than ours took:
    ``others_cores`` (cores' worth, busy time minus this process's and ``pids``' trees) and
    ``steal`` (the hypervisor's share of all cores). A step on a 2-core machine slows by
    about half when another process holds one core, and a capacity measured then is that
    host's at that time, not the server's."""

    seconds: float
    cores: int
    others_cores: float
    steal: float
    busy: float

    def is_busy(self, max_others: float = BUSY_OTHERS_CORES, max_steal: float = BUSY_STEAL) -> bool:
        """Other processes took more than ``max_others`` of a core, or the host more than
        ``max_steal`` of the time (the search's own 10 % tolerance; an idle VM stays well under
        both)."""
        return self.others_cores > max_others or self.steal > max_steal

    def describe(self) -> str:
        return (f"other processes {self.others_cores:.2f} of {self.cores} cores, stolen {self.steal:.0%} "
                f"(over {self.seconds:.0f} s)")

    def to_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 2), "cores": self.cores, "others_cores": round(self.others_cores, 3),
                "steal": round(self.steal, 4), "busy": round(self.busy, 4), "is_busy": self.is_busy()}


class HostMonitor:
    """Measures :class:`HostLoad` between ``start()`` and ``stop()``, counting this process
    and the process trees of ``pids`` (a server it started) as ours; other children of
    this process are not ours unless named."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)
        self._t0 = 0.0
        self._ticks: dict[str, int] | None = None
        self._ours = 0

    def _ours_now(self) -> int:
        return process_ticks(os.getpid(), tree=False) + sum(process_ticks(p) for p in set(self.pids))

    def start(self) -> "HostMonitor":
        self._t0, self._ticks, self._ours = time.monotonic(), cpu_ticks(), self._ours_now()
        return self

    def stop(self) -> HostLoad | None:
        """The load since ``start()``; None off Linux or when no time passed."""
        end, ours = cpu_ticks(), self._ours_now()
        if not self._ticks or not end:
            return None
        d = {k: end.get(k, 0) - self._ticks.get(k, 0) for k in STAT_FIELDS}
        total = sum(d.values())
        if total <= 0:
            return None
        cores = os.cpu_count() or 1
        busy = total - d["idle"] - d["iowait"] - d["steal"]
        others = max(0, busy - (ours - self._ours))
        return HostLoad(time.monotonic() - self._t0, cores, others / total * cores, d["steal"] / total,
                        busy / total)


async def probe_host(seconds: float = 3.0, pids: Sequence[int] = ()) -> HostLoad | None:
    """:class:`HostLoad` over ``seconds`` of our own idleness: what else this machine runs."""
    import asyncio

    monitor = HostMonitor(pids).start()
    await asyncio.sleep(seconds)
    return monitor.stop()
