"""Runs against the fake OpenAI server in this process (uvicorn on 127.0.0.1, a thread).

Measured times carry real scheduling noise, so they are checked against the scripted
timings with a stated tolerance; everything computed from the recorded timestamps is
checked exactly by recomputing it independently.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from bench_fake_openai import Plan, ServerState, toy_count

from inflight.bench.client import make_client
from inflight.bench.datasets import DatasetConfig
from inflight.bench.http_target import open_session
from inflight.bench.session import ArrivalConfig, LoadConfig, run_point
from inflight.bench.summary import parse_slo, request_metrics
from inflight.bench.trace_files import load_trace

# Client-side timings may exceed the scripted ones by event-loop and HTTP overhead on a
# shared 2-core machine, and a gap may also shrink when a late chunk catches up with the
# next one; 60 ms bounds both with room to spare.
TOL = 0.060


def run(base_url, dataset: DatasetConfig, arrival: ArrivalConfig, slo=None, **load_kw):
    async def main():
        async with make_client() as client:
            load = LoadConfig(base_url=base_url, progress=False, **load_kw)
            session = await open_session(load, dataset, client)
            return session, await run_point(session, arrival, parse_slo(slo))
    return asyncio.run(main())


def test_measured_timings_match_scripted_ones(fake_server, data_dir):
    """Even requests: TTFT 0.05 s; odd: TTFT 0.40 s; then 4 gaps of 0.05 s."""
    async def plan(body, i):
        return Plan(ttft=0.05 if i % 2 == 0 else 0.40, gaps=[0.05] * 4)
    srv = fake_server(ServerState(plan=plan))
    ds = DatasetConfig(name="random", num_prompts=8, input_len=30, output_len=5, data_dir=str(data_dir))
    session, point = run(srv.base_url, ds, ArrivalConfig(process="constant", rate=40.0), slo="ttft=0.2,itl=0.2")
    s = point.summary
    assert s["completed"] == 8 and s["failed"] == 0
    by_index = {r.index: r for r in point.records}
    for i, r in by_index.items():
        m = request_metrics(r)
        # Requests reach the server in send order (one every 25 ms), so plan i = request i.
        scripted = 0.05 if i % 2 == 0 else 0.40
        assert scripted <= m.ttft <= scripted + TOL
        assert len(m.itls) == 4 and all(0.05 - TOL <= g <= 0.05 + TOL for g in m.itls)
        assert 0.2 - TOL <= m.e2e - m.ttft <= 0.2 + TOL
        assert m.tpot == (m.e2e - m.ttft) / 4
        assert r.output_tokens == 5 and r.output_tokens_from_usage
        assert r.prompt_tokens == r.prompt_len == 30  # exact via the server's /tokenize
    # Goodput: the 0.15 s margins dwarf the noise, so exactly the 4 fast requests are good.
    assert s["good_requests"] == 4
    ttfts = [request_metrics(by_index[i]).ttft for i in range(8)]
    assert s["ttft"]["p95"] == float(np.percentile(ttfts, 95))
    assert s["ttft"]["median"] == float(np.median(ttfts))
    gaps = [g for r in point.records for g in request_metrics(r).itls]
    assert s["itl"]["p99"] == float(np.percentile(gaps, 99))
    duration = max(r.end_time for r in point.records) - min(r.send_time for r in point.records)
    assert s["duration"] == duration and s["goodput"] == 4 / duration
    assert s["request_throughput"] == 8 / duration
    assert s["output_throughput"] == 40 / duration
    assert session.tokenizer_mode == "server"
    # Scraped: the fake exposes inflight: gauges and a config info metric.
    assert session.server_info["inflight:cache_config_info"]["block_size"] == "16"
    assert s["preemptions"] == 0.0


def test_trace_replay_reproduces_scaled_inter_arrival_times(fake_server, data_dir):
    srv = fake_server()
    rows = load_trace(data_dir / "azure_llm_2023_conv_1815-1900.csv")[:12]
    scale = 0.1  # the first 12 rows span 9.8 s of trace: about 1 s here
    ds = DatasetConfig(name="trace", num_prompts=12, length_scale=1 / 64, max_output_len=2,
                       data_dir=str(data_dir))
    _, point = run(srv.base_url, ds, ArrivalConfig(process="trace", time_scale=scale))
    assert point.summary["failed"] == 0
    want = [(r.time - rows[0].time) * scale for r in rows]
    assert [r.scheduled_time for r in sorted(point.records, key=lambda r: r.index)] == want
    # The server's clock is this process's perf_counter: compare arrival gaps directly.
    seen = np.asarray(srv.state.arrivals) - srv.state.arrivals[0]
    # Send-time jitter plus request parsing on a shared machine: 50 ms.
    assert np.all(np.abs(seen - np.asarray(want)) < 0.050)
    assert [b["max_tokens"] for b in srv.state.bodies] == [max(1, min(2, round(r.output_len / 64))) for r in rows]
    assert all(b["ignore_eos"] is True for b in srv.state.bodies)
    assert [toy_count(b["prompt"]) for b in srv.state.bodies] == [max(1, round(r.input_len / 64)) for r in rows]


def test_concurrency_cap_warmups_and_failures(fake_server, data_dir):
    async def plan(body, i):
        if i == 5:  # the 3rd counted request, after 3 warm-ups
            return Plan(status=503)
        return Plan(ttft=0.05, gaps=[0.01])
    state = ServerState(plan=plan, preemptions_per_request=0.5)
    srv = fake_server(state)
    ds = DatasetConfig(name="random", num_prompts=10, input_len=8, output_len=2, data_dir=str(data_dir))
    _, point = run(srv.base_url, ds, ArrivalConfig(rate=math.inf), max_concurrency=3, num_warmups=3)
    s = point.summary
    assert len(srv.state.bodies) == 13 and len(point.records) == 10
    assert s["completed"] == 9 and s["failed"] == 1
    assert list(s["errors"]) == [next(r.error for r in point.records if not r.success)[:80]]
    assert s["peak_concurrency"] <= 3
    # Warm-ups ran before the timed run: 0.5 per request over the 9 streamed, counted ones.
    assert s["preemptions"] == 4.5


def test_measurement_window_phases(fake_server, data_dir):
    srv = fake_server()
    ds = DatasetConfig(name="random", num_prompts=5, input_len=4, output_len=1, data_dir=str(data_dir))
    arrival = ArrivalConfig(process="constant", rate=20.0, duration=0.5, warmup_duration=0.1, drain_timeout=0.5)
    _, point = run(srv.base_url, ds, arrival)
    phases = [r.phase for r in point.records]
    # Offsets 0, 0.05, ...: two before the window, ten in [0.1, 0.6), then cool-down, which
    # stops (and is cancelled) once the sample has ended.
    assert phases[:12] == ["warmup"] * 2 + ["sample"] * 10 and set(phases[12:]) <= {"cooldown"}
    assert (point.window.start, point.window.end, point.window.deadline) == (0.1, 0.6, 1.1)
    assert point.summary["completed"] == 10 and point.summary["failed"] == 0
    assert all(r.success or r.cancelled for r in point.records)
    # At least --num-prompts (min_requests): the window stretches to the 15th arrival.
    _, point = run(srv.base_url, ds, ArrivalConfig(**{**arrival.__dict__, "min_requests": 15}))
    sample = [r for r in point.records if r.phase == "sample"]
    assert len(sample) == 15 and point.window.end == pytest.approx(0.1 + 15 / 20)


def test_unfinished_sample_requests_end_at_the_deadline(fake_server, data_dir):
    async def plan(body, i):
        return Plan(ttft=0.0, gaps=[5.0] if i == 3 else [0.0])  # request 3 streams for 5 s
    srv = fake_server(ServerState(plan=plan))
    ds = DatasetConfig(name="random", num_prompts=5, input_len=4, output_len=2, data_dir=str(data_dir))
    arrival = ArrivalConfig(process="constant", rate=20.0, duration=0.5, warmup_duration=0.1, drain_timeout=0.3)
    _, point = run(srv.base_url, ds, arrival)
    slow = point.records[3]
    assert slow.phase == "sample" and slow.unfinished and not slow.success
    assert slow.end_time == pytest.approx(0.9, abs=0.1)  # the deadline: window end 0.6 + 0.3
    assert point.summary["unfinished"] == 1 and point.summary["completed"] == 9
    assert not any(r.unfinished for r in point.records if r.index != 3)


def test_a_request_cancelled_before_it_starts_is_not_a_failure():
    # A cool-down request created just as the point ends is cancelled before its first
    # step: its body (and its except) never runs. CI once counted one as "failed".
    from inflight.bench.client import RequestRecord
    from inflight.bench.looks import settle as _settle

    async def body():
        raise AssertionError("never runs")

    async def boom():
        raise OSError("connection reset")

    async def go():
        early, crashed = asyncio.create_task(body()), asyncio.create_task(boom())
        early.cancel()
        await asyncio.gather(early, crashed, return_exceptions=True)
        cool, sample, other = (RequestRecord(0, 0.0, phase="cooldown"), RequestRecord(1, 0.0, phase="sample"),
                               RequestRecord(2, 0.0, phase="sample"))
        _settle(early, cool, 2.0), _settle(early, sample, 2.0), _settle(crashed, other, 2.0)
        return cool, sample, other

    cool, sample, other = asyncio.run(go())
    assert cool.cancelled and not cool.unfinished and cool.end_time == cool.send_time == 2.0
    assert sample.unfinished and not sample.cancelled and not sample.success
    assert other.error == "OSError: connection reset" and not other.success and not other.unfinished


def test_approx_tokenizer_without_tokenize_endpoint(fake_server, data_dir):
    srv = fake_server(ServerState(tokenize=False))
    ds = DatasetConfig(name="sonnet", num_prompts=3, input_len=20, output_len=2, data_dir=str(data_dir))
    session, point = run(srv.base_url, ds, ArrivalConfig(), scrape_metrics=False)
    assert session.tokenizer_mode == "approx-words"
    assert all(len(s.prompt.split()) == 20 and not s.exact for s in session.specs)
    assert point.metrics_before is None and point.summary["preemptions"] is None


def test_chat_endpoint(fake_server, data_dir):
    srv = fake_server()
    ds = DatasetConfig(name="chat", num_prompts=4, output_len=3, data_dir=str(data_dir))
    session, point = run(srv.base_url, ds, ArrivalConfig())
    assert session.endpoint == "chat"
    assert point.summary["completed"] == 4 and point.summary["total_output_tokens"] == 12
    assert all("messages" in b and "ignore_eos" not in b for b in srv.state.bodies)
