"""The ``bench`` sub-commands: ``serve`` (one run), ``sweep`` (runs over loads and server
knob values) and ``capacity`` (the SLO operating limit). Each takes the parsed arguments
and returns an exit code; the parser is in :mod:`inflight.bench.cli`."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import shlex
import sys
from dataclasses import replace

from inflight.bench import capacity as cap
from inflight.bench.client import make_client
from inflight.bench.datasets import DatasetConfig
from inflight.bench.report import (format_summary, plot_capacity, plot_run, plot_sweep, point_row,
                                   write_csv, write_json)
from inflight.bench.runner import (ArrivalConfig, LoadConfig, PointResult, Session, offsets_for,
                                   open_session, records_json, run_point)
from inflight.bench.server_proc import ServerProcess
from inflight.bench.stats import SLO, parse_slo


def configs(args) -> tuple[LoadConfig, DatasetConfig, ArrivalConfig, SLO]:
    """The run's configurations from parsed flags; ValueError on flags that contradict."""
    load = LoadConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint_type, api_key=args.api_key,
                      temperature=args.temperature, extra_body=args.extra_body,
                      request_timeout=args.request_timeout, max_concurrency=args.max_concurrency,
                      num_warmups=args.num_warmups, scrape_metrics=args.metrics,
                      reset_prefix_cache=args.reset_prefix_cache,
                      metrics_interval=args.metrics_interval, tokenize=args.tokenize,
                      tokenizer=args.tokenizer, progress=not args.disable_tqdm)
    dataset = DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                            data_dir=args.data_dir, input_len=args.input_len, output_len=args.output_len,
                            range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                            trace_file=args.trace_file, trace_format=args.trace_format,
                            trace_skip=args.trace_skip, length_scale=args.length_scale,
                            min_input_len=args.min_input_len, max_input_len=args.max_input_len,
                            min_output_len=args.min_output_len, max_output_len=args.max_output_len,
                            prefix_blocks=args.prefix_blocks, chat_file=args.chat_file,
                            ignore_eos=args.ignore_eos)
    if args.arrival == "poisson" and args.burstiness != 1.0:
        raise ValueError("--burstiness needs --arrival gamma")
    if args.arrival == "trace" and args.dataset != "trace":
        raise ValueError("--arrival trace needs --dataset trace")
    arrival = ArrivalConfig(process=args.arrival, rate=args.request_rate, burstiness=args.burstiness,
                            time_scale=args.time_scale, seed=args.seed, duration=args.duration)
    return load, dataset, arrival, parse_slo(args.slo)


def _args_json(args) -> dict:
    return {k: v for k, v in vars(args).items()
            if not k.startswith("_") and isinstance(v, (str, int, float, bool, list, dict, type(None)))
            and k != "api_key"}


def _header(args, kind: str) -> dict:
    return {"kind": kind, "tool": "inflight bench", "command": shlex.join(sys.orig_argv), "args": _args_json(args),
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def offered_rate(offsets: list[float]) -> float | None:
    """Mean send rate of a schedule (req/s): inf when all at once, None for one request."""
    if len(offsets) < 2:
        return None
    span = offsets[-1] - offsets[0]
    return (len(offsets) - 1) / span if span > 0 else math.inf


def _note_session(session: Session) -> None:
    if session.tokenizer_mode == "approx-words":
        print("note: prompt lengths are approximate (whitespace words): the server has no /tokenize "
              "and no --tokenizer was given", file=sys.stderr)
    print(f"model {session.model} at {session.load.base_url} ({session.endpoint}); "
          f"{len(session.specs)} requests prepared in {session.prepare_seconds:.1f} s "
          f"(tokenizer: {session.tokenizer_mode})", file=sys.stderr)


@contextlib.asynccontextmanager
async def _maybe_server(args, value):
    if not args.serve_cmd:
        yield None
        return
    log = None
    if args.server_log_dir:
        os.makedirs(args.server_log_dir, exist_ok=True)
        log = os.path.join(args.server_log_dir, f"server-{value}.log")
    proc = ServerProcess(args.serve_cmd, value, args.base_url, args.server_start_timeout,
                         args.server_stop_timeout, log)
    print(f"starting: {proc.command}", file=sys.stderr)
    async with proc:
        yield proc
    print(f"stopped (exit {proc.proc.returncode if proc.proc else None}); log: {proc.log_path}", file=sys.stderr)


def _values(args) -> list:
    if args.serve_cmd and not args.values:
        raise ValueError("--serve-cmd needs --values")
    if args.values and not args.serve_cmd:
        raise ValueError("--values needs --serve-cmd")
    return args.values or [None]


def serve_result(args, session: Session, point: PointResult) -> dict:
    """The JSON document of one run: command, fixed conditions, aggregates, every request."""
    return {**_header(args, "serve"), "fixed": session.fixed(), "arrival": point.arrival.describe(),
            "offered_rate": offered_rate([r.scheduled_time for r in point.records]),
            "prepare_seconds": session.prepare_seconds, "summary": point.summary,
            "server_metrics": {"samples": point.metrics_samples, "counter_deltas": point.counters},
            "requests": records_json(point.records)}


async def serve(args) -> int:
    load, dataset, arrival, slo = configs(args)
    async with make_client(timeout=load.request_timeout) as client:
        session = await open_session(load, dataset, client)
        _note_session(session)
        point = await run_point(session, arrival, slo)
    print(format_summary(point.summary))
    if args.save_result:
        write_json(args.save_result, serve_result(args, session, point))
    if args.plot:
        plot_run(args.plot, point.records, point.metrics_samples,
                 title=f"{session.model}: {dataset.name}, {arrival.process} rate {args.request_rate:g}")
    return 0 if point.summary["completed"] > 0 else 1


async def sweep(args) -> int:
    load, dataset, base, slo = configs(args)
    if base.process == "trace":
        xs, key = args.time_scales or [base.time_scale], "time_scale"
    else:
        xs, key = args.request_rates or [base.rate], "rate"
    rows, points = [], []
    for value in _values(args):
        async with _maybe_server(args, value):
            async with make_client(timeout=load.request_timeout) as client:
                session = await open_session(load, dataset, client)
                _note_session(session)
                for x in xs:
                    arrival = replace(base, **{key: x})
                    p = await run_point(session, arrival, slo)
                    offered = offered_rate(offsets_for(session, arrival))
                    row = point_row(p.summary, value=value, rate=offered if key == "time_scale" else x,
                                    time_scale=x if key == "time_scale" else None, offered_rate=offered)
                    rows.append(row)
                    points.append({"value": value, "arrival": arrival.describe(), "summary": p.summary,
                                   "fixed": session.fixed(), "server_counters": p.counters})
                    print(_row_line(row), file=sys.stderr)
    _print_rows(rows)
    if args.save_result:
        write_json(args.save_result, {**_header(args, "sweep"), "slo": slo.to_json(), "rows": rows,
                                      "points": points})
    if args.save_csv:
        write_csv(args.save_csv, rows)
    if args.plot:
        plot_sweep(args.plot, rows, slo)
    return 0 if any(r["completed"] for r in rows) else 1


def _row_line(row: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"
    val = f"value={row['value']} " if row.get("value") is not None else ""
    ts = f"time_scale={row['time_scale']:g} " if row.get("time_scale") is not None else ""
    rate = row.get("rate")
    rate_s = "-" if rate is None else f"{rate:g}"
    tput = row.get("output_throughput")
    return (f"{val}{ts}rate={rate_s} done={row['completed']} failed={row['failed']} "
            f"out_tok/s={'-' if tput is None else f'{tput:.1f}'} p95 TTFT={ms(row['ttft_p95'])} ms "
            f"p95 ITL={ms(row['itl_p95'])} ms")


def _print_rows(rows: list[dict]) -> None:
    print("=" * 20 + " inflight bench sweep " + "=" * 20)
    for r in rows:
        print(_row_line(r))


async def capacity(args) -> int:
    load, dataset, base, slo = configs(args)
    if not slo.aggregate:
        raise ValueError("capacity needs aggregate SLOs, e.g. --slo ttft_p95=1s,itl_p95=100ms")
    by_scale = base.process == "trace"
    if by_scale:
        start, lo, hi = 1 / base.time_scale, 1 / args.time_scale_max, 1 / args.time_scale_min
    else:
        start, lo, hi = args.rate_start, args.rate_min, args.rate_max

    def to_x(load_: float | None) -> float | None:
        return None if load_ is None else (1 / load_ if by_scale else load_)

    results = []
    for value in _values(args):
        async with _maybe_server(args, value):
            async with make_client(timeout=load.request_timeout) as client:
                session = await open_session(load, dataset, client)
                _note_session(session)
                limits, curve, bounded = [], [], True
                for rep in range(args.repeats):
                    measure = _measure_fn(session, base, slo, args.preemption_threshold, by_scale, rep)
                    res = await cap.search(measure, min(max(start, lo), hi), lo, hi, args.tolerance,
                                           args.max_points)
                    limits.append(to_x(res.limit))
                    bounded &= res.bounded
                    curve += [{**p.to_json(), "repeat": rep, "x": to_x(p.load)} for p in res.points]
        sp = cap.spread(limits)
        results.append({"value": value, "limits": limits, "spread": sp, "bounded": bounded,
                        "fixed": session.fixed(), "curve": curve})
        print(_capacity_line(value, sp, bounded, by_scale))
    if args.save_result:
        write_json(args.save_result, {**_header(args, "capacity"), "slo": slo.to_json(),
                                      "search": "time_scale" if by_scale else "rate",
                                      "preemption_threshold": args.preemption_threshold, "results": results})
    if args.plot:
        pts = [p for r in results for p in r["curve"]]
        plot_capacity(args.plot, pts, slo, "1 / time scale" if by_scale else "request rate (req/s)")
    return 0 if all(r["spread"]["found"] for r in results) else 1


def _measure_fn(session: Session, base: ArrivalConfig, slo: SLO, threshold: float, by_scale: bool, rep: int):
    async def measure(load_: float) -> cap.PointOutcome:
        arrival = replace(base, seed=base.seed + rep,
                          **({"time_scale": 1 / load_} if by_scale else {"rate": load_}))
        p = await run_point(session, arrival, slo)
        outcome = cap.evaluate_point(load_, p.summary, slo, threshold)
        what = f"time_scale={1 / load_:.4g}" if by_scale else f"rate={load_:.4g}"
        verdict = "pass" if outcome.passed else "FAIL: " + "; ".join(outcome.reasons)
        print(f"  {what}: {verdict}", file=sys.stderr)
        return outcome
    return measure


def _capacity_line(value, sp: dict, bounded: bool, by_scale: bool) -> str:
    unit = "time scale" if by_scale else "req/s"
    head = f"value={value}: " if value is not None else ""
    if not sp["found"]:
        return f"{head}no load met the SLO (lowest tried failed)"
    bound = "" if bounded else " (a lower bound: the highest load tried still passed)"
    return (f"{head}operating limit {sp['mean']:.4g} {unit} (std {sp['std']:.3g}, min {sp['min']:.4g}, "
            f"max {sp['max']:.4g} over {sp['found']}/{sp['repeats']} repeats){bound}")


COMMANDS = {"serve": serve, "sweep": sweep, "capacity": capacity}
