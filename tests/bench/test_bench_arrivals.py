"""Arrival processes: mean rates (fixed seed, statistical bounds) and exact trace replay."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest

from inflight.bench.arrivals import make_offsets, rate_offsets, trace_offsets, unit_gaps
from inflight.bench.trace_files import load_trace

N = 20_000


@pytest.mark.parametrize("process,burstiness", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 1.0), ("gamma", 4.0)])
def test_mean_rate_within_statistical_bound(process, burstiness):
    rate = 8.0
    off = rate_offsets(N, rate, process, burstiness, seed=1234)
    gaps = np.diff(off)
    # Gaps are i.i.d. with mean 1/rate and std (1/rate)/sqrt(burstiness): the sample mean is
    # within 4 standard errors with probability > 0.9999 (and the seed is fixed).
    se = (1 / rate) / math.sqrt(burstiness) / math.sqrt(len(gaps))
    assert abs(gaps.mean() - 1 / rate) < 4 * se
    # The burstiness shows in the spread: coefficient of variation 1/sqrt(shape), within 5 %.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_constant_and_infinite_rates_exact():
    assert rate_offsets(5, 4.0, "constant") == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert rate_offsets(3, math.inf, "poisson") == [0.0, 0.0, 0.0]
    assert rate_offsets(0, 1.0) == []


def test_seeded_and_scale_free():
    a = rate_offsets(100, 2.0, "gamma", 0.5, seed=7)
    assert a == rate_offsets(100, 2.0, "gamma", 0.5, seed=7)
    assert a != rate_offsets(100, 2.0, "gamma", 0.5, seed=8)
    # Same seed, twice the rate: the same pattern in half the time (common random numbers).
    b = rate_offsets(100, 4.0, "gamma", 0.5, seed=7)
    assert np.allclose(np.asarray(a) / 2, b, rtol=1e-12, atol=0)


def test_bad_parameters():
    with pytest.raises(ValueError):
        unit_gaps(3, "uniform")
    with pytest.raises(ValueError):
        rate_offsets(3, 0.0)
    with pytest.raises(ValueError):
        unit_gaps(3, "gamma", burstiness=0)
    with pytest.raises(ValueError):
        make_offsets(3, "trace", trace_times=[None, None, None])


def _azure_seconds(stamp: str) -> Decimal:
    day, clock = stamp.split(" ")
    h, m, s = clock.split(":")
    return Decimal(int(day[-2:]) * 86400 + int(h) * 3600 + int(m) * 60) + Decimal(s)


def test_azure_trace_times_exact(data_dir):
    path = data_dir / "azure_llm_2023_conv_1815-1900.csv"
    rows = load_trace(path)
    lines = path.read_text().splitlines()[1:201]
    stamps = [_azure_seconds(ln.split(",")[0]) for ln in lines]
    assert len(rows) == 15_606
    for row, stamp, line in zip(rows, stamps, lines):
        # 100 ns resolution kept: equal to the decimal difference rounded to a double.
        assert row.time == float(stamp - stamps[0])
        assert (row.input_len, row.output_len) == tuple(int(x) for x in line.split(",")[1:])


def test_trace_replay_offsets_scaled(data_dir):
    rows = load_trace(data_dir / "azure_llm_2023_conv_1815-1900.csv")[100:150]
    off = make_offsets(50, "trace", trace_times=[r.time for r in rows], time_scale=0.5)
    assert off[0] == 0.0
    assert off == [(r.time - rows[0].time) * 0.5 for r in rows]
    assert np.allclose(np.diff(off), np.diff([r.time for r in rows]) * 0.5, rtol=0, atol=1e-12)


def test_mooncake_trace_times(data_dir):
    rows = load_trace(data_dir / "mooncake_conversation_0-30min.jsonl")
    assert len(rows) == 5_719
    assert rows[0].time == 0.0 and rows[0].hash_ids[:3] == [0, 1, 2]
    assert all(b.time >= a.time for a, b in zip(rows, rows[1:]))
    assert rows[-1].time < 1800.0
    assert trace_offsets([r.time for r in rows[:3]], 2.0) == [2 * (r.time - rows[0].time) for r in rows[:3]]
