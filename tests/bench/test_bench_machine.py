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

    def point(x, passed, held, causes=(), seconds=None, reasons=()):
        return {"x": x, "passed": passed, "held": held, "reasons": list(reasons),
                "evidence": {"causes": list(causes),
                             "window": {"seconds": seconds or (300.06 if held else 60.0)}}}

    res = {"curve": [point(2.0, True, False), point(4.0, True, False), point(8.0, False, False, ["queue"]),
                     point(4.0, False, True, ["queue", "ttft_p95"]),
                     point(4.0 / 1.15, False, True, ["ttft_p95"], seconds=100.0)]}
    line = _no_limit_lines(res, by_scale=False, hold_s=300.0)[0]
    # The hold asked for, and how long each ran (one ended at its first third).
    assert line.startswith("**No load held.** The search passed up to 4 in its windows, and every 300 s hold "
                           "failed (a hold is judged at each third")
    assert "4 (queue, ttft_p95, after 300 s); 3.478 (ttft_p95, after 100 s)" in line
    assert "lies below 3.478 req/s. Hold lower" in line and "quieter machine" in line
    assert _no_limit_lines({"curve": [point(2.0, False, False, ["queue"])]}, False, None)[0] == \
        "**No load met the SLO.**"
    # Requests the server shed (its overload protection) are named, with what to change.
    shed = "10 requests failed (first: HTTP 503: {\"error\":{\"code\":\"server_overloaded\"}})"
    res["curve"][-1] = point(4.4, False, True, ["failures"], seconds=20.0, reasons=[shed])
    line = _no_limit_lines(res, by_scale=False, hold_s=60.0)[0]
    assert "every 60 s hold failed" in line and "4.4 (failures, after 20 s)" in line
    assert line.endswith("Note: at 4.4 the server shed requests (HTTP 503 server_overloaded): its overload "
                         "protection refused load before the SLO was judged; for the SLO's own limit, start it "
                         "with --overload-ttft at or above the TTFT target (0: off).")
    assert "quieter machine" not in line


def test_report_warns_when_the_machine_was_busy_before_the_run():
    busy = {**_snap(user=0), "cores": 2, "loadavg": [1.5, 1.0, 0.5]}
    lines = _machine_lines({"machine": {"start": busy, "end": _snap(user=100)}})
    assert any(line.startswith("- **busy before the run**: 1-minute load average 1.5 on 2 cores") for line in lines)
    idle = {**busy, "loadavg": [0.4, 0.3, 0.2]}
    assert not any("busy before" in line for line in _machine_lines({"machine": {"start": idle, "end": idle}}))


def test_console_line_names_shed_requests():
    from inflight.bench.limit import LimitResult, limit_line

    shed = 'HTTP 503: {"error":{"code":"server_overloaded"}}'
    curve = [{"x": 4.0, "load": 4.0, "passed": True, "held": False, "repeat": 0, "reasons": [], "evidence": {}},
             {"x": 4.4, "load": 4.4, "passed": False, "held": True, "repeat": 0,
              "reasons": [f"10 requests failed (first: {shed})"], "evidence": {"causes": ["failures"]}}]
    none = LimitResult(None, [None], [4.4], True, curve=curve, held=True)
    assert limit_line(none, by_scale=False) == (
        "no load held: every hold failed (see the points above); at 4.4 the server shed requests (HTTP 503 "
        "server_overloaded): its overload protection refused load before the SLO was judged; for the SLO's own "
        "limit, start it with --overload-ttft at or above the TTFT target (0: off)")
    curve[1]["held"] = False  # a search point above a limit of 4
    found = LimitResult(None, [4.0], [4.4], True, curve=curve)
    line = limit_line(found, by_scale=False)
    assert line.startswith("operating limit (searched, not held) 4 req/s") and line.endswith("(0: off)")
    curve[1]["reasons"] = ["ttft_p95 2500 ms (upper 3000 ms) > 2000 ms"]
    assert "shed" not in limit_line(found, by_scale=False)
