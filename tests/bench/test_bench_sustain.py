"""The sustained-load verdict on hand-made records: every evidence field recomputed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inflight.bench.client import RequestRecord
from inflight.bench.summary import parse_slo
from inflight.bench.censoring import censored_metrics
from inflight.bench.queue_trend import in_flight_at, queue_growth
from inflight.bench.sustain import Thresholds, Window, judge

WINDOW = Window(start=1.0, end=11.0, deadline=16.0)


def rec(i, t, ttft=0.2, e2e=0.5, phase=None, ok=True, unfinished=False):
    """A request arriving (and sent) at t: first token after ttft, last after e2e (s)."""
    phase = phase or ("warmup" if t < WINDOW.start else "sample" if t < WINDOW.end else "cooldown")
    chunks = [] if unfinished else [t + ttft, t + e2e]
    end = WINDOW.deadline if unfinished else t + e2e
    return RequestRecord(i, t, send_time=t, chunk_times=chunks, end_time=end, success=ok and not unfinished,
                         output_tokens=2, phase=phase, warmup=phase != "sample", unfinished=unfinished,
                         error=None if ok and not unfinished else "x")


def steady(rate=10.0, **kw):
    n = int(12 * rate)  # 0 .. 12 s: warm-up, window, and one second of cool-down
    return [rec(i, i / rate, **kw) for i in range(n)]


def test_steady_load_passes_with_exact_evidence():
    records = steady()
    v = judge(records, WINDOW, parse_slo("ttft_p95=0.3,e2e_p95=1"), preemptions=12.0)
    assert v.passed and v.reasons == [] and v.evidence["causes"] == []
    ev = v.evidence
    # Arrivals at 1.0, 1.1, ..., 10.9: 100 in the 10 s window.
    assert ev["sample"] == 100 and ev["offered_rate"] == pytest.approx(10.0)
    # Completions in [1, 11): arrivals 0.5 .. 10.4 end at 1.0 .. 10.9: exactly 100.
    assert ev["completed_in_window"] == 100 and ev["rate_ratio"] == pytest.approx(1.0)
    assert ev["shortfall"] == 0
    assert ev["shortfall_allowed"] == pytest.approx(0.05 * 100 + 2 * math.sqrt(2) * ev["in_flight_sd"])
    # Always 5 in flight (0.5 s each at 10/s): no trend.
    assert ev["queue"]["growth"] == pytest.approx(0.0, abs=0.3)
    assert ev["queue"]["mean_in_flight"] == pytest.approx(5.0, abs=0.2)
    iv = ev["slo"]["ttft_p95"]
    assert iv["estimate"] == pytest.approx(0.2) and iv["hi"] == pytest.approx(0.2) and iv["n"] == 100
    assert iv["passed"] and iv["method"] == "order-statistic"
    # 12 preemptions over every request that finished in the point (warm-up to cool-down).
    assert ev["preemptions_per_request"] == pytest.approx(12 / len(records))
    assert ev["unfinished"] == ev["failed"] == 0


def test_growing_queue_fails_on_throughput_queue_and_latency():
    # A server that completes 5/s against 10/s offered: request k waits k * 0.1 s more.
    records = [rec(i, i / 10, ttft=0.2 + i * 0.1, e2e=0.5 + i * 0.1) for i in range(120)]
    v = judge(records, WINDOW, parse_slo("ttft_p95=2"))
    assert not v.passed
    assert {"throughput", "queue", "ttft_p95"} <= set(v.evidence["causes"])
    ev = v.evidence
    # Request k ends at 0.2 k + 0.5: those ending in [1, 11) are k = 3 .. 52.
    assert ev["completed_in_window"] == 50 and ev["rate_ratio"] == pytest.approx(0.5)
    # The trend is growth, not noise: about the fitted line the count barely deviates.
    assert ev["shortfall"] == 50 and ev["in_flight_sd"] < 1.0 and ev["shortfall_allowed"] < 8
    # In flight grows by 5 per second: +25 over the window's 5 s second half.
    assert ev["queue"]["slope"] == pytest.approx(5.0, rel=0.05)
    assert ev["queue"]["growth"] == pytest.approx(25.0, rel=0.05)
    assert any(r.startswith("queue growing") for r in v.reasons)


def test_unfinished_requests_count_against_the_slo():
    records = steady()
    sample = [r for r in records if r.phase == "sample"]
    for r in sample[-6:]:  # 6 % of the sample never got a token
        i = records.index(r)
        records[i] = rec(r.index, r.scheduled_time, unfinished=True)
    v = judge(records, WINDOW, parse_slo("ttft_p95=0.3"))
    iv = v.evidence["slo"]["ttft_p95"]
    assert v.evidence["unfinished"] == 6 and v.evidence["failed"] == 0
    assert math.isinf(iv["estimate"]) and not iv["passed"] and not v.passed
    unfinished = next(r for r in records if r.unfinished)
    m = censored_metrics(unfinished, WINDOW.deadline)
    assert math.isinf(m["ttft"]) and math.isinf(m["e2e"]) and m["itls"] == []


def test_small_sample_failures_and_preemptions():
    slo = parse_slo("ttft_p95=1")
    few = [rec(i, 1.0 + i * 0.2) for i in range(50)]  # 50 arrivals: cannot bound a p95
    v = judge(few, WINDOW, slo)
    assert not v.passed and v.evidence["causes"] == ["sample"]
    assert "cannot bound it (needs >= 72" in v.reasons[0]
    records = steady()
    records[40] = rec(records[40].index, records[40].scheduled_time, ok=False)
    v = judge(records, WINDOW, slo, preemptions=1.5 * len(records))
    assert set(v.evidence["causes"]) == {"failures", "preemption"} and v.evidence["failed"] == 1
    v = judge(steady(), WINDOW, slo, preemptions=1.5 * 120, thresholds=Thresholds(preemption_threshold=math.inf))
    assert v.passed


def test_cancelled_cooldown_is_not_a_failure():
    records = steady()
    for r in records:
        if r.phase == "cooldown":
            r.success, r.cancelled, r.error = False, True, "cancelled"
    v = judge(records, WINDOW, parse_slo("ttft_p95=1"))
    assert v.passed and v.evidence["cancelled_cooldown"] == 10


def test_in_flight_counts_and_growth():
    records = [rec(0, 0.0, e2e=2.0), rec(1, 1.0, e2e=2.0), rec(2, 1.5, e2e=0.2)]
    assert list(in_flight_at(records, np.array([0.5, 1.0, 1.6, 1.9, 2.5, 3.5]))) == [1, 2, 3, 2, 1, 0]
    g = queue_growth(records, 0.0, 4.0)
    assert g["t0"] == 0.0 and g["t1"] == 4.0 and g["growth"] < 0
