"""The ``bench`` sub-commands: ``serve`` (one run), ``sweep`` (runs over loads and server
knob values) and ``capacity`` (the SLO operating limit); ``tune`` is in
:mod:`inflight.bench.tune`. Each takes the parsed arguments and returns an exit code; the
parser is in :mod:`inflight.bench.arguments`."""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import io
import math
import os
import shlex
import sys
from dataclasses import replace

from inflight.bench.client import make_client
from inflight.bench.datasets import DatasetConfig
from inflight.bench.report import (format_summary, plot_capacity, plot_run, plot_sweep, point_row,
                                   write_csv, write_json)
from inflight.bench.limit import LimitResult, SearchSpace, find_limit, limit_line
from inflight.bench.machine import HostLoad, describe_machine, probe_host
from inflight.bench.report_page import write_report
from inflight.bench.session import ArrivalConfig, LoadConfig, PointResult, Session, open_session, records_json, run_point
from inflight.bench.server_proc import ServerProcess
from inflight.bench.summary import SLO, parse_slo
from inflight.bench.sustain import (DEFAULT_PREEMPTION_THRESHOLD, DEFAULT_QUEUE_TOLERANCE, DEFAULT_RATE_TOLERANCE,
                                    Thresholds, Verdict, evidence_lines, strictest_n_min)
from inflight.bench.vllm_compat import (format_vllm_block, merge_goodput, parse_metric_percentiles,
                                        parse_percentile_metrics, resolve_vllm_args, result_path, vllm_header,
                                        vllm_result)


DEFAULT_WINDOW_S = {"capacity": 60.0, "tune": 60.0}  # --duration where a point must be a steady state


def configs(args) -> tuple[LoadConfig, DatasetConfig, ArrivalConfig, SLO]:
    """The run's configurations from parsed flags, vLLM's spellings folded into ours
    (``vllm_compat.resolve_vllm_args``); ValueError on flags that contradict."""
    resolve_vllm_args(args)
    command = getattr(args, "bench_command", None)
    reset = args.reset_prefix_cache
    if reset is None:
        # A search re-sends the same prompts at every load: without a reset, later points
        # would find them cached and skip their prefill.
        reset = command in DEFAULT_WINDOW_S
    load = LoadConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint_type, api_key=args.api_key,
                      temperature=args.temperature, extra_body=args.extra_body,
                      request_timeout=args.request_timeout, max_concurrency=args.max_concurrency,
                      num_warmups=args.num_warmups, scrape_metrics=args.metrics,
                      reset_prefix_cache=reset,
                      metrics_interval=args.metrics_interval, tokenize=args.tokenize,
                      tokenizer=args.tokenizer, progress=not args.disable_tqdm)
    if not getattr(args, "simulate", None) and (getattr(args, "replicas", 1) != 1
                                                or getattr(args, "router", "prefix_affinity") != "prefix_affinity"):
        raise ValueError("--replicas and --router simulate replicas: they need --simulate PROFILE.json "
                         "(a real run measures the server at --base-url as it is)")
    if args.shuffle and args.arrival == "trace":
        raise ValueError("--shuffle would scramble the trace's arrival times; it needs a rate (--arrival poisson ...)")
    shuffle = args.shuffle if args.shuffle is not None else (args.dataset == "trace" and args.arrival != "trace")
    dataset = DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                            data_dir=args.data_dir, input_len=args.input_len, output_len=args.output_len,
                            range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                            trace_file=args.trace_file, trace_format=args.trace_format,
                            trace_skip=args.trace_skip, length_scale=args.length_scale,
                            min_input_len=args.min_input_len, max_input_len=args.max_input_len,
                            min_output_len=args.min_output_len, max_output_len=args.max_output_len,
                            prefix_blocks=args.prefix_blocks, chat_file=args.chat_file,
                            sonnet_file=getattr(args, "sonnet_file", None),
                            ignore_eos=args.ignore_eos, shuffle=shuffle,
                            conversation_turns=args.conversation_turns,
                            active_conversations=args.active_conversations or DatasetConfig.active_conversations)
    if args.conversation_turns > 1 and args.dataset != "chat":
        raise ValueError("--conversation-turns replays multi-turn chats: it needs --dataset chat")
    if args.active_conversations is not None and args.conversation_turns == 1:
        raise ValueError("--active-conversations shapes a multi-turn replay: it needs --conversation-turns > 1")
    if dataset.conversation_turns > 1 and dataset.num_prompts <= dataset.active_conversations:
        print(f"note: the first {dataset.active_conversations} requests of the mix are first turns "
              f"(--active-conversations); with --num-prompts {dataset.num_prompts} no follow-up "
              f"turn is sent unless a measurement window extends the mix", file=sys.stderr)
    if args.arrival == "poisson" and args.burstiness != 1.0:
        raise ValueError("--burstiness needs --arrival gamma")
    if args.arrival == "trace" and args.dataset != "trace":
        raise ValueError("--arrival trace needs --dataset trace")
    slo = merge_goodput(parse_slo(args.slo), args)
    duration = args.duration if args.duration is not None else DEFAULT_WINDOW_S.get(command)
    if duration is not None and not duration > 0:
        raise ValueError("--duration must be > 0")
    if duration is None and (args.warmup_duration is not None or args.drain_timeout is not None):
        raise ValueError("--warmup-duration and --drain-timeout need --duration (a measurement window)")
    min_requests = max(args.num_prompts, strictest_n_min(slo, args.confidence)) if duration else 0
    arrival = ArrivalConfig(process=args.arrival, rate=args.request_rate, burstiness=args.burstiness,
                            time_scale=args.time_scale, seed=args.seed, duration=duration,
                            warmup_duration=args.warmup_duration, drain_timeout=args.drain_timeout,
                            min_requests=min_requests)
    return load, dataset, arrival, slo


def thresholds(args) -> Thresholds:
    """What a sustained point must show, from the flags (sustain.Thresholds' defaults)."""
    return Thresholds(confidence=args.confidence,
                      rate_tolerance=getattr(args, "rate_tolerance", DEFAULT_RATE_TOLERANCE),
                      queue_tolerance=getattr(args, "queue_tolerance", DEFAULT_QUEUE_TOLERANCE),
                      preemption_threshold=getattr(args, "preemption_threshold", DEFAULT_PREEMPTION_THRESHOLD))


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
    if session.simulation is not None:
        sim = session.simulation
        print(f"SIMULATED: {sim.profile.describe()}, {sim.replicas} replica(s)"
              f"{f' behind {sim.router}' if sim.replicas > 1 else ''}; engine from "
              f"{sim.command or 'the profile'}; {len(session.specs)} requests prepared in "
              f"{session.prepare_seconds:.1f} s", file=sys.stderr)
        return
    print(f"model {session.model} at {session.load.base_url} ({session.endpoint}); "
          f"{len(session.specs)} requests prepared in {session.prepare_seconds:.1f} s "
          f"(tokenizer: {session.tokenizer_mode})", file=sys.stderr)


@contextlib.asynccontextmanager
async def _server(args, command: str, name=None):
    """Start ``command`` as the server under test; stop it on exit, however the block ends."""
    log = None
    if args.server_log_dir:
        os.makedirs(args.server_log_dir, exist_ok=True)
        log = os.path.join(args.server_log_dir, f"server-{_safe(name)}.log")
    proc = ServerProcess(command, args.base_url, args.server_start_timeout, args.server_stop_timeout, log)
    print(f"starting: {proc.command}", file=sys.stderr)
    async with proc:
        yield proc
    print(f"stopped (exit {proc.proc.returncode if proc.proc else None}); log: {proc.log_path}", file=sys.stderr)


def _safe(name) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in str(name))[:120] or "server"


async def open_any_session(args, load: LoadConfig, dataset: DatasetConfig, stack: contextlib.AsyncExitStack,
                           command: str | None) -> Session:
    """The run's session: simulated with ``--simulate`` (engine settings from ``command``,
    else the profile's), else over HTTP with a client that ``stack`` closes."""
    if getattr(args, "simulate", None):
        from inflight.sim.bench import open_sim_session, sim_setup
        session = await open_sim_session(load, dataset, sim_setup(args.simulate, command, args.replicas, args.router))
    else:
        client = await stack.enter_async_context(make_client(timeout=load.request_timeout))
        session = await open_session(load, dataset, client)
    _note_session(session)
    return session


def _title(args, base: str) -> str:
    return f"{base} (SIMULATED)" if getattr(args, "simulate", None) else base


@contextlib.asynccontextmanager
async def _maybe_server(args, value):
    if not args.serve_cmd or getattr(args, "simulate", None):
        yield None
        return
    async with _server(args, args.serve_cmd.replace("{value}", str(value)), value or "server") as proc:
        yield proc


def _values(args) -> list:
    """The knob values to start ``--serve-cmd`` with; [None] for one server as given."""
    if args.values and not args.serve_cmd:
        raise ValueError("--values needs --serve-cmd")
    if args.serve_cmd and "{value}" in args.serve_cmd and not args.values:
        raise ValueError("--serve-cmd with {value} needs --values")
    if args.values and "{value}" not in args.serve_cmd:
        raise ValueError("--values needs {value} in --serve-cmd")
    return args.values or [None]


def serve_result(args, session: Session, point: PointResult, verdict: Verdict | None = None) -> dict:
    """The JSON document of one run: command, fixed conditions, aggregates, every request;
    and, at the top level, vLLM's ``bench serve`` keys (``vllm_compat.vllm_result``)."""
    vllm = {**vllm_header(args, session.model, session.endpoint),
            **vllm_result(point.records, point.summary, parse_percentile_metrics(args.percentile_metrics),
                          parse_metric_percentiles(args.metric_percentiles))}
    return {**vllm, **_header(args, "serve"), "simulated": simulated(session), "fixed": session.fixed(),
            "arrival": point.arrival.describe(),
            "offered_rate": offered_rate([r.scheduled_time for r in point.records if r.phase == "sample"]),
            "prepare_seconds": session.prepare_seconds, "summary": point.summary,
            "verdict": verdict.to_json() if verdict else None,
            "server_metrics": {"samples": point.metrics_samples, "counter_deltas": point.counters},
            "requests": records_json(point.records)}


def simulated(session: Session) -> dict | None:
    """The simulation's settings (profile, replicas, router, engine) or None for a real run."""
    return session.simulation.describe() if session.simulation is not None else None


def _verdict(point: PointResult, slo: SLO, args) -> Verdict | None:
    """The sustained-load verdict of a windowed point with aggregate SLOs, else None."""
    if point.window is None or not slo.aggregate:
        return None
    return point.verdict(slo, thresholds(args))


def _print_verdict(v: Verdict, file=None) -> None:
    head = "sustained within the SLO" if v.passed else "NOT sustained: " + "; ".join(v.reasons)
    print(f"verdict: {head}", file=file)
    for line in evidence_lines(v.evidence):
        print(f"    {line}", file=file)


async def serve(args) -> int:
    load, dataset, arrival, slo = configs(args)
    async with contextlib.AsyncExitStack() as stack:
        if args.serve_cmd and not args.simulate:
            await stack.enter_async_context(_server(args, args.serve_cmd))
        session = await open_any_session(args, load, dataset, stack, args.serve_cmd)
        point = await run_point(session, arrival, slo)
    print(format_summary(point.summary, _title(args, "inflight bench serve")))
    verdict = _verdict(point, slo, args)
    if verdict is not None:
        _print_verdict(verdict)
    if args.percentile_metrics or args.metric_percentiles:
        metrics = parse_percentile_metrics(args.percentile_metrics)
        percentiles = parse_metric_percentiles(args.metric_percentiles)
        print(format_vllm_block(vllm_result(point.records, point.summary, metrics, percentiles), metrics,
                                percentiles))
    path = result_path(args, "serve", session.model, session.endpoint)
    if path:
        write_json(path, serve_result(args, session, point, verdict))
        print(f"result: {path}", file=sys.stderr)
    if args.plot:
        plot_run(args.plot, point.records, point.metrics_samples,
                 title=_title(args, f"{session.model}: {dataset.name}, {arrival.process} rate {args.request_rate:g}"))
    return 0 if point.summary["completed"] > 0 else 1


async def sweep(args) -> int:
    load, dataset, base, slo = configs(args)
    if base.process == "trace":
        xs, key = args.time_scales or [base.time_scale], "time_scale"
    else:
        xs, key = args.request_rates or [base.rate], "rate"
    rows, points = [], []
    for value in _values(args):
        command = args.serve_cmd.replace("{value}", str(value)) if args.serve_cmd else None
        async with _maybe_server(args, value), contextlib.AsyncExitStack() as stack:
            session = await open_any_session(args, load, dataset, stack, command)
            for x in xs:
                arrival = replace(base, **{key: x})
                p = await run_point(session, arrival, slo)
                verdict = _verdict(p, slo, args)
                sample = [r.scheduled_time for r in p.records if r.phase == "sample"]
                offered = offered_rate(sample)
                row = point_row(p.summary, value=value, rate=offered if key == "time_scale" else x,
                                time_scale=x if key == "time_scale" else None, offered_rate=offered,
                                sustained=None if verdict is None else verdict.passed)
                rows.append(row)
                points.append({"value": value, "arrival": arrival.describe(), "summary": p.summary,
                               "fixed": session.fixed(), "server_counters": p.counters,
                               "verdict": verdict.to_json() if verdict else None})
                print(_row_line(row), file=sys.stderr)
                if verdict is not None:
                    _print_verdict(verdict, sys.stderr)
    _print_rows(rows, _title(args, "inflight bench sweep"))
    path = result_path(args, "sweep", args.model)
    if path:
        write_json(path, {**_header(args, "sweep"), "simulated": bool(args.simulate),
                                      "slo": slo.to_json(), "rows": rows, "points": points})
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


def _print_rows(rows: list[dict], title: str = "inflight bench sweep") -> None:
    print("=" * 20 + f" {title} " + "=" * 20)
    for r in rows:
        print(_row_line(r))


def search_space(args, base: ArrivalConfig) -> SearchSpace:
    """The capacity search over rates, or over 1 / time scale for trace replay; its limit
    held for ``--hold-duration`` (default 5 windows)."""
    hold = args.hold_duration if args.hold_duration is not None else 5 * (base.duration or 0)
    if hold < 0:
        raise ValueError("--hold-duration must be >= 0")
    if hold and base.duration and hold <= base.duration:
        raise ValueError(f"--hold-duration {hold:g} s is not longer than a search window (--duration "
                         f"{base.duration:g} s): a hold would only repeat the search's point (0 turns holds off)")
    common = dict(tolerance=args.tolerance, max_points=args.max_points, repeats=args.repeats,
                  hold_duration=hold or None, max_holds=args.max_holds, max_extensions=args.max_extensions)
    if base.process == "trace":
        return SearchSpace(True, 1 / base.time_scale, 1 / args.time_scale_max, 1 / args.time_scale_min, **common)
    return SearchSpace(False, args.rate_start, args.rate_min, args.rate_max, **common)


def require_aggregate(slo: SLO) -> None:
    if not slo.aggregate:
        raise ValueError("an operating limit needs aggregate SLOs, e.g. --slo ttft_p95=1s,itl_p95=100ms")


def connector(args, load: LoadConfig, dataset: DatasetConfig, stack: contextlib.AsyncExitStack,
              command: str | None, value=None, pids: list[int] | None = None):
    """A ``connect()`` for ``limit.find_limit``: start the server (``command``, if any) and
    open the session on first use; ``stack`` closes both. The host is probed first (what
    else runs here: ``machine.probe_host``); a busy one is named at once, and with
    ``--on-busy-host stop`` ends the run. ``pids`` receives the started server's pid."""
    async def connect() -> Session:
        own: list[int] = []
        if command is not None and not getattr(args, "simulate", None):
            proc = await stack.enter_async_context(_server(args, command, value))
            if proc.proc is not None:
                own.append(proc.proc.pid)
                if pids is not None:
                    pids.append(proc.proc.pid)
        if not getattr(args, "simulate", None):
            await check_host(args, own)
        return await open_any_session(args, load, dataset, stack, command)
    return connect


async def check_host(args, pids: list[int]) -> HostLoad | None:
    """Probe the host for ``HOST_PROBE_S`` before measuring; say at once if it is busy.

    Raises:
        RuntimeError: busy, with ``--on-busy-host stop``.
    """
    host = await probe_host(HOST_PROBE_S, pids)
    if host is None:
        return None
    if host.is_busy():
        message = (f"the host is busy before the run: {host.describe()}. On a shared machine every step "
                   f"slows with it, and the limit measured is this host's at this time, not the server's")
        if getattr(args, "on_busy_host", "warn") == "stop":
            raise RuntimeError(message + " (--on-busy-host stop)")
        print(f"WARNING: {message}", file=sys.stderr)
    else:
        print(f"host: idle before the run ({host.describe()})", file=sys.stderr)
    return host


HOST_PROBE_S = 3.0


def calibration(args, command: str | None, load: LoadConfig, dataset: DatasetConfig, base: ArrivalConfig,
                slo: SLO, space: SearchSpace, th: Thresholds, value=None):
    """``--calibrate``: the server command with ``--step-log`` added, the ``limit.Predictor``
    that ramps it, fits its steps and simulates the search, and the server pids it will
    read (filled by ``connector``). ValueError where calibration cannot run."""
    if getattr(args, "simulate", None):
        raise ValueError("--calibrate measures a real server; --simulate has nothing to calibrate")
    if not command:
        raise ValueError("--calibrate needs --serve-cmd 'inflight serve ...': it adds --step-log to the "
                         "server command to fit the server's own steps")
    from inflight.sim.bench import parse_serve_command
    from inflight.sim.calibrate import CalibratedPredictor

    parse_serve_command(command)  # ValueError: not an inflight server
    folder = args.report or args.server_log_dir
    if folder is None:
        import tempfile
        folder = tempfile.mkdtemp(prefix="inflight-calibrate-")
    os.makedirs(folder, exist_ok=True)
    step_log = os.path.join(folder, f"steps-{_safe(value or 'server')}.jsonl")
    profile = os.path.join(folder, f"profile-{_safe(value or 'server')}.json")
    command = f"{command} --step-log {shlex.quote(step_log)}"
    pids: list[int] = []
    predictor = CalibratedPredictor(step_log, command, load, dataset, base, slo, space, th, pids, profile_out=profile)
    return command, predictor, pids


async def capacity(args) -> int:
    load, dataset, base, slo = configs(args)
    require_aggregate(slo)
    space, th = search_space(args, base), thresholds(args)
    machine_start = describe_machine()
    results = []
    for value in _values(args):
        async with contextlib.AsyncExitStack() as stack:
            command = args.serve_cmd.replace("{value}", str(value)) if args.serve_cmd else None
            predict, pids = None, None
            if getattr(args, "calibrate", False):
                command, predict, pids = calibration(args, command, load, dataset, base, slo, space, th, value)
            res = await find_limit(connector(args, load, dataset, stack, command, value or "server", pids), base,
                                   slo, space, th, label=value, predictor=predict)
            res.command = command
        results.append(res)
        print(("SIMULATED " if args.simulate else "") + limit_line(res, space.by_scale))
    doc = {**_header(args, "capacity"), "simulated": bool(args.simulate), "machine": {"start": machine_start, "end": describe_machine()},
           "slo": slo.to_json(), "search": "time_scale" if space.by_scale else "rate",
           "arrival": base.describe(), "thresholds": th.__dict__.copy(), "preemption_threshold": th.preemption_threshold,
           "results": [r.to_json() for r in results]}
    if args.simulate and args.replicas > 1:
        doc["one_replica"] = await _one_replica_baseline(args, load, dataset, base, slo, space, th, results)
    out = result_path(args, "capacity", args.model)
    if out:
        write_json(out, doc)
    if args.plot:
        pts = [p for r in results for p in r.curve]
        plot_capacity(args.plot, pts, slo, "1 / time scale" if space.by_scale else "request rate (req/s)")
    if args.report:
        path = write_report(args.report, doc)
        print(f"report: {path}")
    return 0 if all(r.spread["found"] for r in results) else 1


async def _one_replica_baseline(args, load: LoadConfig, dataset: DatasetConfig, base: ArrivalConfig, slo: SLO,
                                space: SearchSpace, th: Thresholds, results: list[LimitResult]) -> list[dict]:
    """A simulated what-if with N replicas is compared with one replica on the same
    profile, workload and engine (one thing changed). N replicas predicting a lower limit
    than one is said, with how the router spread the work where N failed."""
    one = copy.copy(args)
    one.replicas, one.router = 1, "prefix_affinity"
    out = []
    for value, res in zip(_values(args), results):
        command = args.serve_cmd.replace("{value}", str(value)) if args.serve_cmd else None
        async with contextlib.AsyncExitStack() as stack:
            base_res = await find_limit(connector(one, load, dataset, stack, command, value or "server"), base, slo,
                                        space, th, label=value, log=io.StringIO())
        n, single = res.spread["mean"], base_res.spread["mean"]
        line = (f"SIMULATED {args.replicas} replicas: {_f4(n)}; one replica on the same profile: {_f4(single)}"
                + (f" ({n / single:.2f}x)" if n and single else ""))
        why = None
        if single is not None and (n is None or n < single):
            why = _imbalance(res)
            line += (f". {args.replicas} replicas predict LESS than one: {why}" if why else
                     f". {args.replicas} replicas predict LESS than one; the router spread the work evenly, so the "
                     f"difference is the simulation's noise draws (a profile with a poor fit or a busy host makes "
                     f"them large: see its warnings)")
        print(line)
        out.append({"value": value, "replicas": args.replicas, "limit": n, "one_replica_limit": single,
                    "explanation": why})
    return out


def _imbalance(res: LimitResult) -> str | None:
    """How unevenly the replicas worked at the first failing point above the limit, if
    one replica did most of it (the router's doing, not the machine's)."""
    above = [p for p in res.curve if not p["passed"]]
    if not above:
        return None
    point = min(above, key=lambda p: p["load"])
    reps = (((point.get("summary") or {}).get("simulation") or {}).get("replicas")) or []
    tokens = [r.get("generation_tokens", 0) for r in reps]
    if len(tokens) < 2 or not sum(tokens):
        return None
    share = max(tokens) / sum(tokens)
    if share < 1.5 / len(tokens):
        return None
    return (f"at {point['x']:.4g} the router ({res.fixed.get('server_info', {}).get('simulation', {}).get('router')}) "
            f"gave one replica {share:.0%} of the generated tokens")


def _f4(v: float | None) -> str:
    return "none" if v is None else f"{v:.4g}"


COMMANDS = {"serve": serve, "sweep": sweep, "capacity": capacity}
