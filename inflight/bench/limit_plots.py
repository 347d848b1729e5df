"""The operating-limit report's plots (``report_page``), from the saved JSON document.

``lengths.png``: the workload's length distributions; ``latency_vs_load*.png``: each SLO
statistic with its confidence interval against the offered load, per knob, SLO lines
drawn; ``at_limit.png``: queue depth and KV usage over time at the limit; ``capacity.png``:
the limit per knob value with its uncertainty. Drawn as ``figures`` says (Agg, no pyplot).
"""

from __future__ import annotations

import math
import pathlib
from typing import TYPE_CHECKING, Any, Sequence

from inflight.bench.figures import figure, legend, plottable, save
from inflight.bench.limit_doc import KnobGroups, json_number

if TYPE_CHECKING:
    from matplotlib.axes import Axes

METRICS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"))


def _plain(ax: Axes, x: bool = True) -> None:
    """Plain tick labels (0.2, 5, 100: no offsets, no 10^k); a log axis gets 1-2-5 ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    axes = (ax.xaxis, ax.yaxis) if x else (ax.yaxis,)
    for axis in axes:
        if axis.get_scale() == "log":
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_minor_formatter(NullFormatter())
        axis.set_major_formatter(fmt)


def plot_lengths(path: pathlib.Path, fixed: dict[str, Any], output_tokens: list[int] | None) -> None:
    """Histograms of the mix's prompt lengths and max_tokens (tokens), with the output
    lengths generated at the limit beside the latter where known."""
    ls = fixed.get("length_samples") or {}
    fig, axes = figure(2, height=2.6)
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
        legend(ax, "upper right")
    save(fig, path)


def plot_latency_vs_load(path: pathlib.Path, name: str, values: list[tuple[str, dict[str, Any]]],
                         slo: dict[str, float]) -> None:
    """Per metric (TTFT, ITL, E2E): the SLO's statistic at every point of every value's
    curve against the offered load (s, log axis), its interval as a bar, the target as a line."""
    fig, axes = figure(3, height=2.8)
    for ax, (metric, label) in zip(axes, METRICS):
        stat = next((k.split("_", 1)[1] for k in slo if k.startswith(metric + "_")), "p95")
        key = f"{metric}_{stat}"
        finite: list[float] = []
        unbounded: list[tuple[float, str]] = []  # points whose statistic is infinite (unfinished requests)
        for i, (value, res) in enumerate(values):
            color = f"C{i % 10}"
            _draw_curve(ax, res["curve"], metric, stat, color, finite, unbounded)
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
        legend(ax)
    save(fig, path)


def _draw_curve(ax: Axes, curve: list[dict[str, Any]], metric: str, stat: str, color: str,
                finite: list[float], unbounded: list[tuple[float, str]]) -> None:
    """One value's points on ``ax``: the statistic's estimate (o/x: search pass/fail,
    squares/X: holds) and its interval as a bar; collects the finite estimates in
    ``finite`` and the infinite ones' (load, color) in ``unbounded``."""
    key = f"{metric}_{stat}"
    for p in sorted(curve, key=lambda p: json_number(p["evidence"].get("offered_rate"))):
        x = json_number(p["evidence"].get("offered_rate"))
        iv = (p["evidence"].get("slo") or {}).get(key)
        y = json_number(iv["estimate"]) if iv else json_number((p["summary"].get(metric) or {}).get(stat))
        if iv:
            lo, hi = json_number(iv["lo"]), json_number(iv["hi"])
            top = hi if math.isfinite(hi) else max(y * 2, 1e-3) if math.isfinite(y) else math.nan
            if math.isfinite(y) and math.isfinite(top):
                ax.vlines(x, lo if math.isfinite(lo) else y, top, color=color, lw=1, alpha=0.6)
        if math.isinf(y):
            unbounded.append((x, color))
        else:
            finite.append(y)
            marker = ("s" if p["passed"] else "X") if p.get("held") else ("o" if p["passed"] else "x")
            ax.scatter([x], [y], color=color, marker=marker, s=45 if p.get("held") else 30)


def plot_at_limit(path: pathlib.Path, point: dict[str, Any], title: str) -> None:
    """The point's client-side in-flight count and the server's waiting/running requests
    over time (s since the point started), the window shaded, KV usage on a second axis."""
    tl = point.get("timeline") or {}
    fig, (ax,) = figure(1, height=3.6)
    if tl.get("t"):
        ax.step(tl["t"], tl["in_flight"], where="post", label="in flight (client)")
    samples: list[dict[str, Any]] = tl.get("server") or []
    ts = [s["t"] for s in samples]
    for key in ("waiting", "running"):
        if any(s.get(key) is not None for s in samples):
            ax.step(ts, plottable(s.get(key) for s in samples), where="post", label=f"{key} (server)")
    w = tl.get("window")
    if w:
        ax.axvspan(w["start"], w["end"], color="green", alpha=0.08, label="measurement window")
    ax.set_xlabel("time since the point started (s)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    _plain(ax)
    if any(s.get("kv_cache_usage") is not None for s in samples):
        ax2 = ax.twinx()
        ax2.plot(ts, plottable(s.get("kv_cache_usage") for s in samples), color="gray", ls="--", label="KV usage")
        ax2.set_ylabel("KV cache usage (fraction)")
        ax2.set_ylim(0, 1.05)
        legend(ax2, "upper right")
    legend(ax)
    save(fig, path)


def plot_capacity_bars(path: pathlib.Path, groups: KnobGroups, unit: str) -> None:
    """Per knob, the mean limit per value as a bar, from the lowest limit over repeats to
    the first failure above (``unit``: the load's, for the axis label)."""
    fig, axes = figure(len(groups), height=2.8)
    for ax, (name, values) in zip(axes, groups):
        labels = [v for v, _ in values]
        means = [json_number(r["spread"]["mean"]) for _, r in values]
        lows = [json_number(r["spread"]["min"]) for _, r in values]
        highs = [_first_failure(r) for _, r in values]
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
    save(fig, path)


def _first_failure(result: dict[str, Any]) -> float:
    """The top of a value's bar: the highest of its repeats' first failures above the
    limit, else its highest limit."""
    above: Sequence[float] = [json_number(a) for a in result["failed_above"] if a is not None]
    return max(above or [json_number(result["spread"]["max"])])
