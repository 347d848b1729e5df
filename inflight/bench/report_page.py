"""The operating-limit report: one Markdown page with PNG plots a person can hand over.

``write_report(DIR, doc)`` takes the JSON document of ``bench capacity`` or ``bench tune``
and writes ``DIR/report.md`` beside the plots of ``limit_plots``: ``lengths.png``,
``latency_vs_load*.png``, ``at_limit.png`` (at the recommended configuration's limit) and
``capacity.png``.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass
from typing import Any

from inflight.bench.limit_doc import (KnobGroups, best_point, held_seconds, json_number, knob_groups, lost_because,
                                      recommended, shed_note)
from inflight.bench.limit_plots import plot_at_limit, plot_capacity_bars, plot_latency_vs_load, plot_lengths
from inflight.bench.machine import cpu_shares
from inflight.bench.tiers import tier_lines

Json = dict[str, Any]


def _s(v: float | str | None, digits: int = 3) -> str:
    """A number for the page: ``-`` for none, ``inf`` as such (JSON keeps it as a string)."""
    v = json_number(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v
    if v is None or isinstance(v, str) or math.isnan(v):
        return "-" if not isinstance(v, str) else v
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def _iv(iv: Json | None) -> str:
    if not iv:
        return "-"
    return f"{_s(iv['estimate'])} s [{_s(iv['lo'])}, {_s(iv['hi'])}]"


def _workload_lines(doc: Json, fixed: Json) -> list[str]:
    ds = fixed.get("dataset") or doc.get("args", {})
    arr = doc.get("arrival") or {}
    lengths = fixed.get("lengths") or {}
    out = [f"- dataset: `{ds.get('name')}`" + (f", trace `{ds.get('trace_file')}`" if ds.get("name") == "trace" else "")
           + (f", rows from {ds.get('trace_skip')}" if ds.get("trace_skip") else "")]
    if ds.get("name") == "trace":
        out.append(f"- scaling: lengths x{ds.get('length_scale')}, prompt tokens capped at {ds.get('max_input_len')}, "
                   f"output at {ds.get('max_output_len')}")
    out.append(f"- output length: {'max_tokens with ignore_eos' if ds.get('ignore_eos') else 'natural EOS, up to max_tokens'}")
    for key, label in (("prompt_len", "prompt tokens"), ("output_len", "max_tokens")):
        st = lengths.get(key)
        if st:
            out.append(f"- {label}: mean {st['mean']:.1f}, median {st['median']:.0f}, min {st['min']}, max {st['max']}")
    proc = arr.get("process")
    if arr.get("users"):  # a closed loop: the users' think times set the arrivals
        out.append(f"- arrivals: closed-loop users, each turn {arr.get('think_distribution')} think time "
                   f"{arr.get('think_time'):g} s after the last answer, seed {arr.get('seed')}")
    else:
        out.append(f"- arrivals: {proc}" + (" (the trace's own times, scaled)" if proc == "trace" else "")
                   + (f", burstiness {arr.get('burstiness')}" if proc == "gamma" else "") + f", seed {arr.get('seed')}")
    if arr.get("duration"):
        after = "the users go on" if arr.get("users") else "cool-down arrivals"
        out.append(f"- each point: {arr.get('warmup_duration'):g} s warm-up (uncounted), a window of at least "
                   f"{arr['duration']:g} s and {arr.get('min_requests')} requests (the sample), then {after} "
                   f"until the sample ends or {arr.get('drain_timeout'):g} s pass")
    return out


def _machine_lines(doc: Json) -> list[str]:
    m = doc.get("machine") or {}
    start, end = m.get("start") or {}, m.get("end") or {}
    if not start:
        return ["- not recorded"]
    return [f"- {start.get('cpu')}, {start.get('cores')} logical cores, {start.get('memory_gib')} GiB, "
            f"{start.get('os')}, Python {start.get('python')}",
            f"- load average (1/5/15 min): {start.get('loadavg')} at the start ({start.get('time')}), "
            f"{end.get('loadavg')} at the end ({end.get('time')})",
            *_busy_lines(start), *_cpu_share_lines(start, end)]


def _busy_lines(start: Json) -> list[str]:
    """A warning when other work held the machine as the run began (its own server and
    client had not started: a 1-minute load average of half the cores is someone else's)."""
    load, cores = start.get("loadavg"), start.get("cores")
    if not load or not cores or load[0] < 0.5 * cores:
        return []
    return [f"- **busy before the run**: 1-minute load average {load[0]:g} on {cores} cores; other work "
            "shared the CPU, so the limit is lower than on an idle machine"]


def _cpu_share_lines(start: Json, end: Json) -> list[str]:
    shares = cpu_shares(start, end)
    if shares is None:
        return []
    line = (f"- CPU time over the run, all cores: {shares['busy']:.0%} busy, {shares['idle']:.0%} idle, "
            f"{shares['steal']:.0%} stolen by the host")
    if shares["steal"] >= 0.05:
        line += " (a contended virtual machine: every step ran slower than on an idle host)"
    return [line]


def _at_limit_lines(point: Json | None) -> list[str]:
    if point is None:
        return ["No load passed."]
    ev = point["evidence"]
    lines = [f"- offered {_s(ev['offered_rate'])} req/s, completed {_s(ev['completed_rate'])} req/s over a "
             f"{_s(ev['window']['seconds'])} s window ({ev['sample']} requests)",
             f"- queue: {ev['queue']['growth']:+.1f} requests over the window's second half "
             f"(tolerance {ev['queue']['tolerance']:.1f}); unfinished {ev['unfinished']}, failed {ev['failed']}"]
    for key, iv in (ev.get("slo") or {}).items():
        lines.append(f"- {key}: {_iv(iv)} (target {iv['target']:g} s, {iv['confidence']:.0%} {iv['method']} "
                     f"interval over {iv['n']} requests)")
    if ev.get("preemptions_per_request") is not None:
        lines.append(f"- preemptions: {ev['preemptions']:.0f} ({ev['preemptions_per_request']:.2f} per request)")
    return lines


def _no_limit_lines(res: Json | None, by_scale: bool, hold_s: float | None) -> list[str]:
    """Why there is no limit: nothing passed, or the search passed and every hold failed
    (``hold_s``: the hold asked for; a hold ends at its first conclusive failure)."""
    holds = [p for p in res.get("curve", []) if p.get("held")] if res is not None else []
    shed = shed_note(res.get("curve", [])) if res is not None else None
    if res is None or not holds:
        return ["**No load met the SLO.**" + (f" Note: {shed}." if shed else ""), ""]
    searched = [p["x"] for p in res["curve"] if p["passed"] and not p.get("held")]
    top = (min(searched) if by_scale else max(searched)) if searched else None
    tried = "; ".join(f"{p['x']:.4g} ({', '.join(p['evidence'].get('causes') or ['failed'])}, "
                      f"after {p['evidence']['window']['seconds']:.0f} s)" for p in holds)
    lowest = max(p["x"] for p in holds) if by_scale else min(p["x"] for p in holds)
    asked = f"{hold_s:.0f} s " if hold_s else ""
    advice = (f"Note: {shed}." if shed else
              "Hold lower (more `--max-holds`, each a step down) or measure on a quieter machine "
              "(see Machine).")
    return [f"**No load held.** The search passed up to {top:.4g} in its windows, and every "
            f"{asked}hold failed (a hold is judged at each third and ends at a conclusive "
            f"failure): {tried}. The operating limit lies "
            + (f"at a time scale above {lowest:.4g}" if by_scale else f"below {lowest:.4g} req/s")
            + f". {advice}", ""]


def _bracket_lines(res: Json, by_scale: bool, unit: str) -> list[str]:
    """The limit as a bracket, where each target is crossed, and the prediction beside it."""
    out = []
    above = [a for a in res.get("failed_above", []) if a is not None]
    lows = [x for x in res.get("limits", []) if x is not None]
    if lows and above:
        lo, hi = (max(lows), max(above)) if by_scale else (min(lows), min(above))
        out.append(f"- bracket: sustained at {lo:.4g}, not at {hi:.4g} {unit} (the limit is the lower end; "
                   f"the width is the search's --tolerance)")
    for key, c in (res.get("crossings") or {}).items():
        if c.get("x") is not None:
            out.append(f"- {key} crosses its target ({_s(c['target'])} s) at about {c['x']:.4g} {unit} "
                       f"(interpolated between {c['between'][0]:.4g} and {c['between'][1]:.4g})")
        else:
            out.append(f"- {key}: {c['where']}")
    pred = res.get("prediction")
    if pred:
        x = pred.get("limit")
        xs = "none" if x is None else f"{(1 / x if by_scale else x):.4g} {unit}"
        use = "used as the search's start" if pred.get("usable") else "not used: " + "; ".join(pred.get("notes", []))
        ramp = pred.get("ramp") or {}
        out.append(f"- predicted by the simulator from this server's own steps (`--calibrate`): {xs}, in "
                   f"{pred.get('seconds', 0):.0f} s including a {ramp.get('seconds', 0):.0f} s ramp ({use})")
    shed = shed_note(res.get("curve", []))
    if shed:
        out.append(f"- {shed}")
    extended = [p for p in res.get("curve", []) if len((p.get("evidence") or {}).get("looks") or []) > 1
                and not p.get("held")]
    if extended:
        out.append(f"- {len(extended)} search point(s) were inconclusive at first and judged over a longer window "
                   "(see Every point)")
    return out + ([""] if out else [])


def _points_table(name: str, values: list[tuple[str, Json]]) -> list[str]:
    out = [f"| {name} | repeat | point | load | offered req/s | completed req/s | queue growth | preempt./req "
           "| SLO estimates [CI] | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for value, res in values:
        for p in sorted(res["curve"], key=lambda p: (p["repeat"], p.get("held", False), p["load"])):
            ev = p["evidence"]
            slo = "; ".join(f"{k} {_iv(iv)}" for k, iv in (ev.get("slo") or {}).items())
            verdict = "pass" if p["passed"] else "fail: " + "; ".join(p["reasons"])
            looks = ev.get("looks") or []
            if len(looks) > 1:
                verdict += " (looks: " + " -> ".join(f"{lk['seconds']:.0f} s {lk['state']}" for lk in looks) + ")"
            kind = f"hold {ev['window']['seconds']:.0f} s" if p.get("held") else "search"
            out.append(f"| {value} | {p['repeat']} | {kind} | {_s(p['x'], 4)} | {_s(ev.get('offered_rate'))} "
                       f"| {_s(ev.get('completed_rate'))} | {ev['queue']['growth']:+.1f} "
                       f"| {_s(ev.get('preemptions_per_request'), 2)} | {slo} | {verdict} |")
    return out


@dataclass
class _Report:
    """What every section of the page reads from the document."""

    doc: Json
    groups: KnobGroups
    best: Json | None  # the recommended result (``limit_doc.recommended``)
    point: Json | None  # the point that set its limit
    by_scale: bool  # the search ran over 1 / time scale
    fixed: Json  # the session's fixed conditions (dataset, lengths, server)
    slo: dict[str, float]

    @classmethod
    def of(cls, doc: Json) -> "_Report":
        groups = knob_groups(doc)
        best = recommended(doc)
        fixed = (best or groups[0][1][0][1]).get("fixed") or {}
        return cls(doc, groups, best, best_point(best) if best else None, doc.get("search") == "time_scale",
                   fixed, doc.get("slo") or {})

    @property
    def unit(self) -> str:
        return "1 / time scale" if self.by_scale else self.load_unit

    @property
    def load_unit(self) -> str:
        """The search's load as a limit is stated: req/s, time scale or users."""
        return "users" if self.doc.get("search") == "users" else "time scale" if self.by_scale else "req/s"


def write_report(out_dir: str | pathlib.Path, doc: Json) -> pathlib.Path:
    """Write ``report.md`` and its plots into ``out_dir``; returns the page's path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    r = _Report.of(doc)
    tiers = ["## Users per SLO tier", "", tier_lines(doc["tiers"]), ""] if doc.get("tiers") else []
    lines = [*_title_lines(r), "## Result", "", *_result_lines(r), *_measured_lines(r), *tiers, *_tune_lines(doc),
             *_capacity_table(r),
             "", "## Workload", "", *_workload_lines(doc, r.fixed), "", "![length distributions](lengths.png)", "",
             *_pass_rule_lines(r),
             "## Machine", "", *_machine_lines(doc), "",
             *_plotted_sections(r, out),
             "## Every point", ""]
    for name, values in r.groups:
        lines += _points_table(name, values) + [""]
    output_tokens = (r.point or {}).get("timeline", {}).get("output_tokens") if r.point else None
    plot_lengths(out / "lengths.png", r.fixed, output_tokens)
    plot_capacity_bars(out / "capacity.png", r.groups, r.unit)
    page = out / "report.md"
    page.write_text("\n".join(lines) + "\n")
    return page


def _title_lines(r: _Report) -> list[str]:
    lines = ["# Operating limit report", "", f"Made by `{r.doc.get('command')}` ({r.doc.get('started_at')}).", ""]
    if r.doc.get("simulated") or r.fixed.get("simulated"):
        sim = (r.fixed.get("server_info") or {}).get("simulation") or {}
        lines += [f"**SIMULATED**: no server ran; {sim.get('profile', 'a step-time profile')}, "
                  f"{sim.get('replicas', 1)} replica(s) (docs/simulator.md).", ""]
    return lines


def _result_lines(r: _Report) -> list[str]:
    """The limit of the recommended configuration with its bracket and command, or why
    there is none."""
    best, by_scale = r.best, r.by_scale
    if best is None or best["spread"]["mean"] is None:
        return _no_limit_lines(best or (r.doc.get("results") or [None])[0], by_scale,
                               r.doc.get("hold_duration"))
    sp = best["spread"]
    above = [a for a in best["failed_above"] if a is not None]
    lim = r.load_unit
    how = (f"held for {held_seconds(best):.0f} s" if best.get("held") else "searched, not held")
    lines = [f"**Operating limit: {sp['mean']:.4g} {lim}**, {how} (over {sp['found']}/{sp['repeats']} searches: "
             f"min {sp['min']:.4g}, max {sp['max']:.4g}"
             + (f"; the next load up failed at {(max(above) if by_scale else min(above)):.4g}" if above else
                "; not bounded: the highest load tried passed") + ").", ""]
    lines += _bracket_lines(best, by_scale, lim)
    if best.get("command"):
        lines += ["Configuration:", "", "```", best["command"], "```", ""]
    return lines


def _measured_lines(r: _Report) -> list[str]:
    """The evidence at the limit; left out when holds ran and none passed (the no-limit
    lines say why)."""
    searched = r.doc.get("results") or ([r.best] if r.best else [])
    if r.point is not None or not any(p.get("held") for res in searched for p in res.get("curve", [])):
        return ["Measured at the limit:", "", *_at_limit_lines(r.point), ""]
    return []


def _tune_lines(doc: Json) -> list[str]:
    if doc.get("kind") != "tune":
        return []
    lines = ["## One knob at a time", ""]
    for k in doc["knobs"]:
        lines += [f"**{k['knob']}** (base: {k['base_value'] or 'server default'}; best: {k['best']})", ""]
        lines += [f"- {w}" for w in k["why"]] + [""]
    return lines


def _capacity_table(r: _Report) -> list[str]:
    lines = ["## Capacity per value", "", "![capacity per value](capacity.png)", "",
             f"| knob | value | limit ({r.unit if not r.by_scale else 'time scale'}), mean ± std | min – max | "
             "first failure above | what broke above it |", "|---|---|---|---|---|---|"]
    for name, values in r.groups:
        for value, res in values:
            sp = res["spread"]
            above = [a for a in res["failed_above"] if a is not None]
            causes = sorted(lost_because(res))
            lines.append(f"| {name} | {value} | {_s(sp['mean'], 4)} ± {_s(sp['std'], 2)} | {_s(sp['min'], 4)} – "
                         f"{_s(sp['max'], 4)} | {', '.join(_s(a, 4) for a in above) or '-'} | {', '.join(causes) or '-'} |")
    return lines


def _pass_rule_lines(r: _Report) -> list[str]:
    """The SLO targets and the rules a point passed by (``sustain``), with the run's thresholds."""
    th = r.doc.get("thresholds") or {}
    lines = ["## SLO and what a pass needs", "",
             f"- targets: {', '.join(f'{k} <= {v:g} s' for k, v in r.slo.items()) or 'per tier (below)'}",
             f"- each statistic's {th.get('confidence', 0.95):.0%} confidence interval must lie within its target "
             "(order-statistic interval per request; ITL, pooled over requests, by cluster bootstrap)",
             f"- completed >= {th.get('rate_tolerance')} x offered over the window; in-flight growth over the "
             f"window's second half <= {th.get('queue_tolerance')} x its arrivals plus {th.get('noise_z')} "
             f"standard errors of the fitted growth; no failures; <= {th.get('preemption_threshold')} "
             "preemptions per request",
             f"- a point fails only on conclusive evidence (a statistic {th.get('fail_z', 4)} standard errors past "
             "its tolerance, an interval wholly above its target); an inconclusive one is extended by a window at "
             "a time, and at its last look fails as with one look"]
    if r.best is not None and r.best.get("held"):
        lines.append(f"- the search's limit is then held for {held_seconds(r.best):.0f} s, by the same rules; a "
                     "failed hold steps the load down by the search's tolerance and holds again")
    return lines + [""]


def _plotted_sections(r: _Report, out: pathlib.Path) -> list[str]:
    """Latency against load per knob and the timeline at the limit: draws their plots
    into ``out`` and returns the sections that show them."""
    lines = ["## Latency against load", ""]
    for name, values in r.groups:
        fname = f"latency_vs_load{'' if len(r.groups) == 1 else '-' + name}.png"
        plot_latency_vs_load(out / fname, name, values, r.slo)
        lines += [f"![latency vs load, {name}]({fname})", ""]
    if r.point is not None:
        lines += ["## At the limit: queue depth and KV usage", "", "![at the limit](at_limit.png)", ""]
        plot_at_limit(out / "at_limit.png", r.point, f"at the limit ({_s(r.point['evidence']['offered_rate'])} "
                                                     "req/s offered): requests in flight and KV usage over time")
    return lines
