"""Evaluate the Grafana dashboard's queries on a Prometheus and draw them, without Grafana.

Reads ``examples/grafana/inflight-dashboard.json``, fills in its variables
(``$model_name``, ``$__rate_interval``), runs every panel's PromQL through Prometheus's HTTP
API (``/api/v1/query_range``) over a time range, and draws the chosen panels with
matplotlib. Every query of the dashboard is evaluated, not only the drawn ones, and the run
fails if Prometheus rejects one, so it also checks the dashboard against a real Prometheus.

    .venv/bin/python examples/prometheus/plot_dashboard.py --prometheus http://127.0.0.1:9090 \\
        --start 1764669600 --end 1764669700 --out run.png

docs/metrics.md shows a run made this way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[1] / "grafana" / "inflight-dashboard.json"
DEFAULT_PANELS = ("Time to first token", "Inter-token latency", "End-to-end request latency",
                  "Finished requests / s by finish reason", "Tokens / s",
                  "Requests running / waiting", "KV cache usage", "Prefix cache hit rate",
                  "Request phases (mean)")


def panels(path: Path = DASHBOARD) -> list[dict]:
    """The dashboard's panels that have queries, rows flattened, in order."""
    out: list[dict] = []

    def walk(items: list[dict]) -> None:
        for p in items:
            if p.get("targets"):
                out.append(p)
            walk(p.get("panels", []))
    walk(json.loads(path.read_text())["panels"])
    return out


def fill(expr: str, model_name: str, rate_interval: str) -> str:
    """The PromQL Grafana would send: its variables replaced."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", model_name)


def query_range(client: httpx.Client, base: str, expr: str, start: float, end: float,
                step: float) -> list[dict]:
    """``/api/v1/query_range``'s result (one entry per series); raises on a rejected query."""
    r = client.get(base.rstrip("/") + "/api/v1/query_range",
                   params={"query": expr, "start": start, "end": end, "step": step})
    body = r.json()
    if r.status_code != 200 or body.get("status") != "success":
        raise ValueError(f"Prometheus rejected {expr!r}: {body.get('error', r.text)}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format."""
    for k, v in labels.items():
        fmt = fmt.replace("{{" + k + "}}", v)
    return fmt or ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__")


def main(argv: list[str] | None = None) -> int:
    """Parse flags, evaluate every query, draw the chosen panels; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--start", type=float, help="unix seconds (default: --end - 15 min)")
    ap.add_argument("--end", type=float, help="unix seconds (default: now)")
    ap.add_argument("--step", type=float, default=2.0, help="seconds between points")
    ap.add_argument("--rate-interval", default="30s", help="what $__rate_interval becomes")
    ap.add_argument("--model-name", default=".*", help="what $model_name becomes (a regex)")
    ap.add_argument("--panel", action="append", help="title of a panel to draw (repeatable)")
    ap.add_argument("--title", default="inflight on Prometheus")
    ap.add_argument("--out", default="prometheus_run.png")
    args = ap.parse_args(argv)
    end = args.end or time.time()
    start = args.start or end - 900
    chosen = args.panel or list(DEFAULT_PANELS)

    results: dict[str, list[tuple[str, list[float], list[float]]]] = {}
    with httpx.Client(timeout=30, trust_env=False) as client:
        for p in panels():
            lines, instant = [], 0
            for t in p["targets"]:
                expr = fill(t["expr"], args.model_name, args.rate_interval)
                if t.get("instant"):  # a table: checked at the end of the range, not drawn
                    instant += len(query_range(client, args.prometheus, expr, end, end, 1.0))
                    continue
                for series in query_range(client, args.prometheus, expr, start, end, args.step):
                    xs = [float(ts) - start for ts, _ in series["values"]]
                    ys = [float(v) for _, v in series["values"]]
                    lines.append((legend(t.get("legendFormat", ""), series["metric"]), xs, ys))
            results[p["title"]] = lines
            print(f"{p['title']}: {len(lines) + instant} series", file=sys.stderr)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_title = {p["title"]: p for p in panels()}
    cols = 3
    rows = math.ceil(len(chosen) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, title in zip(axes.flat, chosen):
        unit = by_title[title]["fieldConfig"]["defaults"].get("unit", "")
        for name, xs, ys in results[title]:
            ax.plot(xs, [y * 100 if unit == "percentunit" else y for y in ys], label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s since start")
        ax.set_ylabel({"s": "seconds", "reqps": "req/s", "percentunit": "%"}.get(unit, ""))
        ax.grid(alpha=0.3)
        if results[title]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
