"""Limit results as JSON: one configuration's (``LimitResult.to_json``, live or saved) and
the document of ``bench capacity`` or ``bench tune`` that holds them.

A result's ``curve`` is every point measured, with its evidence: ``crossings``,
``best_point`` and ``lost_because`` read it. The document keeps the results in a capacity
run's ``results`` or a tune run's ``knobs``; ``knob_groups`` and ``recommended`` read both
alike (the report page and its plots).
"""

from __future__ import annotations

import math
from typing import Any

# [(knob name, [(value as printed, LimitResult JSON), ...]), ...]
KnobGroups = list[tuple[str, list[tuple[str, dict[str, Any]]]]]


def knob_groups(doc: dict[str, Any]) -> KnobGroups:
    """Each knob's results, by value, for capacity and tune alike. A capacity run is one
    group: ``value`` when it compared configurations, ``server`` when it measured one."""
    if doc.get("kind") == "tune":
        return [(k["knob"], [(str(v["value"]), v) for v in k["values"]]) for k in doc["knobs"]]
    results = doc["results"]
    name = "value" if len(results) > 1 or results[0].get("value") is not None else "server"
    return [(name, [("-" if r.get("value") is None else str(r["value"]), r) for r in results])]


def recommended(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The result the page leads with: tune's recommendation, or the capacity result with
    the highest mean limit (lowest, for a time-scale search); None when none found one."""
    if doc.get("kind") == "tune":
        best: dict[str, Any] | None = doc["recommended"]
        return best
    found: list[dict[str, Any]] = [r for r in doc["results"] if r["spread"]["mean"] is not None]
    if not found:
        return None

    def mean(r: dict[str, Any]) -> float:
        return float(r["spread"]["mean"])
    return min(found, key=mean) if doc.get("search") == "time_scale" else max(found, key=mean)


def json_number(v: float | str | None) -> float:
    """A JSON number as float: None is nan; "inf" (how ``report.write_json`` keeps
    non-finite floats) is inf; any other string is nan."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return float(v)


def held_seconds(result: dict[str, Any]) -> float:
    """The longest hold window (s) among a result's holds; 0 without holds."""
    holds = [p for p in result["curve"] if p.get("held")]
    return max((float(p["evidence"]["window"]["seconds"]) for p in holds), default=0.0)


def crossings(curve: list[dict[str, Any]], targets: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Where each SLO statistic's estimate crosses its target along the search points (all
    repeats, holds left out, by load): between the highest load whose estimate is within
    the target and the next load measured above it, interpolated with the logarithm of the
    estimate linear in load (latency grows about exponentially toward saturation). An
    infinite estimate above puts the crossing at the pair's geometric mean. ``load`` is
    None where the curve never crosses (``below`` or ``above`` the target at every load)."""
    pts = sorted((p for p in curve if not p.get("held")), key=lambda p: p["load"])
    out: dict[str, dict[str, Any]] = {}
    for key, target in targets.items():
        est = [(p["load"], p["x"], ((p.get("evidence") or {}).get("slo") or {}).get(key, {}).get("estimate"))
               for p in pts]
        est = [e for e in est if e[2] is not None]
        under = [i for i, e in enumerate(est) if e[2] <= target]
        if not est:
            continue
        if not under:
            out[key] = {"load": None, "x": None, "where": "above the target at every load measured"}
            continue
        i = max(under)
        if i == len(est) - 1:
            out[key] = {"load": None, "x": None, "where": "within the target at every load measured"}
            continue
        (la, xa, ea), (lb, xb, eb) = est[i], est[i + 1]
        if math.isinf(eb) or ea <= 0:
            load = math.sqrt(la * lb)
        else:
            f = (math.log(target) - math.log(ea)) / max(math.log(eb) - math.log(ea), 1e-12)
            load = la + min(max(f, 0.0), 1.0) * (lb - la)
        x = 1 / load if xa != la else load  # a time scale where the search runs over 1 / scale
        out[key] = {"load": load, "x": x, "between": [xa, xb], "target": target}
    return out


def best_point(result: dict[str, Any]) -> dict[str, Any] | None:
    """The point that set the highest limit of a ``LimitResult.to_json()`` (or its saved
    JSON): the highest passing load, among the holds where the limit was held. Its p95s
    and timeline are the figures at the limit."""
    held = result.get("held", False)
    passing = [p for p in result["curve"] if p["passed"] and p.get("held", False) == held]
    return max(passing, key=lambda p: p["load"], default=None)


def lost_because(result: dict[str, Any]) -> list[str]:
    """Why loads above the limit failed: the verdict causes at each repeat's first failing
    load above its limit (search point or hold), in order of first appearance."""
    causes: list[str] = []
    for rep, above in enumerate(result["failed_above"]):
        for p in result["curve"]:
            if p["repeat"] == rep and not p["passed"] and above is not None and p["x"] == above:
                causes += [c for c in p["evidence"].get("causes", []) if c not in causes]
    return causes


# The error code inflight's server sheds a request with (HTTP 503; ``core/overload.py``).
SHED_CODE = "server_overloaded"


def shed_note(curve: list[dict[str, Any]]) -> str | None:
    """Where points of ``curve`` (a result's) failed on requests the server shed (HTTP 503
    ``server_overloaded``: its overload protection, ``inflight serve --overload-ttft``, 1 s
    by default), the note that says so: such a load failed on the server's own threshold,
    not on the SLO, so a TTFT target above that threshold is never what bounds the limit.
    None otherwise."""
    shed = sorted({p["x"] for p in curve
                   if not p["passed"] and any(SHED_CODE in r for r in p.get("reasons", []))})
    if not shed:
        return None
    return (f"at {', '.join(f'{x:.4g}' for x in shed)} the server shed requests (HTTP 503 "
            f"{SHED_CODE}): its overload protection refused load before the SLO was judged; "
            "for the SLO's own limit, start it with --overload-ttft at or above the TTFT "
            "target (0: off)")
