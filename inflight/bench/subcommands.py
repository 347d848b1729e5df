"""The ``bench`` sub-commands ``serve`` (one run) and ``sweep`` (runs over loads and server
knob values); ``capacity`` is in :mod:`inflight.bench.capacity_command`, ``tune`` in
:mod:`inflight.bench.tune`. Each takes a :class:`~inflight.bench.connect.Run` and returns an
exit code; the flags are parsed in :mod:`inflight.bench.arguments`."""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import replace
from typing import IO, Any

from inflight.bench.connect import Run, header, open_any_session, server_for, started_server
from inflight.bench.report import format_summary, plot_run, plot_sweep, point_row, write_csv, write_json
from inflight.bench.session import ArrivalConfig, PointResult, Session, records_json, run_point
from inflight.bench.summary import SLO
from inflight.bench.sustain import Thresholds, Verdict, evidence_lines
from inflight.bench.vllm_result import format_vllm_block, result_path, vllm_header, vllm_result


def offered_rate(offsets: list[float]) -> float | None:
    """Mean send rate of a schedule (req/s): inf when all at once, None for one request."""
    if len(offsets) < 2:
        return None
    span = offsets[-1] - offsets[0]
    return (len(offsets) - 1) / span if span > 0 else math.inf


def serve_result(run: Run, session: Session, point: PointResult, verdict: Verdict | None = None) -> dict[str, Any]:
    """The JSON document of one run: command, fixed conditions, aggregates, every request;
    and, at the top level, vLLM's ``bench serve`` keys (``vllm_result.vllm_result``)."""
    out = run.config.output
    vllm = {**vllm_header(run.config, session.model, session.endpoint),
            **vllm_result(point.records, point.summary, out.percentile_metrics, out.metric_percentiles)}
    return {**vllm, **header(run.config, "serve"), "simulated": session.simulation, "fixed": session.fixed(),
            "arrival": point.arrival.describe(),
            "offered_rate": offered_rate([r.scheduled_time for r in point.records if r.phase == "sample"]),
            "prepare_seconds": session.prepare_seconds, "summary": point.summary,
            "verdict": verdict.to_json() if verdict else None,
            "server_metrics": {"samples": point.metrics_samples, "counter_deltas": point.counters},
            "requests": records_json(point.records)}


def point_verdict(point: PointResult, slo: SLO, thresholds: Thresholds) -> Verdict | None:
    """The sustained-load verdict of a windowed point with aggregate SLOs, else None."""
    if point.window is None or not slo.aggregate:
        return None
    return point.verdict(slo, thresholds)


def print_verdict(v: Verdict, file: IO[str] | None = None) -> None:
    head = "sustained within the SLO" if v.passed else "NOT sustained: " + "; ".join(v.reasons)
    print(f"verdict: {head}", file=file)
    for line in evidence_lines(v.evidence):
        print(f"    {line}", file=file)


async def serve(run: Run) -> int:
    config = run.config
    async with contextlib.AsyncExitStack() as stack:
        if config.server.serve_cmd and not run.simulated:
            await stack.enter_async_context(started_server(config, config.server.serve_cmd))
        session = await open_any_session(run, stack, config.server.serve_cmd)
        point = await run_point(session, config.arrival, config.slo)
    print(format_summary(point.summary, run.title("inflight bench serve")))
    verdict = point_verdict(point, config.slo, config.thresholds)
    if verdict is not None:
        print_verdict(verdict)
    out = config.output
    if out.vllm_block:
        print(format_vllm_block(vllm_result(point.records, point.summary, out.percentile_metrics,
                                            out.metric_percentiles), out.percentile_metrics,
                                out.metric_percentiles))
    path = result_path(config, "serve", session.model, session.endpoint)
    if path:
        write_json(path, serve_result(run, session, point, verdict))
        print(f"result: {path}", file=sys.stderr)
    if out.plot:
        title = f"{session.model}: {config.dataset.name}, {config.arrival.process} rate {config.arrival.rate:g}"
        plot_run(out.plot, point.records, point.metrics_samples, title=run.title(title))
    return 0 if point.summary["completed"] > 0 else 1


async def sweep(run: Run) -> int:
    config = run.config
    base = config.arrival
    if base.process == "trace":
        xs, key = list(config.time_scales) or [base.time_scale], "time_scale"
    else:
        xs, key = list(config.request_rates) or [base.rate], "rate"
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for value in config.server.knob_values():
        async with server_for(run, value), contextlib.AsyncExitStack() as stack:
            session = await open_any_session(run, stack, config.server.command(value))
            for x in xs:
                arrival = replace(base, time_scale=x) if key == "time_scale" else replace(base, rate=x)
                row, point = await _sweep_point(run, session, arrival, key, x, value)
                rows.append(row)
                points.append(point)
    _print_rows(rows, run.title("inflight bench sweep"))
    path = result_path(config, "sweep", config.load.model)
    if path:
        write_json(path, {**header(config, "sweep"), "simulated": run.simulated,
                          "slo": config.slo.to_json(), "rows": rows, "points": points})
    if config.output.save_csv:
        write_csv(config.output.save_csv, rows)
    if config.output.plot:
        plot_sweep(config.output.plot, rows, config.slo)
    return 0 if any(r["completed"] for r in rows) else 1


async def _sweep_point(run: Run, session: Session, arrival: ArrivalConfig, key: str, x: float,
                       value: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One load of a sweep: its table row and its saved point; the row said at once."""
    slo = run.config.slo
    p = await run_point(session, arrival, slo)
    verdict = point_verdict(p, slo, run.config.thresholds)
    offered = offered_rate([r.scheduled_time for r in p.records if r.phase == "sample"])
    row = point_row(p.summary, value=value, rate=offered if key == "time_scale" else x,
                    time_scale=x if key == "time_scale" else None, offered_rate=offered,
                    sustained=None if verdict is None else verdict.passed)
    point = {"value": value, "arrival": arrival.describe(), "summary": p.summary, "fixed": session.fixed(),
             "server_counters": p.counters, "verdict": verdict.to_json() if verdict else None}
    print(_row_line(row), file=sys.stderr)
    if verdict is not None:
        print_verdict(verdict, sys.stderr)
    return row, point


def _row_line(row: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"
    val = f"value={row['value']} " if row.get("value") is not None else ""
    ts = f"time_scale={row['time_scale']:g} " if row.get("time_scale") is not None else ""
    rate = row.get("rate")
    rate_s = "-" if rate is None else f"{rate:g}"
    tput = row.get("output_throughput")
    return (f"{val}{ts}rate={rate_s} done={row['completed']} failed={row['failed']} "
            f"out_tok/s={'-' if tput is None else f'{tput:.1f}'} p95 TTFT={ms(row['ttft_p95'])} ms "
            f"p95 ITL={ms(row['itl_p95'])} ms")


def _print_rows(rows: list[dict[str, Any]], title: str = "inflight bench sweep") -> None:
    print("=" * 20 + f" {title} " + "=" * 20)
    for r in rows:
        print(_row_line(r))
