"""What machine a benchmark ran on, and how busy it was: saved with every report.

A step on a 2-core machine takes twice as long when another process holds the second core,
so a capacity figure without the load average beside it cannot be compared.
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


def describe_machine() -> dict:
    """CPU model, logical cores, memory (GiB), OS, Python, 1/5/15-minute load averages, time."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"time": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": _cpu_model(),
            "cores": os.cpu_count(), "memory_gib": _mem_total_gib(), "os": platform.platform(),
            "python": platform.python_version(), "loadavg": load}
