"""Is the operating limit right both ways, repeatable, and predicted? (issue 30, item 5)

Per workload (named below, all from ../shared/data), for inflight's default server
(`inflight serve`, as `make serve` runs it):

1. ``--repeats`` (3) searches with ``bench capacity --calibrate`` (each starts its own
   server; seeds 0, 1, 2): the limit each reports (held 300 s by the search itself), its
   bracket, the simulator's prediction before and after the first point, and the wall time.
2. L = the median of those limits. ``bench serve --duration 300`` at L and at ``--over``
   (1.2) x L with another seed (7: other arrivals, another sample of the trace), each
   against a fresh server, judged by the same rules.

Claims checked: the limit holds at L and not at 1.2 L; the repeats spread <= 10 %
((max - min) / median); the prediction's error against the verified limit. Everything is
written to ``--out`` (summary.json, table.md, each run's log and JSON).

    .venv/bin/python benchmarks/limit_validation.py --workload azure-conv     # ~50 min
    .venv/bin/python benchmarks/limit_validation.py --workload azure-conv --repeats 1 --hold 60 \\
        --over 1.2 --out /tmp/lv-smoke                                          # a smoke run

Only 127.0.0.1; every run is bounded by ``--command-timeout``; the servers are the bench's
own (``--serve-cmd``), stopped when each run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import sys

from _runs import REPO, run_bounded, stop_on_signals

SLO = "ttft_p95=2,itl_p95=1"

# The request mixes: lengths scaled to a 135M model on 2 cores, natural EOS.
WORKLOADS = {
    "azure-conv": ("--dataset trace --trace-file azure_llm_2023_conv_1815-1900.csv --length-scale 0.125 "
                   "--max-input-len 256 --max-output-len 128 --no-ignore-eos", 2.0),
    "azure-code": ("--dataset trace --trace-file azure_llm_2023_code_1815-1900.csv --length-scale 0.125 "
                   "--max-input-len 512 --max-output-len 128 --no-ignore-eos", 1.0),
    # x0.0625 (prompts ~1000 tokens) puts the idle TTFT at 1.2-1.6 s against a 2 s target
    # here: a limit near 0.15 req/s, whose 100-request windows take 12 minutes each.
    "mooncake": ("--dataset trace --trace-file mooncake_conversation_0-30min.jsonl --length-scale 0.03125 "
                 "--max-input-len 512 --max-output-len 128 --no-ignore-eos", 1.0),
    "mt-bench": ("--dataset chat --chat-file mt_bench --conversation-turns 2 --output-len 128", 1.0),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", choices=tuple(WORKLOADS), action="append", required=True)
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "limit_validation"))
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--port", type=int, default=8474)
    p.add_argument("--server-args", default="", help="flags for `inflight serve` (default: none, make serve's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hold", type=float, default=300.0, help="s: capacity's hold and each serve run")
    p.add_argument("--over", type=float, default=1.2, help="the second serve run, x the limit")
    p.add_argument("--command-timeout", type=float, default=3600.0)
    return p.parse_args(argv)


def run(args, cmd: list[str], log_file: pathlib.Path) -> dict:
    return run_bounded(cmd, log_file, args.command_timeout, tail=1500)


def bench_cmd(args, sub: str, workload: str, extra: list[str]) -> list[str]:
    flags, _ = WORKLOADS[workload]
    serve = f"{args.inflight} serve --port {args.port} {args.server_args}".strip()
    return [args.inflight, "--log-level", "warning", "bench", sub, "--serve-cmd", serve,
            "--base-url", f"http://127.0.0.1:{args.port}", *shlex.split(flags), "--slo", SLO,
            "--disable-tqdm", *extra]


def search_row(doc: dict, run_info: dict) -> dict:
    res = doc["results"][0]
    pred = res.get("prediction") or {}
    refined = (pred.get("refined") or [{}])[0]
    return {"limit": res["limits"][0], "failed_above": res["failed_above"][0],
            "predicted": pred.get("limit"), "prediction_used": pred.get("usable"),
            "prediction_notes": pred.get("notes"), "refined": refined.get("limit"),
            "crossings": res.get("crossings"), "points": len([p for p in res["curve"] if not p.get("held")]),
            "holds": len([p for p in res["curve"] if p.get("held")]),
            "extended_points": sum(1 for p in res["curve"] if len(p["evidence"].get("looks") or []) > 1
                                   and not p.get("held")),
            "host": pred.get("host"), "machine": doc.get("machine"), **run_info}


def serve_row(doc: dict, rate: float, run_info: dict) -> dict:
    v = doc.get("verdict") or {}
    ev = v.get("evidence") or {}
    slo = ev.get("slo") or {}
    # A straddle (an SLO interval across its target, nothing else failing) is not a
    # failure on evidence: the table says so apart from a clear "no".
    undecided = {k for k, iv in slo.items() if (iv or {}).get("state") == "undecided"}
    straddle = not v.get("passed") and bool(undecided) and set(ev.get("causes") or []) <= undecided
    return {"rate": rate, "sustained": v.get("passed"), "straddle": straddle, "reasons": v.get("reasons"),
            "completed_rate": ev.get("completed_rate"), "sample": ev.get("sample"),
            "queue_growth": (ev.get("queue") or {}).get("growth"),
            "ttft_p95": slo.get("ttft_p95"), "itl_p95": slo.get("itl_p95"), **run_info}


def _f(v, d=2) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _iv(iv) -> str:
    return "-" if not iv else f"{_f(iv['estimate'])} [{_f(iv['lo'])}, {_f(iv['hi'])}]"


def _held(r: dict) -> str:
    return "yes" if r["sustained"] else "straddles" if r.get("straddle") else "no"


def table(summary: dict) -> str:
    lines = ["| workload | search | limit (req/s) | failed at | predicted (refined) | prediction error | "
             "points + holds | extended | wall (min) |", "|---|---|---|---|---|---|---|---|---|"]
    for w in summary["workloads"]:
        for i, s in enumerate(w["searches"]):
            err = (None if s["predicted"] is None or not s["limit"] else (s["predicted"] - s["limit"]) / s["limit"])
            lines.append(f"| {w['name']} | {i} | {_f(s['limit'])} | {_f(s['failed_above'])} | {_f(s['predicted'])} "
                         f"({_f(s['refined'])}){'' if s['prediction_used'] else ' not used'} | "
                         f"{'-' if err is None else f'{err:+.0%}'} | {s['points']} + {s['holds']} | "
                         f"{s['extended_points']} | {s['wall_s'] / 60:.1f} |")
    lines += ["", "| workload | L = median limit | spread (max-min)/L | run | rate | sustained | completed "
              "| queue growth | p95 TTFT [CI] (s) | p95 ITL [CI] (s) | why not |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in summary["workloads"]:
        for r in w["serve"]:
            lines.append(f"| {w['name']} | {_f(w['limit'])} | {_pct(w['spread'])} | {r['label']} "
                         f"| {_f(r['rate'])} | {_held(r)} | {_f(r['completed_rate'])} "
                         f"| {_f(r['queue_growth'], 1)} | {_iv(r['ttft_p95'])} | {_iv(r['itl_p95'])} "
                         f"| {'; '.join(r['reasons'] or []) or '-'} |")
    return "\n".join(lines) + "\n"


def validate(args, name: str, out: pathlib.Path) -> dict:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    _, start = WORKLOADS[name]
    searches = []
    for seed in range(args.repeats):
        result = d / f"capacity-{seed}.json"
        info = run(args, bench_cmd(args, "capacity", name, [
            "--calibrate", "--rate-start", str(start), "--seed", str(seed), "--hold-duration", str(args.hold),
            "--save-result", str(result), "--report", str(d / f"report-{seed}")]), d / f"capacity-{seed}.log")
        searches.append(search_row(json.loads(result.read_text()), info) if result.exists() else
                        {"limit": None, **info})
    limits = [s["limit"] for s in searches if s["limit"]]
    entry = {"name": name, "searches": searches, "limit": None, "spread": None, "serve": []}
    if not limits:
        return entry
    limit = statistics.median(limits)
    entry.update(limit=limit, spread=(max(limits) - min(limits)) / limit if len(limits) > 1 else None)
    for factor in (1.0, args.over):
        rate = limit * factor
        result = d / f"serve-{factor:g}x.json"
        info = run(args, bench_cmd(args, "serve", name, [
            "--request-rate", f"{rate:.6g}", "--duration", str(args.hold), "--num-prompts", "100",
            "--reset-prefix-cache", "--seed", "7", "--save-result", str(result)]), d / f"serve-{factor:g}x.log")
        if result.exists():
            doc = json.loads(result.read_text())
            doc.pop("requests", None)  # megabytes; the log keeps the summary
            result.write_text(json.dumps(doc, default=str))
            entry["serve"].append({"label": f"{factor:g}x", **serve_row(doc, rate, info)})
    return entry


def main(argv=None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"workloads": []}
    for name in args.workload:
        summary["workloads"] = [w for w in summary["workloads"] if w["name"] != name]
        summary["workloads"].append(validate(args, name, out))
        path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
        (out / "table.md").write_text(table(summary))
    print("\n" + table(summary))
    ok = all(w["serve"] and w["serve"][0]["sustained"] and not w["serve"][-1]["sustained"]
             for w in summary["workloads"])
    print("validation " + ("holds" if ok else "DOES NOT hold everywhere") + f": {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
