"""The host's CPU: its instruction-set flags and whether it is a virtual machine
(``/proc/cpuinfo``), and CPU time by whom: all cores' states (``/proc/stat``) and a process
tree's own ticks (``/proc/<pid>/stat``), so "what other processes took" is one subtraction.
Read by the bench's host records and monitor (``bench/machine.py``), the kernels' path
choice (``model/kernels/native_lib.py``) and the model's thread team
(``model/thread_team.py``). Linux only: elsewhere every reader answers None, empty or 0.

Units: clock ticks (``USER_HZ``, 100 a second on Linux), as the kernel reports them.
"""

from __future__ import annotations

import os
from collections.abc import Collection

def cpu_flags() -> set[str]:
    """The first CPU's ``flags`` in ``/proc/cpuinfo`` (``avx2``, ``avx512f``, ``amx_tile``,
    ``hypervisor``, ...); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


# The flags that decide the kernels' paths and a result's speed (docs/architecture.md,
# "Batch invariance"), named as a benchmark record shows them.
ISA_FLAGS = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f",
             "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16", "amx_tile": "amx",
             "amx_bf16": "amx_bf16", "amx_int8": "amx_int8"}


def isa_summary(flags: set[str] | None = None) -> dict[str, object]:
    """Which of ``ISA_FLAGS`` this CPU has, and whether it runs under a hypervisor (the
    ``hypervisor`` flag a guest's CPU reports)."""
    flags = cpu_flags() if flags is None else flags
    return {"isa": [name for flag, name in ISA_FLAGS.items() if flag in flags],
            "vm": "hypervisor" in flags}


# /proc/stat's columns after the name, in order (proc(5)).
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks(cpus: Collection[int] | None = None) -> dict[str, int] | None:
    """Cumulative CPU time by state (``STAT_FIELDS``): of all cores (``/proc/stat``'s ``cpu``
    line), or summed over the ``cpuN`` lines of ``cpus``. None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    if cpus is None:
        rows = [r for r in lines if r[0] == "cpu"]
    else:
        wanted = {f"cpu{c}" for c in cpus}
        rows = [r for r in lines if r[0] in wanted]
    if not rows:
        return None
    return {k: sum(int(r[1 + i]) for r in rows if len(r) > 1 + i)
            for i, k in enumerate(STAT_FIELDS)}


def busy_ticks(ticks: dict[str, int]) -> int:
    """Ticks some process ran: all but idle, iowait and stolen (the hypervisor's)."""
    return sum(ticks.values()) - ticks["idle"] - ticks["iowait"] - ticks["steal"]


def process_ticks(pid: int, tree: bool = True) -> int:
    """User + system CPU ticks of ``pid`` (all its threads) and, with ``tree``, its
    descendants; 0 where it is gone or off Linux."""
    if not tree:
        return _own_ticks(pid)
    children: dict[int, list[int]] = {}
    own: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        own[int(entry)] = int(fields[11]) + int(fields[12])
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += own.get(p, 0)
        todo += children.get(p, [])
    return total


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command's ")": state, ppid, ... (utime is index 11,
    stime 12); None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _own_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[11]) + int(fields[12])


def run_queue_wait_s(pid: int) -> float | None:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU, summed over
    its live threads (``/proc/<pid>/task/*/schedstat``, second field, nanoseconds); None
    where the kernel keeps no such counters (no ``CONFIG_SCHED_INFO``) or off Linux."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total, seen = 0, False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
                seen = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if seen else None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
