"""The operating-limit report: one Markdown page with PNG plots a person can hand over.

``write_report(DIR, doc)`` takes the JSON document of ``bench capacity`` or ``bench tune``
and writes ``DIR/report.md`` with ``lengths.png`` (the workload's length distributions),
``latency_vs_load*.png`` (each SLO statistic with its confidence interval against the
offered load, per knob, SLO lines drawn), ``at_limit.png`` (queue depth and KV usage over
time at the recommended configuration's limit) and ``capacity.png`` (the limit per knob
value with its uncertainty). Plots use the Agg canvas directly (see ``report``).
"""

from __future__ import annotations

import math
import pathlib

from inflight.bench.limit import best_point, lost_because
from inflight.bench.machine import cpu_shares
from inflight.bench.report import _figure, _legend, _save

_METRICS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"))


# ---------------------------------------------------------------- the document, normalized

def _groups(doc: dict) -> list[tuple[str, list[tuple[str, dict]]]]:
    """[(knob name, [(value, LimitResult json), ...]), ...] for capacity and tune alike."""
    if doc.get("kind") == "tune":
        return [(k["knob"], [(str(v["value"]), v) for v in k["values"]]) for k in doc["knobs"]]
    return [("value" if len(doc["results"]) > 1 or doc["results"][0].get("value") is not None else "server",
             [("-" if r.get("value") is None else str(r["value"]), r) for r in doc["results"]])]


def _best(doc: dict) -> dict | None:
    if doc.get("kind") == "tune":
        return doc["recommended"]
    found = [r for r in doc["results"] if r["spread"]["mean"] is not None]
    if not found:
        return None
    by_scale = doc.get("search") == "time_scale"
    return min(found, key=lambda r: r["spread"]["mean"]) if by_scale else max(found, key=lambda r: r["spread"]["mean"])


def _num(v) -> float:
    """A JSON number as float: None is nan; "inf" (how report.write_json keeps it) is inf."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return float(v)


def _s(v, digits: int = 3) -> str:
    """A number for the page: ``-`` for none, ``inf`` as such (JSON keeps it as a string)."""
    v = _num(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v
    if v is None or isinstance(v, str) or math.isnan(v):
        return "-" if not isinstance(v, str) else v
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def _iv(iv: dict | None) -> str:
    if not iv:
        return "-"
    return f"{_s(iv['estimate'])} s [{_s(iv['lo'])}, {_s(iv['hi'])}]"


# ---------------------------------------------------------------- plots

def _plain(ax, x: bool = True) -> None:
    """Plain tick labels (0.2, 5, 100: no offsets, no 10^k); a log axis gets 1-2-5 ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    axes = (ax.xaxis, ax.yaxis) if x else (ax.yaxis,)
    for axis in axes:
        if axis.get_scale() == "log":
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_minor_formatter(NullFormatter())
        axis.set_major_formatter(fmt)


def plot_lengths(path: pathlib.Path, fixed: dict, output_tokens: list[int] | None) -> None:
    ls = fixed.get("length_samples") or {}
    fig, axes = _figure(2, height=2.6)
    for ax, key, label in ((axes[0], "prompt_len", "prompt tokens"), (axes[1], "max_tokens", "output tokens")):
        vals = [v for v in ls.get(key) or [] if v is not None]
        extra = list(output_tokens or []) if key == "max_tokens" else []
        top = max(vals + extra, default=1)
        bins = list(range(0, top + max(1, top // 40) + 1, max(1, top // 40)))
        if vals:
            what = "max_tokens" if key == "max_tokens" else "prompt tokens"
            ax.hist(vals, bins=bins, color="tab:blue", alpha=0.7, label=f"{what} of the mix ({len(vals)} requests)")
        if extra:
            ax.hist(extra, bins=bins, color="tab:orange", alpha=0.6,
                    label=f"generated, at the limit ({len(extra)} requests)")
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
        ax.set_title(f"{label}: distribution of the request mix")
        _plain(ax)
        _legend(ax, "upper right")
    _save(fig, path)


def plot_latency_vs_load(path: pathlib.Path, name: str, values: list[tuple[str, dict]], slo: dict) -> None:
    fig, axes = _figure(3, height=2.8)
    for ax, (metric, label) in zip(axes, _METRICS):
        stat = next((k.split("_", 1)[1] for k in slo if k.startswith(metric + "_")), "p95")
        key = f"{metric}_{stat}"
        finite: list[float] = []
        unbounded: list[tuple[float, str]] = []  # points whose statistic is infinite (unfinished requests)
        for i, (value, res) in enumerate(values):
            color = f"C{i % 10}"
            pts = sorted(res["curve"], key=lambda p: _num(p["evidence"].get("offered_rate")))
            for p in pts:
                x = _num(p["evidence"].get("offered_rate"))
                iv = (p["evidence"].get("slo") or {}).get(key)
                y = _num(iv["estimate"]) if iv else _num((p["summary"].get(metric) or {}).get(stat))
                if iv:
                    lo, hi = _num(iv["lo"]), _num(iv["hi"])
                    top = hi if math.isfinite(hi) else max(y * 2, 1e-3) if math.isfinite(y) else math.nan
                    if math.isfinite(y) and math.isfinite(top):
                        ax.vlines(x, lo if math.isfinite(lo) else y, top, color=color, lw=1, alpha=0.6)
                if math.isinf(y):
                    unbounded.append((x, color))
                else:
                    finite.append(y)
                    marker = ("s" if p["passed"] else "X") if p.get("held") else ("o" if p["passed"] else "x")
                    ax.scatter([x], [y], color=color, marker=marker, s=45 if p.get("held") else 30)
            ax.plot([], [], color=color, marker="o", ls="", label=f"{name}={value}" if name != "server" else "measured")
        target = slo.get(key)
        if target is not None:
            ax.axhline(target, color="red", ls="--", lw=1, label=f"SLO {stat} {target:g} s")
            finite.append(target)
        if unbounded and finite:
            top = max(finite) * 1.6
            ax.scatter([x for x, _ in unbounded], [top] * len(unbounded), c=[c for _, c in unbounded],
                       marker="^", s=40, label="unbounded (unfinished requests)")
        ax.set_yscale("log")
        ax.set_xlabel("offered load in the window (req/s)")
        ax.set_ylabel(f"{stat} {label} (s)")
        ax.set_title(f"{stat} {label} vs load (o/x: search pass/fail, squares: holds; bars: {stat} CI)")
        _plain(ax)
        _legend(ax)
    _save(fig, path)


def plot_at_limit(path: pathlib.Path, point: dict, title: str) -> None:
    tl = point.get("timeline") or {}
    fig, (ax,) = _figure(1, height=3.6)
    if tl.get("t"):
        ax.step(tl["t"], tl["in_flight"], where="post", label="in flight (client)")
    samples = tl.get("server") or []
    ts = [s["t"] for s in samples]
    for key in ("waiting", "running"):
        if any(s.get(key) is not None for s in samples):
            ax.step(ts, [s.get(key) for s in samples], where="post", label=f"{key} (server)")
    w = tl.get("window")
    if w:
        ax.axvspan(w["start"], w["end"], color="green", alpha=0.08, label="measurement window")
    ax.set_xlabel("time since the point started (s)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    _plain(ax)
    if any(s.get("kv_cache_usage") is not None for s in samples):
        ax2 = ax.twinx()
        ax2.plot(ts, [s.get("kv_cache_usage") for s in samples], color="gray", ls="--", label="KV usage")
        ax2.set_ylabel("KV cache usage (fraction)")
        ax2.set_ylim(0, 1.05)
        _legend(ax2, "upper right")
    _legend(ax)
    _save(fig, path)


def plot_capacity_bars(path: pathlib.Path, groups, unit: str) -> None:
    fig, axes = _figure(len(groups), height=2.8)
    for ax, (name, values) in zip(axes, groups):
        labels = [v for v, _ in values]
        means = [_num(r["spread"]["mean"]) for _, r in values]
        lows = [_num(r["spread"]["min"]) for _, r in values]
        highs = [max([_num(a) for a in r["failed_above"] if a is not None] or [_num(r["spread"]["max"])])
                 for _, r in values]
        err = [[max(0.0, m - lo) if math.isfinite(m) else 0 for m, lo in zip(means, lows)],
               [max(0.0, h - m) if math.isfinite(m) and math.isfinite(h) else 0 for m, h in zip(means, highs)]]
        ax.bar(labels, [m if math.isfinite(m) else 0 for m in means], yerr=err, capsize=6, color="tab:blue")
        for i, m in enumerate(means):
            ax.annotate("none passed" if not math.isfinite(m) else f"{m:.3g}", (i, m if math.isfinite(m) else 0),
                        textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
        ax.set_xlabel(name)
        ax.set_ylabel(f"operating limit ({unit})")
        ax.set_title(f"operating limit per {name} (bars: lowest pass over repeats to the first failure above)")
        _plain(ax, x=False)
    _save(fig, path)


# ---------------------------------------------------------------- the page

def _workload_lines(doc: dict, fixed: dict) -> list[str]:
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
    out.append(f"- arrivals: {proc}" + (" (the trace's own times, scaled)" if proc == "trace" else "")
               + (f", burstiness {arr.get('burstiness')}" if proc == "gamma" else "") + f", seed {arr.get('seed')}")
    if arr.get("duration"):
        out.append(f"- each point: {arr.get('warmup_duration'):g} s warm-up (uncounted), a window of at least "
                   f"{arr['duration']:g} s and {arr.get('min_requests')} requests (the sample), then cool-down "
                   f"arrivals until the sample ends or {arr.get('drain_timeout'):g} s pass")
    return out


def _machine_lines(doc: dict) -> list[str]:
    m = doc.get("machine") or {}
    start, end = m.get("start") or {}, m.get("end") or {}
    if not start:
        return ["- not recorded"]
    return [f"- {start.get('cpu')}, {start.get('cores')} logical cores, {start.get('memory_gib')} GiB, "
            f"{start.get('os')}, Python {start.get('python')}",
            f"- load average (1/5/15 min): {start.get('loadavg')} at the start ({start.get('time')}), "
            f"{end.get('loadavg')} at the end ({end.get('time')})",
            *_busy_lines(start), *_cpu_share_lines(start, end)]


def _busy_lines(start: dict) -> list[str]:
    """A warning when other work held the machine as the run began (its own server and
    client had not started: a 1-minute load average of half the cores is someone else's)."""
    load, cores = start.get("loadavg"), start.get("cores")
    if not load or not cores or load[0] < 0.5 * cores:
        return []
    return [f"- **busy before the run**: 1-minute load average {load[0]:g} on {cores} cores; other work "
            "shared the CPU, so the limit is lower than on an idle machine"]


def _cpu_share_lines(start: dict, end: dict) -> list[str]:
    shares = cpu_shares(start, end)
    if shares is None:
        return []
    line = (f"- CPU time over the run, all cores: {shares['busy']:.0%} busy, {shares['idle']:.0%} idle, "
            f"{shares['steal']:.0%} stolen by the host")
    if shares["steal"] >= 0.05:
        line += " (a contended virtual machine: every step ran slower than on an idle host)"
    return [line]


def _at_limit_lines(point: dict | None) -> list[str]:
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


def _no_limit_lines(res: dict | None, by_scale: bool) -> list[str]:
    """Why there is no limit: nothing passed, or the search passed and every hold failed."""
    holds = [p for p in (res or {}).get("curve", []) if p.get("held")]
    if not holds:
        return ["**No load met the SLO.**", ""]
    searched = [p["x"] for p in res["curve"] if p["passed"] and not p.get("held")]
    top = (min(searched) if by_scale else max(searched)) if searched else None
    tried = "; ".join(f"{p['x']:.4g} ({', '.join(p['evidence'].get('causes') or ['failed'])})" for p in holds)
    return [f"**No load held.** The search passed up to {top:.4g} in its windows, and every "
            f"{_held_seconds(res):.0f} s hold failed: {tried}. The operating limit lies below the lowest "
            "load held; hold lower (`--max-holds`) or measure on a quieter machine (see Machine).", ""]


def _bracket_lines(res: dict, by_scale: bool) -> list[str]:
    """The limit as a bracket, where each target is crossed, and the prediction beside it."""
    unit = "time scale" if by_scale else "req/s"
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
    extended = [p for p in res.get("curve", []) if len((p.get("evidence") or {}).get("looks") or []) > 1
                and not p.get("held")]
    if extended:
        out.append(f"- {len(extended)} search point(s) were inconclusive at first and judged over a longer window "
                   "(see Every point)")
    return out + ([""] if out else [])


def _held_seconds(res: dict) -> float:
    holds = [p for p in res["curve"] if p.get("held")]
    return max((p["evidence"]["window"]["seconds"] for p in holds), default=0.0)


def _points_table(name: str, values) -> list[str]:
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


def write_report(out_dir, doc: dict) -> pathlib.Path:
    """Write ``report.md`` and its plots into ``out_dir``; returns the page's path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _groups(doc)
    best = _best(doc)
    point = best_point(best) if best else None
    by_scale = doc.get("search") == "time_scale"
    unit = "1 / time scale" if by_scale else "req/s"
    fixed = (best or groups[0][1][0][1]).get("fixed") or {}
    slo = doc.get("slo") or {}
    lines = ["# Operating limit report", "",
             f"Made by `{doc.get('command')}` ({doc.get('started_at')}).", ""]
    if doc.get("simulated") or fixed.get("simulated"):
        sim = (fixed.get("server_info") or {}).get("simulation") or {}
        lines += [f"**SIMULATED**: no server ran; {sim.get('profile', 'a step-time profile')}, "
                  f"{sim.get('replicas', 1)} replica(s) (docs/simulator.md).", ""]
    lines += ["## Result", ""]
    if best is not None and best["spread"]["mean"] is not None:
        sp = best["spread"]
        above = [a for a in best["failed_above"] if a is not None]
        lim = "time scale" if by_scale else "req/s"
        how = (f"held for {_held_seconds(best):.0f} s" if best.get("held") else "searched, not held")
        lines += [f"**Operating limit: {sp['mean']:.4g} {lim}**, {how} (over {sp['found']}/{sp['repeats']} searches: "
                  f"min {sp['min']:.4g}, max {sp['max']:.4g}"
                  + (f"; the next load up failed at {(max(above) if by_scale else min(above)):.4g}" if above else
                     "; not bounded: the highest load tried passed") + ").", ""]
        lines += _bracket_lines(best, by_scale)
        if best.get("command"):
            lines += ["Configuration:", "", "```", best["command"], "```", ""]
    else:
        lines += _no_limit_lines(best or (doc.get("results") or [None])[0], by_scale)
    searched = doc.get("results") or ([best] if best else [])
    if point is not None or not any(p.get("held") for r in searched for p in r.get("curve", [])):
        lines += ["Measured at the limit:", "", *_at_limit_lines(point), ""]
    if doc.get("kind") == "tune":
        lines += ["## One knob at a time", ""]
        for k in doc["knobs"]:
            lines += [f"**{k['knob']}** (base: {k['base_value'] or 'server default'}; best: {k['best']})", ""]
            lines += [f"- {w}" for w in k["why"]] + [""]
    lines += ["## Capacity per value", "", "![capacity per value](capacity.png)", "",
              f"| knob | value | limit ({unit if not by_scale else 'time scale'}), mean ± std | min – max | "
              "first failure above | what broke above it |", "|---|---|---|---|---|---|"]
    for name, values in groups:
        for value, res in values:
            sp = res["spread"]
            above = [a for a in res["failed_above"] if a is not None]
            causes = sorted(lost_because(res))
            lines.append(f"| {name} | {value} | {_s(sp['mean'], 4)} ± {_s(sp['std'], 2)} | {_s(sp['min'], 4)} – "
                         f"{_s(sp['max'], 4)} | {', '.join(_s(a, 4) for a in above) or '-'} | {', '.join(causes) or '-'} |")
    lines += ["", "## Workload", "", *_workload_lines(doc, fixed), "", "![length distributions](lengths.png)", ""]
    th = doc.get("thresholds") or {}
    lines += ["## SLO and what a pass needs", "",
              f"- targets: {', '.join(f'{k} <= {v:g} s' for k, v in slo.items())}",
              f"- each statistic's {th.get('confidence', 0.95):.0%} confidence interval must lie within its target "
              "(order-statistic interval per request; ITL, pooled over requests, by cluster bootstrap)",
              f"- completed >= {th.get('rate_tolerance')} x offered over the window; in-flight growth over the "
              f"window's second half <= {th.get('queue_tolerance')} x its arrivals plus {th.get('noise_z')} "
              f"standard errors of the fitted growth; no failures; <= {th.get('preemption_threshold')} "
              "preemptions per request",
              f"- a point fails only on conclusive evidence (a statistic {th.get('fail_z', 4)} standard errors past "
              "its tolerance, an interval wholly above its target); an inconclusive one is extended by a window at "
              "a time, and at its last look fails as with one look"]
    if best is not None and best.get("held"):
        lines.append(f"- the search's limit is then held for {_held_seconds(best):.0f} s, by the same rules; a failed "
                     "hold steps the load down by the search's tolerance and holds again")
    lines.append("")
    lines += ["## Machine", "", *_machine_lines(doc), ""]
    lines += ["## Latency against load", ""]
    for i, (name, values) in enumerate(groups):
        fname = f"latency_vs_load{'' if len(groups) == 1 else '-' + name}.png"
        plot_latency_vs_load(out / fname, name, values, slo)
        lines += [f"![latency vs load, {name}]({fname})", ""]
    if point is not None:
        lines += ["## At the limit: queue depth and KV usage", "", "![at the limit](at_limit.png)", ""]
        plot_at_limit(out / "at_limit.png", point, f"at the limit ({_s(point['evidence']['offered_rate'])} req/s "
                                                    "offered): requests in flight and KV usage over time")
    lines += ["## Every point", ""]
    for name, values in groups:
        lines += _points_table(name, values) + [""]
    plot_lengths(out / "lengths.png", fixed, (point or {}).get("timeline", {}).get("output_tokens") if point else None)
    plot_capacity_bars(out / "capacity.png", groups, unit)
    page = out / "report.md"
    page.write_text("\n".join(lines) + "\n")
    return page
