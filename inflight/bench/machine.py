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


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> dict[str, int] | None:
    """Cumulative CPU time of all cores by state, in clock ticks (``/proc/stat``'s ``cpu``
    line: user, nice, system, idle, iowait, irq, softirq, steal); None off Linux."""
    try:
        with open("/proc/stat") as f:
            head = f.readline().split()
    except OSError:
        return None
    if not head or head[0] != "cpu":
        return None
    return dict(zip(_STAT_FIELDS, map(int, head[1:1 + len(_STAT_FIELDS)])))


def cpu_shares(start: dict | None, end: dict | None) -> dict[str, float] | None:
    """Fractions of all cores' time between two :func:`describe_machine` snapshots: ``busy``
    (not idle, iowait or stolen), ``idle`` and ``steal`` (taken by the hypervisor). None when
    either snapshot lacks ``cpu_ticks`` or no time passed."""
    a, b = (start or {}).get("cpu_ticks"), (end or {}).get("cpu_ticks")
    if not a or not b:
        return None
    d = {k: b.get(k, 0) - a.get(k, 0) for k in _STAT_FIELDS}
    total = sum(d.values())
    if total <= 0:
        return None
    idle = d["idle"] + d["iowait"]
    return {"busy": round((total - idle - d["steal"]) / total, 4), "idle": round(idle / total, 4),
            "steal": round(d["steal"] / total, 4)}


def describe_machine() -> dict:
    """CPU model, logical cores, memory (GiB), OS, Python, 1/5/15-minute load averages, time,
    and ``cpu_ticks`` (for :func:`cpu_shares` between two snapshots)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"time": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": _cpu_model(),
            "cores": os.cpu_count(), "memory_gib": _mem_total_gib(), "os": platform.platform(),
            "python": platform.python_version(), "loadavg": load, "cpu_ticks": cpu_ticks()}
