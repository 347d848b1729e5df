"""Goodput past the operating limit with `inflight serve`'s defaults (issue 35).

At 1x, 2x and 4x a given operating limit L, one `inflight bench serve --duration` run per
load and server setup, against a fresh server each time, interleaved (setups alternate
within each load, the order rotated per round):

- ``protected``: `inflight serve` as `make serve` runs it (overload shedding and the step
  time cap on, their defaults);
- ``unprotected``: the same with ``--overload-ttft 0 --max-step-time 0`` (the server
  before this work).

Goodput = completed requests whose TTFT <= 2 s and every inter-token gap <= 1 s, per second
of the window (DistServe's definition; the bench's ``--slo ttft=2,itl=1``). The workload is
limit_validation.py's (the Azure conversation slice, lengths x 0.125, Poisson arrivals); L
defaults to its median limit for the default server in docs/capacity.md. Traffic goes to
127.0.0.1 only; every command is bounded.

    .venv/bin/python benchmarks/overload_goodput.py                          # ~25 min
    .venv/bin/python benchmarks/overload_goodput.py --loads 2 --duration 60 --setups protected
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _runs import REPO, run_bounded, stop_on_signals  # noqa: E402  (sibling benchmark module)
from limit_validation import WORKLOADS, _f  # noqa: E402

SETUPS = {"protected": "", "unprotected": "--overload-ttft 0 --max-step-time 0"}
GOODPUT_SLO = "ttft=2,itl=1"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="azure-conv")
    p.add_argument("--limit", type=float, default=6.14, help="req/s: L, the default server's limit")
    p.add_argument("--loads", default="1,2,4", help="multiples of L")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--duration", type=float, default=120.0, help="s: each run's measured window")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--server-args", default="", help="more flags for every `inflight serve`")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "overload_goodput"))
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--port", type=int, default=8476)
    p.add_argument("--command-timeout", type=float, default=900.0)
    return p.parse_args(argv)


def one_run(args, setup: str, load: float, rnd: int, out: pathlib.Path) -> dict:
    rate = args.limit * load
    flags, _ = WORKLOADS[args.workload]
    serve = f"{args.inflight} serve --port {args.port} {SETUPS[setup]} {args.server_args}".strip()
    result = out / f"{setup}-{load:g}x-r{rnd}.json"
    cmd = [args.inflight, "--log-level", "warning", "bench", "serve", "--serve-cmd", serve,
           "--base-url", f"http://127.0.0.1:{args.port}", *shlex.split(flags),
           "--slo", GOODPUT_SLO, "--disable-tqdm", "--request-rate", f"{rate:.6g}",
           "--duration", str(args.duration), "--seed", str(7 + rnd), "--save-result", str(result)]
    info = run_bounded(cmd, out / f"{setup}-{load:g}x-r{rnd}.log", args.command_timeout)
    row = {"setup": setup, "load": load, "rate": rate, "round": rnd, **info}
    if result.exists():
        doc = json.loads(result.read_text())
        # Megabytes of chunk times; keep each request's arrival, status and TTFT, enough to
        # see when in the window requests were refused or late.
        doc["requests"] = [{k: r.get(k) for k in ("scheduled_time", "status", "success", "phase")}
                           | {"ttft": (r["chunk_times"][0] - r["send_time"]) if r.get("chunk_times") else None}
                           for r in doc.get("requests") or []]
        result.write_text(json.dumps(doc, default=str))
        s = doc.get("summary", doc)
        errors = s.get("errors") or {}
        row.update(goodput=s.get("goodput"), completed=s.get("completed"), failed=s.get("failed"),
                   good=s.get("good_requests"), throughput=s.get("request_throughput"),
                   ttft_p95=(s.get("ttft") or {}).get("p95"), itl_p95=(s.get("itl") or {}).get("p95"),
                   errors=errors)
    return row


def table(rows: list[dict], limit: float) -> str:
    base = [r["goodput"] for r in rows if r["setup"] == "protected" and r["load"] == 1 and r.get("goodput")]
    ref = sum(base) / len(base) if base else None
    lines = ["| setup | load | offered req/s | goodput req/s | x goodput at 1x | completed | good | "
             "refused or failed | p95 TTFT s | p95 ITL s | load average |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["load"], r["setup"], r["round"])):
        g = r.get("goodput")
        ratio = f"{g / ref:.2f}" if g is not None and ref else "-"
        la = r.get("loadavg_after") or ["-"]
        lines.append(f"| {r['setup']} | {r['load']:g}x | {r['rate']:.2f} | {_f(g)} | {ratio} | {r.get('completed', '-')} "
                     f"| {r.get('good', '-')} | {r.get('failed', '-')} | {_f(r.get('ttft_p95'))} | {_f(r.get('itl_p95'))} "
                     f"| {la[0]} |")
    return "\n".join(lines) + f"\n\nL = {limit} req/s; goodput SLO {GOODPUT_SLO} (per request).\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    setups = args.setups.split(",")
    rows = []
    for rnd in range(args.rounds):
        for load in (float(x) for x in args.loads.split(",")):
            order = setups[rnd % len(setups):] + setups[:rnd % len(setups)]
            for setup in order:
                rows.append(one_run(args, setup, load, rnd, out))
                (out / "summary.json").write_text(json.dumps({"limit": args.limit, "rows": rows}, indent=1,
                                                             default=str) + "\n")
                (out / "table.md").write_text(table(rows, args.limit))
    print("\n" + table(rows, args.limit))
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
