"""The machine record saved with every report: load average and the CPU time the host took."""

from __future__ import annotations

import sys

import pytest

from inflight.bench.machine import cpu_shares, describe_machine
from inflight.bench.report_page import _machine_lines


def _snap(**ticks):
    base = dict.fromkeys(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), 0)
    return {"cpu_ticks": {**base, **ticks}, "loadavg": [1.0, 1.0, 1.0]}


def test_cpu_shares_split_busy_idle_and_steal():
    start = _snap(user=100, idle=100)
    end = _snap(user=100 + 500, system=100, idle=100 + 300, iowait=50, steal=50)
    # 1000 ticks passed: 600 busy (user + system), 350 idle (idle + iowait), 50 stolen.
    assert cpu_shares(start, end) == {"busy": 0.6, "idle": 0.35, "steal": 0.05}
    assert cpu_shares(start, start) is None and cpu_shares({}, end) is None


def test_report_flags_a_contended_host():
    start, end = _snap(user=0), _snap(user=700, steal=300)
    lines = _machine_lines({"machine": {"start": start, "end": end}})
    assert lines[-1].startswith("- CPU time over the run, all cores: 70% busy, 0% idle, 30% stolen")
    assert "contended virtual machine" in lines[-1]
    calm = _machine_lines({"machine": {"start": start, "end": _snap(user=990, steal=10)}})
    assert "1% stolen by the host" in calm[-1] and "contended" not in calm[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_describe_machine_reads_proc_stat():
    ticks = describe_machine()["cpu_ticks"]
    assert set(ticks) == {"user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"}
    assert ticks["user"] + ticks["idle"] > 0


def test_report_says_why_there_is_no_limit():
    from inflight.bench.report_page import _no_limit_lines

    def point(x, passed, held, causes=()):
        return {"x": x, "passed": passed, "held": held,
                "evidence": {"causes": list(causes), "window": {"seconds": 300.06 if held else 60.0}}}

    res = {"curve": [point(2.0, True, False), point(4.0, True, False), point(8.0, False, False, ["queue"]),
                     point(4.0, False, True, ["queue", "ttft_p95"]), point(4.0 / 1.15, False, True, ["ttft_p95"])]}
    line = _no_limit_lines(res, by_scale=False)[0]
    assert line.startswith("**No load held.** The search passed up to 4 in its windows, and every 300 s hold")
    assert "4 (queue, ttft_p95); 3.478 (ttft_p95)" in line
    assert _no_limit_lines({"curve": [point(2.0, False, False, ["queue"])]}, False)[0] == "**No load met the SLO.**"


def test_report_warns_when_the_machine_was_busy_before_the_run():
    busy = {**_snap(user=0), "cores": 2, "loadavg": [1.5, 1.0, 0.5]}
    lines = _machine_lines({"machine": {"start": busy, "end": _snap(user=100)}})
    assert any(line.startswith("- **busy before the run**: 1-minute load average 1.5 on 2 cores") for line in lines)
    idle = {**busy, "loadavg": [0.4, 0.3, 0.2]}
    assert not any("busy before" in line for line in _machine_lines({"machine": {"start": idle, "end": idle}}))
