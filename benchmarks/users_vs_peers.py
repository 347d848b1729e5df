"""Users sustained per SLO tier: `make serve`'s server against the peers' servers, on the same
conversations, think times and tiers, one server at a time (issue 54).

Each server: ``bench capacity --users --slo-tiers`` (inflight with ``--calibrate``: the
simulator's predicted users are in its result), every tier's limit held for ``--hold``
seconds; then each tier is checked the other way: one window of ``--hold`` seconds at
ceil(1.2 x the users held) (``--check-above``), which must fail. Peers are given as
commands (their builds belong outside the repo): ``--llama-server`` (or ``$LLAMA_SERVER``)
with the bundled Q4_1 file and ``--parallel`` slots, ``--vllm-cmd`` (its own venv and
environment; the bench adds ``--host`` and ``--port``). A peer not given is left out.

    .venv/bin/python benchmarks/users_vs_peers.py --llama-server ~/llama.cpp/build/bin/llama-server \\
        --llama-args=--no-repack --out /tmp/users                      # AMX hosts: --no-repack
    .venv/bin/python benchmarks/users_vs_peers.py --duration 20 --hold 40 --tiers 10:2s --out /tmp/u  # smoke

Only 127.0.0.1; every run is bounded by ``--command-timeout``; servers are the bench's own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import sys

from _runs import REPO, record_host, run_bounded, stop_on_signals

WORKLOAD = ("--dataset chat --conversation-turns 2 --output-len 128 --ignore-eos "
            "--think-time 3 --think-time-distribution exponential")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--llama-args", default="", help="extra llama-server flags (--no-repack on AMX hosts)")
    p.add_argument("--parallel", type=int, default=16, help="llama-server --parallel (slots)")
    p.add_argument("--context", type=int, default=32768, help="llama-server -c (shared by its slots)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-cmd", help="vLLM CPU's serve command, without --host / --port")
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--tiers", default="10:2s,30:1s", help="--slo-tiers")
    p.add_argument("--users-start", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="s per search window")
    p.add_argument("--hold", type=float, default=300.0, help="s: each tier's hold, and the check above it")
    p.add_argument("--check-above", type=float, default=1.2, help="the check's users, x the users held")
    p.add_argument("--only", help="comma-separated labels to run (inflight, llama-server, vllm-cpu); default all given")
    p.add_argument("--port", type=int, default=8476)
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "users_vs_peers"))
    p.add_argument("--command-timeout", type=float, default=5400.0)
    return p.parse_args(argv)


def bench(args, serve: str, extra: list[str], out: pathlib.Path, log: pathlib.Path) -> tuple[dict, dict]:
    """``bench capacity --users`` of ``serve``: (the result document or {}, the run's info)."""
    cmd = [args.inflight, "--log-level", "warning", "bench", "capacity", "--serve-cmd", serve,
           *shlex.split(args.workload), "--base-url", f"http://127.0.0.1:{args.port}", "--disable-tqdm",
           "--save-result", str(out), *extra]
    info = run_bounded(cmd, log, args.command_timeout, tail=1200)
    return (json.loads(out.read_text()) if out.exists() else {}), info


def measure(args, d: pathlib.Path, label: str, serve: str, calibrate: bool) -> list[dict]:
    """Every tier's users held (one search per tier, shared points), then each checked at
    ``--check-above`` times as many users over one ``--hold`` window."""
    doc, info = bench(args, serve, ["--users", str(args.users_start), "--slo-tiers", args.tiers,
                                    "--duration", str(args.duration), "--hold-duration", str(args.hold),
                                    "--report", str(d / f"{label}-report"), *(["--calibrate"] if calibrate else [])],
                      d / f"{label}.json", d / f"{label}.log")
    rows = []
    for k, tier in enumerate(doc.get("tiers") or []):
        res = doc["results"][k]
        pred = (res.get("prediction") or {}).get("limit")
        row = {"server": label, "tier": tier["tier"]["name"], "users": tier["users"], "failed_at": tier["failed_at"],
               "held": tier["held"], "speed_p5": tier["speed_p5"], "ttft_p95": tier["ttft_p95"],
               "predicted": pred, "search_wall_s": info["wall_s"], "configuration": serve}
        if tier["users"]:
            above = math.ceil(args.check_above * tier["users"])
            spec = f"{tier['tier']['output_speed_per_user']}:{tier['tier']['ttft']}s"
            check, check_info = bench(args, serve, ["--users", str(above), "--slo-tiers", spec, "--max-points", "1",
                                                    "--duration", str(args.hold), "--hold-duration", "0",
                                                    "--max-extensions", "0"],
                                      d / f"{label}-above-{k}.json", d / f"{label}-above-{k}.log")
            point = ((check.get("results") or [{}])[0].get("curve") or [{}])[0]
            row.update(check_users=above, check_passed=point.get("passed"), check_reasons=point.get("reasons"),
                       check_wall_s=check_info["wall_s"])
        rows.append(row)
    return rows


def _f(v, fmt=".0f") -> str:
    return "-" if v is None else format(v, fmt)


def main(argv=None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    host = record_host()
    d = pathlib.Path(args.out).resolve()
    d.mkdir(parents=True, exist_ok=True)
    servers = [("inflight", f"{args.inflight} serve --port {args.port}", True)]
    if args.llama_server:
        from inflight.model.bundled import find_bundled_model
        servers.append(("llama-server", f"{args.llama_server} -m {find_bundled_model()} --host 127.0.0.1 "
                        f"--port {args.port} -c {args.context} -t {args.threads} -tb {args.threads} --metrics "
                        f"--parallel {args.parallel} {args.llama_args}".rstrip(), False))
    if args.vllm_cmd:
        servers.append(("vllm-cpu", f"{args.vllm_cmd} --host 127.0.0.1 --port {args.port}", False))
    if args.only:
        servers = [s for s in servers if s[0] in args.only.split(",")]
    rows = []
    for label, serve, calibrate in servers:
        rows += measure(args, d, label, serve, calibrate)
        (d / "summary.json").write_text(json.dumps({"rows": rows, "host": host, "args": vars(args)}, indent=1))
    lines = ["| server | tier | users held | failed at | predicted | per-user tok/s p5 | TTFT p95 (s) "
             "| 1.2x check | search wall (min) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = ("-" if "check_users" not in r else
                 f"{r['check_users']}: {'PASSED' if r['check_passed'] else 'failed'}")
        lines.append(f"| {r['server']} | {r['tier']} | {_f(r['users'])} | {_f(r['failed_at'])} | "
                     f"{_f(r['predicted'])} | {_f(r['speed_p5'], '.1f')} | {_f(r['ttft_p95'], '.2f')} | {check} | "
                     f"{r['search_wall_s'] / 60:.1f} |")
    print("\n".join(lines))
    (d / "summary.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
