"""Reports: the terminal summary, JSON/CSV files and PNG plots (drawn as ``figures`` says)."""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Any, Sequence

from inflight.bench.client import RequestRecord
from inflight.bench.figures import figure, legend, plottable, save
from inflight.bench.metrics_scrape import prefix_hit_rate
from inflight.bench.summary import SLO, concurrency_timeline, request_metrics

_LAT_ROWS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
_LAT_COLS = ("mean", "median", "p90", "p95", "p99")


def _fmt(v: float | None, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, int) and scale == 1.0:
        return f"{v}{unit}"
    return f"{v * scale:.{digits}f}{unit}"


def format_summary(summary: dict[str, Any], title: str = "inflight bench serve") -> str:
    """The run summary as a fixed-width table (latencies in ms)."""
    lines = [f"{'=' * 16} {title} {'=' * 16}"]
    rows = [
        ("Successful requests", _fmt(summary["completed"])),
        ("Failed requests", _fmt(summary["failed"])),
        ("Connection retries (not failures)", _fmt(summary.get("connection_retries", 0))),
        ("Duration (s)", _fmt(summary["duration"])),
        ("Peak concurrency", _fmt(summary["peak_concurrency"])),
        ("Total input tokens", _fmt(summary["total_input_tokens"])),
        ("Total output tokens", _fmt(summary["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(summary["request_throughput"])),
        ("Output throughput (tok/s)", _fmt(summary["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(summary["total_token_throughput"])),
    ]
    if summary.get("goodput") is not None:
        rows.append(("Goodput (req/s)", _fmt(summary["goodput"])))
        judged = summary.get("judged_requests", summary["completed"])
        rows.append(("Requests meeting SLO", f"{summary['good_requests']}/{judged} judged"
                     " (errored ones fail; cancelled and undetermined ones are not judged)"))
    if summary.get("preemptions") is not None:
        rows.append(("Preemptions", _fmt(summary["preemptions"], digits=0)))
    hit_rate = prefix_hit_rate(summary.get("server_counters") or {})
    if hit_rate is not None:
        rows.append(("Prefix cache hit rate (%)", _fmt(100 * hit_rate)))
    rows += _user_rows(summary.get("users"))
    if summary.get("prompt_len_mismatches"):
        rows.append(("Prompt length mismatches", _fmt(summary["prompt_len_mismatches"])))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k + ':':<{width}}{v:>12}" for k, v in rows]
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{c:>10}" for c in _LAT_COLS))
    for key, label in _LAT_ROWS:
        d = summary.get(key) or {}
        lines.append(f"{label:<14}" + "".join(f"{_fmt(d.get(c), scale=1000):>10}" for c in _LAT_COLS))
    for violation in summary.get("slo_violations") or []:
        lines.append(f"SLO violated: {violation}")
    for err, n in (summary.get("errors") or {}).items():
        lines.append(f"error x{n}: {err}")
    lines.append("=" * (len(title) + 34))
    return "\n".join(lines)


def _user_rows(users: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A closed-loop point's rows (``users.session_figures``)."""
    if not users:
        return []
    speed, conv = users["output_speed_per_user"], users["session_seconds"]
    rows = [("Users", _fmt(users["users"])),
            ("Per-user output tok/s p5 / p50", f"{_fmt(speed['p5'], digits=1)} / {_fmt(speed['p50'], digits=1)}"),
            (f"Conversation time p50 / p95 (s, {conv['n']})", f"{_fmt(conv['p50'])} / {_fmt(conv['p95'])}")]
    rows += [(f"TTFT p50 / p95, turn {int(t) + 1} (ms)", f"{_fmt(v['p50'], scale=1000, digits=0)} / "
              f"{_fmt(v['p95'], scale=1000, digits=0)}") for t, v in users["ttft_by_turn"].items()]
    return rows


def _json_default(o: object) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, pathlib.Path):
        return str(o)
    tolist = getattr(o, "tolist", None)  # numpy arrays and scalars
    if tolist is not None:
        return tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _clean(o: Any) -> Any:
    # json.dump writes inf/nan as bare tokens other parsers reject; make them strings.
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_json(path: str | pathlib.Path, obj: dict[str, Any]) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(obj), indent=1, default=_json_default) + "\n")


def write_csv(path: str | pathlib.Path, rows: Sequence[dict[str, Any]]) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})


def point_row(summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A flat row (for sweep CSV/plots): throughputs and latency percentiles in seconds."""
    row = dict(extra)
    for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
              "total_token_throughput", "goodput", "peak_concurrency", "preemptions"):
        row[k] = summary.get(k)
    for metric, _ in _LAT_ROWS:
        for stat in ("mean", "median", "p95", "p99"):
            row[f"{metric}_{stat}"] = (summary.get(metric) or {}).get(stat)
    return row


def plot_run(path: str | pathlib.Path, records: Sequence[RequestRecord], samples: Sequence[dict[str, Any]],
             title: str = "") -> None:
    """Latency over time (TTFT, E2E per request by send time) and load over time
    (client-side requests in flight; server waiting/running and KV usage when scraped)."""
    fig, (ax1, ax2) = figure(2)
    ok = [(r, request_metrics(r)) for r in records if r.success and not r.warmup]
    xs = [r.send_time for r, _ in ok]
    ax1.scatter(xs, plottable(m.ttft for _, m in ok), s=8, label="TTFT")
    ax1.scatter(xs, plottable(m.e2e for _, m in ok), s=8, label="E2E", alpha=0.6)
    bad = [r.send_time for r in records if not r.success and not r.warmup]
    if bad:
        ax1.scatter(bad, [0] * len(bad), marker="x", color="red", label="failed")
    ax1.set_xlabel("send time (s)")
    ax1.set_ylabel("latency (s)")
    ax1.set_title(title or "latency by request")
    legend(ax1)
    tl = concurrency_timeline([r for r in records if not r.warmup])
    if tl:
        ax2.step([t for t, _ in tl], [n for _, n in tl], where="post", label="in flight (client)")
    ts = [s["t"] for s in samples]
    for key in ("running", "waiting"):
        if any(s.get(key) is not None for s in samples):
            ax2.step(ts, plottable(s.get(key) for s in samples), where="post", label=f"{key} (server)")
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("requests")
    if any(s.get("kv_cache_usage") is not None for s in samples):
        ax3 = ax2.twinx()
        ax3.step(ts, plottable(s.get("kv_cache_usage") for s in samples), where="post", color="gray", ls="--",
                 label="KV usage")
        ax3.set_ylabel("KV cache usage (fraction)")
        ax3.set_ylim(0, 1.05)
        legend(ax3, "upper right")
    legend(ax2)
    save(fig, path)


def plot_sweep(path: str | pathlib.Path, rows: Sequence[dict[str, Any]], slo: SLO,
               series_key: str = "value") -> None:
    """Throughput vs rate, p95 TTFT vs rate and p95 ITL vs rate (one line per knob value),
    with the SLO targets drawn as horizontal lines."""
    fig, axes = figure(3, height=2.8)
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get(series_key), []).append(r)
    for value, rs in groups.items():
        rs = sorted(rs, key=lambda r: _rate_x(r["rate"]))
        x = [_rate_x(r["rate"]) for r in rs]
        label = f"{series_key}={value}" if value is not None else None
        axes[0].plot(x, [_num(r.get("output_throughput")) for r in rs], marker="o", label=label)
        axes[1].plot(x, [_num(r.get("ttft_p95")) for r in rs], marker="o", label=label)
        axes[2].plot(x, [_num(r.get("itl_p95")) for r in rs], marker="o", label=label)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("p95 TTFT (s)")
    axes[2].set_ylabel("p95 ITL (s)")
    for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
        target = slo.aggregate.get((metric, "p95"), slo.per_request.get(metric))
        if target is not None:
            ax.axhline(target, color="red", ls="--", label=f"SLO {target * 1000:g} ms")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        legend(ax)
    save(fig, path)


def _rate_x(rate: float | str | None) -> float:
    # rate=inf has no place on a rate axis: its row stays in the CSV but not on the plot.
    return float(rate) if rate not in (None, "inf") and math.isfinite(float(rate)) else math.nan


def plot_capacity(path: str | pathlib.Path, points: Sequence[dict[str, Any]], slo: SLO, load_label: str) -> None:
    """p95 TTFT and p95 ITL against load for every measured point, passes and fails marked."""
    fig, axes = figure(2, height=3.0)
    for ax, metric in ((axes[0], "ttft"), (axes[1], "itl")):
        for passed, marker, color in ((True, "o", "tab:green"), (False, "x", "tab:red")):
            pts = [p for p in points if p["passed"] == passed]
            if pts:
                ys = [_num((p["summary"].get(metric) or {}).get("p95")) for p in pts]
                ax.scatter([p["load"] for p in pts], ys, marker=marker, color=color,
                           label="pass" if passed else "fail")
        target = slo.aggregate.get((metric, "p95"))
        if target is not None:
            ax.axhline(target, color="red", ls="--", label=f"SLO {target * 1000:g} ms")
        if points:
            ax.set_xscale("log")
        ax.set_xlabel(load_label)
        ax.set_ylabel(f"p95 {metric.upper()} (s)")
        legend(ax)
    save(fig, path)


def _num(v: float | None) -> float:
    # A point where nothing completed has no p95; NaN leaves it off the axis instead of failing.
    return math.nan if v is None else float(v)
