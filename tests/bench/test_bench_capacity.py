"""Capacity search: exact on a synthetic pass/fail function, and near the known limit of a
fake server whose latency grows with load."""

from __future__ import annotations

import asyncio
import math

import pytest
from bench_fake_openai import Plan, ServerState

from inflight.bench import capacity as cap
from inflight.bench.client import make_client
from inflight.bench.datasets import DatasetConfig
from inflight.bench.runner import ArrivalConfig, LoadConfig, open_session, run_point
from inflight.bench.stats import parse_slo


def synthetic(limit: float):
    calls = []

    async def measure(load: float) -> cap.PointOutcome:
        calls.append(load)
        return cap.PointOutcome(load, load <= limit)
    return measure, calls


def test_search_brackets_then_bisects():
    measure, calls = synthetic(37.0)
    res = asyncio.run(cap.search(measure, start=1.0, min_load=0.01, max_load=1000.0, tolerance=0.05,
                                 max_points=30))
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert res.bounded and 37.0 / 1.05 <= res.limit <= 37.0
    assert len(res.points) == len(calls) <= 12
    assert all(p.passed == (p.load <= 37.0) for p in res.points)


def test_search_downwards_unbounded_and_impossible():
    measure, calls = synthetic(0.3)
    res = asyncio.run(cap.search(measure, 10.0, 0.01, 100.0, tolerance=0.1))
    assert calls[:6] == [10.0, 5.0, 2.5, 1.25, 0.625, 0.3125] and 0.3 / 1.1 <= res.limit <= 0.3
    measure, _ = synthetic(1e9)
    res = asyncio.run(cap.search(measure, 10.0, 0.01, 100.0))
    assert res.limit == 100.0 and not res.bounded
    measure, _ = synthetic(0.0)
    res = asyncio.run(cap.search(measure, 1.0, 0.25, 100.0))
    assert res.limit is None and [p.load for p in res.points] == [1.0, 0.5, 0.25]
    measure, calls = synthetic(37.0)
    asyncio.run(cap.search(measure, 1.0, 0.01, 1000.0, tolerance=1e-9, max_points=9))
    assert len(calls) == 9


def test_evaluate_point():
    slo = parse_slo("ttft_p95=1,itl_p95=0.1")
    good = {"completed": 10, "failed": 0, "ttft": {"p95": 0.5}, "itl": {"p95": 0.05}, "preemptions": 10.0}
    assert cap.evaluate_point(3.0, good, slo).passed
    assert not cap.evaluate_point(3.0, {**good, "failed": 1}, slo).passed
    assert not cap.evaluate_point(3.0, {**good, "itl": {"p95": 0.2}}, slo).passed
    # 11 preemptions over 10 requests: above the default threshold of 1 per request.
    out = cap.evaluate_point(3.0, {**good, "preemptions": 11.0}, slo)
    assert not out.passed and "preemptions per request" in out.reasons[0]
    assert cap.evaluate_point(3.0, {**good, "preemptions": None}, slo).passed
    assert cap.evaluate_point(3.0, {**good, "preemptions": 11.0}, slo, preemption_threshold=math.inf).passed
    assert not cap.evaluate_point(3.0, {**good, "completed": 0}, slo).passed


def test_spread():
    assert cap.spread([2.0, 4.0, None]) == {"repeats": 3, "found": 2, "mean": 3.0, "std": 1.0, "min": 2.0,
                                            "max": 4.0}
    assert cap.spread([None])["mean"] is None


SERVICE = 0.04  # s per request, one at a time: the fake serves at most 25 requests/s
N = 16
SLO_TTFT = 3 * SERVICE


def known_limit() -> float:
    """Highest constant rate r whose p95 TTFT stays within SLO_TTFT.

    Above 1/SERVICE, request k (0-based) waits behind k others: TTFT_k = S + k (S - 1/r).
    numpy's p95 of N values sits at index 0.95 (N - 1), so p95 = S + 0.95 (N - 1)(S - 1/r).
    """
    excess = (SLO_TTFT - SERVICE) / (0.95 * (N - 1))
    return 1 / (SERVICE - excess)


def test_capacity_finds_known_limit_of_queueing_server(fake_server, data_dir):
    lock = asyncio.Lock()

    async def plan(body, i):
        async with lock:
            await asyncio.sleep(SERVICE)
        return Plan(ttft=0.0, gaps=[0.0])
    srv = fake_server(ServerState(plan=plan))
    slo = parse_slo(f"ttft_p95={SLO_TTFT}")

    async def main():
        async with make_client() as client:
            load = LoadConfig(base_url=srv.base_url, progress=False, scrape_metrics=False)
            ds = DatasetConfig(name="random", num_prompts=N, input_len=4, output_len=2, data_dir=str(data_dir))
            session = await open_session(load, ds, client)

            async def measure(rate):
                p = await run_point(session, ArrivalConfig(process="constant", rate=rate), slo)
                return cap.evaluate_point(rate, p.summary, slo)
            return await cap.search(measure, start=12.5, min_load=1.0, max_load=200.0, tolerance=0.1,
                                    max_points=8)
    res = asyncio.run(main())
    # known_limit() = 29.1 req/s; timer and HTTP overhead on a shared machine only lower the
    # measured limit, and the search stops within 10 %: accept -25 % / +10 %.
    assert known_limit() == pytest.approx(29.08, abs=0.01)
    assert 0.75 * known_limit() <= res.limit <= 1.1 * known_limit(), [(p.load, p.passed) for p in res.points]
