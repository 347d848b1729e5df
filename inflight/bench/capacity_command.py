"""``inflight bench capacity``: the highest sustained load meeting the aggregate SLOs, per
server knob value (``limit.find_limit``), with the machine it ran on; a simulated N-replica
what-if is compared with one replica on the same profile."""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import replace
from typing import Any

from inflight.bench.connect import Run, calibration, connector, header
from inflight.bench.limit import Connect, LimitResult, Predictor, SharedPoints, find_limit, limit_line
from inflight.bench.machine import describe_machine
from inflight.bench.report import plot_capacity, write_json
from inflight.bench.report_page import write_report
from inflight.bench.session import Session
from inflight.bench.tiers import tier_lines, tier_table
from inflight.bench.vllm_result import result_path


async def capacity(run: Run) -> int:
    config = run.config
    plan = config.plan()
    space, th = plan.space, plan.thresholds
    machine_start = describe_machine()
    results = []
    for value in config.server.knob_values():
        async with contextlib.AsyncExitStack() as stack:
            command = config.server.command(value)
            predict: Predictor | None = None
            pids: list[int] | None = None
            if config.server.calibrate:
                command, predict, pids = calibration(run, command, value)
            connect = connector(run, stack, command, value or "server", pids)
            if config.tiers:
                found = await _per_tier(run, _once(connect), value, predict)
            else:
                found = [await find_limit(connect, plan.base, plan.slo, space, th, label=value, predictor=predict)]
        for k, res in enumerate(found):
            res.command = command
            name = None if not config.tiers else ("" if value is None else f"value={value}, ") + \
                f"tier {config.tiers[k].name}"
            print(("SIMULATED " if run.simulated else "") + limit_line(res, space.by_scale, space.unit, name))
        results += found
    doc: dict[str, Any] = {
        **header(config, "capacity"), "simulated": run.simulated,
        "machine": {"start": machine_start, "end": describe_machine()},
        "slo": plan.slo.to_json(), "search": space.name,
        "hold_duration": space.hold_duration, "arrival": plan.base.describe(), "thresholds": th.__dict__.copy(),
        "preemption_threshold": th.preemption_threshold, "results": [r.to_json() for r in results]}
    if config.tiers:
        doc["tiers"] = tier_table(config.tiers, config.server.knob_values(), results)
        print(tier_lines(doc["tiers"]))
    if config.simulate is not None and config.simulate.replicas > 1:
        doc["one_replica"] = await _one_replica_baseline(run, results)
    out = result_path(config, "capacity", config.load.model)
    if out:
        write_json(out, doc)
    if config.output.plot:
        pts = [p for r in results for p in r.curve]
        plot_capacity(config.output.plot, pts, plan.slo, "1 / time scale" if space.by_scale else
                      "users" if space.users else "request rate (req/s)")
    if config.output.report:
        path = write_report(config.output.report, doc)
        print(f"report: {path}")
    return 0 if all(r.spread["found"] for r in results) else 1


async def _per_tier(run: Run, connect: Connect, value: str | None, predict: Predictor | None) -> list[LimitResult]:
    """The users sustained per ``--slo-tiers`` tier, one search each over points they share
    (``limit.SharedPoints``): a point measured for one tier is judged again for the next
    where its looks suffice. Each search starts at its tier's prediction (``--calibrate``),
    else at the last one's limit."""
    plan = run.config.plan()
    shared: SharedPoints = {}
    space = plan.space
    out = []
    for tier in run.config.tiers:
        print(f"tier {tier.name}", file=sys.stderr)
        label = tier.name if value is None else f"{value}, {tier.name}"
        res = await find_limit(connect, plan.base, tier.slo(plan.slo), space, plan.thresholds, label=label,
                               predictor=predict, shared=shared)
        out.append(res)
        if res.limits and res.limits[0] is not None:
            space = replace(space, start=min(max(res.limits[0], space.lo), space.hi))
    return out


def _once(connect: Connect) -> Connect:
    """``connect``, run once: every tier's search uses the same server and session."""
    opened: list[Session] = []

    async def once() -> Session:
        if not opened:
            opened.append(await connect())
        return opened[0]
    return once


async def _one_replica_baseline(run: Run, results: list[LimitResult]) -> list[dict[str, Any]]:
    """A simulated what-if with N replicas is compared with one replica on the same
    profile, workload and engine (one thing changed). N replicas predicting a lower limit
    than one is said, with how the router spread the work where N failed."""
    config = run.config
    assert config.simulate is not None
    replicas = config.simulate.replicas
    one = replace(run, config=replace(config, simulate=replace(config.simulate, replicas=1,
                                                                router="prefix_affinity")))
    plan = config.plan()
    out = []
    for value, res in zip(config.server.knob_values(), results):
        async with contextlib.AsyncExitStack() as stack:
            base_res = await find_limit(connector(one, stack, config.server.command(value), value or "server"),
                                        plan.base, plan.slo, plan.space, plan.thresholds, label=value,
                                        log=io.StringIO())
        n, single = res.spread["mean"], base_res.spread["mean"]
        line = (f"SIMULATED {replicas} replicas: {_f4(n)}; one replica on the same profile: {_f4(single)}"
                + (f" ({n / single:.2f}x)" if n and single else ""))
        why = None
        if single is not None and (n is None or n < single):
            why = _imbalance(res)
            line += (f". {replicas} replicas predict LESS than one: {why}" if why else
                     f". {replicas} replicas predict LESS than one; the router spread the work evenly, so the "
                     f"difference is the simulation's noise draws (a profile with a poor fit or a busy host makes "
                     f"them large: see its warnings)")
        print(line)
        out.append({"value": value, "replicas": replicas, "limit": n, "one_replica_limit": single,
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
