"""Does the operating limit hold? Find it with ``inflight bench capacity``, then hold that load
(and 1.25x it) for five minutes with ``inflight bench serve`` against the same server.

The claim checked (docs/capacity.md): the limit ``bench capacity`` reports is a load the
server sustains, with the SLO met over a long run, and a load 25 % above it is not. Each
run is a windowed point judged by the same rules (``inflight.bench.sustain``): completed
rate vs offered, queue growth, each SLO statistic's confidence interval, failures,
preemptions. The held runs use the next seed: other Poisson arrivals than the capacity
search's own hold saw.

One ``inflight serve`` is started for all runs (127.0.0.1 only) and stopped at the end;
the bench commands run as child processes and each is bounded by ``--command-timeout``.
The defaults (the Azure conversation slice in ../shared/data, lengths x0.125, caps 256 /
128, natural EOS, Poisson arrivals, p95 TTFT <= 2 s and p95 ITL <= 1 s; the server of
issue 18: bfloat16, 256-token steps, 32 sequences) take about 35 minutes on 2 cores.

    .venv/bin/python benchmarks/capacity_validation.py                  # the full run
    .venv/bin/python benchmarks/capacity_validation.py --hold 60 --duration 30 --max-points 3 \\
        --out /tmp/capval-smoke                                          # a smoke run (~8 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

from inflight.bench.limit_doc import lost_because
from inflight.bench.machine import describe_machine
from inflight.bench.server_proc import ServerProcess

REPO = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "capacity_validation"))
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--port", type=int, default=8472)
    p.add_argument("--server-args", default="--dtype bfloat16 --max-num-batched-tokens 256 --max-num-seqs 32 "
                                            "--kv-cache-memory-bytes 512M")
    p.add_argument("--workload", default="--dataset trace --trace-file azure_llm_2023_conv_1815-1900.csv "
                                         "--length-scale 0.125 --max-input-len 256 --max-output-len 128 "
                                         "--no-ignore-eos --arrival poisson --num-warmups 2",
                   help="bench flags that define the request mix and arrivals")
    p.add_argument("--slo", default="ttft_p95=2,itl_p95=1")
    p.add_argument("--duration", type=float, default=60.0, help="capacity: window per point (s)")
    p.add_argument("--rate-start", type=float, default=2.0)
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--max-points", type=int, default=10)
    p.add_argument("--hold", type=float, default=300.0,
                   help="s: the window of capacity's own hold and of each held serve run")
    p.add_argument("--over", type=float, default=1.25, help="the second held run, x the limit")
    p.add_argument("--command-timeout", type=float, default=3600.0)
    p.add_argument("--log-dir", default="/tmp/inflight-capacity-validation", help="the server's log")
    return p.parse_args(argv)


def bench(args, sub: str, extra: list[str], log_file: pathlib.Path, log: list[dict]) -> int:
    cmd = [args.inflight, "--log-level", "warning", "bench", sub, "--base-url", f"http://127.0.0.1:{args.port}",
           *shlex.split(args.workload), "--slo", args.slo, "--disable-tqdm", *extra]
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    before, t0 = describe_machine(), time.monotonic()
    with open(log_file, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.command_timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            proc.terminate()  # the bench stops cleanly on SIGTERM (exit 143)
            rc = proc.wait(timeout=60)
            if isinstance(e, KeyboardInterrupt):
                raise
    log.append({"command": shlex.join(cmd), "exit": rc, "wall_s": round(time.monotonic() - t0, 1),
                "before": before, "after": describe_machine()})
    print(log_file.read_text()[-3000:], flush=True)
    return rc


def held_row(doc: dict, label: str) -> dict:
    v = doc.get("verdict") or {}
    ev = v.get("evidence") or {}
    return {"run": label, "rate": doc["arrival"]["rate"], "sustained": v.get("passed"), "reasons": v.get("reasons"),
            "offered_rate": ev.get("offered_rate"), "completed_rate": ev.get("completed_rate"),
            "sample": ev.get("sample"), "window_s": (ev.get("window") or {}).get("seconds"),
            "queue_growth": (ev.get("queue") or {}).get("growth"), "unfinished": ev.get("unfinished"),
            "failed": ev.get("failed"), "preemptions_per_request": ev.get("preemptions_per_request"),
            "slo": ev.get("slo"), "peak_concurrency": doc["summary"].get("peak_concurrency")}


def _f(v, d=2):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.{d}f}"


def markdown(summary: dict) -> str:
    cap = summary["capacity"]
    def iv(slo, k):
        x = (slo or {}).get(k)
        return "-" if not x else f"{_f(x['estimate'])} [{_f(x['lo'])}, {_f(x['hi'])}]"
    lines = ["`bench capacity` (60 s search points, then holds of the limit):", "",
             "| point | rate (req/s) | window (s) | offered | completed | p95 TTFT [95% CI] (s) | p95 ITL [95% CI] (s) "
             "| verdict |", "|---|---|---|---|---|---|---|---|"]
    for p in cap["points"]:
        lines.append(f"| {'hold' if p['held'] else 'search'} | {_f(p['rate'], 3)} | {_f(p['window_s'], 0)} "
                     f"| {_f(p['offered_rate'])} | {_f(p['completed_rate'])} | {iv(p['slo'], 'ttft_p95')} "
                     f"| {iv(p['slo'], 'itl_p95')} | {'pass' if p['passed'] else '; '.join(p['reasons'])} |")
    lines += ["", f"Operating limit found: **{_f(cap['limit'])} req/s** (the first failure above it: "
              f"{_f(cap['failed_above'])} req/s: {', '.join(cap['lost_because']) or '-'})", "",
             "Held with `bench serve --duration 300` (seed 1: other arrivals and another sample of the trace):", "",
             "| run | rate (req/s) | sustained | offered in window | completed | requests | queue growth "
             "(2nd half) | p95 TTFT [95% CI] (s) | p95 ITL [95% CI] (s) | unfinished | why not |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["held"]:
        lines.append(f"| {r['run']} | {_f(r['rate'])} | {'yes' if r['sustained'] else 'no'} "
                     f"| {_f(r['offered_rate'])} | {_f(r['completed_rate'])} | {r['sample']} "
                     f"| {_f(r['queue_growth'], 1)} | {iv(r['slo'], 'ttft_p95')} | {iv(r['slo'], 'itl_p95')} "
                     f"| {r['unfinished']} | {'; '.join(r['reasons'] or []) or '-'} |")
    return "\n".join(lines) + "\n"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    # A shell starts background jobs with SIGINT ignored; and SIGTERM must also reach the
    # `finally` that stops the server (and, through the bench, the children).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log: list[dict] = []
    serve = f"{args.inflight} --log-level warning serve --port {args.port} {args.server_args}"
    os.makedirs(args.log_dir, exist_ok=True)
    server = ServerProcess(serve, f"http://127.0.0.1:{args.port}", log_path=os.path.join(args.log_dir, "server.log"))
    asyncio.run(server.start())
    try:
        rc = bench(args, "capacity", ["--duration", str(args.duration), "--rate-start", str(args.rate_start),
                                      "--tolerance", str(args.tolerance), "--max-points", str(args.max_points),
                                      "--hold-duration", str(args.hold),
                                      "--save-result", str(out / "capacity.json"), "--report", str(out / "report")],
                   out / "capacity.log", log)
        doc = json.loads((out / "capacity.json").read_text())
        res = doc["results"][0]
        limit = res["limits"][0]
        if rc != 0 or limit is None:
            print("no operating limit found; nothing to hold", file=sys.stderr)
            return 1
        held = []
        for factor, name in ((1.0, "hold-1.00x"), (args.over, f"hold-{args.over:.2f}x")):
            rate = limit * factor
            bench(args, "serve", ["--request-rate", f"{rate:.6g}", "--duration", str(args.hold),
                                  "--num-prompts", "100", "--reset-prefix-cache", "--seed", "1",
                                  # every request of 5 minutes: megabytes, kept with the logs
                                  "--save-result", os.path.join(args.log_dir, f"{name}.json")],
                  out / f"{name}.log", log)
            doc = json.loads(pathlib.Path(args.log_dir, f"{name}.json").read_text())
            held.append(held_row(doc, f"{factor:g}x the limit"))
    finally:
        server.stop()
    lost = sorted(lost_because(res))
    summary = {"capacity": {"limit": limit, "failed_above": res["failed_above"][0], "lost_because": lost,
                            "points": [{"rate": p["x"], "held": p.get("held"), "passed": p["passed"],
                                        "reasons": p["reasons"], "offered_rate": p["evidence"]["offered_rate"],
                                        "completed_rate": p["evidence"]["completed_rate"],
                                        "window_s": p["evidence"]["window"]["seconds"],
                                        "slo": p["evidence"]["slo"]} for p in res["curve"]]},
               "held": held, "server": serve, "workload": args.workload, "slo": args.slo, "runs": log}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    table = markdown(summary)
    (out / "table.md").write_text(table)
    print("\n" + table)
    ok = held[0]["sustained"] and not held[1]["sustained"]
    print("validation " + ("holds" if ok else "DOES NOT hold") + f": written to {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    sys.exit(main())
