"""The operating limit of `make serve`'s server against the peers' servers, on the same
trace, lengths and SLO, one server at a time, repeated (issue 30, item 5; issue 51).

All are measured by the same tool and rules (`inflight bench`, reading each server's own
gauges where it has them): inflight's default server with ``bench capacity --calibrate``;
llama.cpp's llama-server with ``bench tune --knob parallel=8,16,32`` (its best
``--parallel``; one tune per GGUF given), whose recommended configuration's limit is held;
vLLM's CPU server with ``bench capacity`` on the command ``--vllm-cmd`` gives (its own
venv, environment and flags; the bench adds ``--host`` and ``--port``). Cycles run inflight,
then the peers, then again, so a drift of the machine shows in all. The ratio is best limit
against the best peer's, and per cycle.

No peer is built here (their builds belong outside the repo): give llama-server with
``--llama-server`` or ``$LLAMA_SERVER`` and its GGUF files with ``--gguf LABEL=PATH``
(default: the bundled Q4_1 file), vLLM with ``--vllm-cmd``. A peer not given is left out;
with none the benchmark says so and exits 0.

    .venv/bin/python benchmarks/limit_vs_peers.py --llama-server ~/llama.cpp/build/bin/llama-server
    .venv/bin/python benchmarks/limit_vs_peers.py --llama-server ... --cycles 1 --duration 20 \\
        --hold 40 --parallel 8,16 --out /tmp/lvl-smoke                          # a smoke run
    .venv/bin/python benchmarks/limit_vs_peers.py --vllm-cmd "env VLLM_TARGET_DEVICE=cpu \\
        LD_PRELOAD=.../libiomp5.so .../vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \\
        --model smollm2-hf-bf16 --dtype bfloat16 --enforce-eager" --cycles 1

Only 127.0.0.1; every run is bounded by ``--command-timeout``; servers are the bench's own.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys

from _runs import REPO, run_bounded, stop_on_signals

WORKLOAD = ("--dataset trace --trace-file azure_llm_2023_conv_1815-1900.csv --length-scale 0.125 "
            "--max-input-len 256 --max-output-len 128 --ignore-eos")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--gguf", action="append", default=[], help="LABEL=PATH (default: the bundled Q4_1 file)")
    p.add_argument("--parallel", default="8,16,32", help="llama-server --parallel values tuned")
    p.add_argument("--context", type=int, default=16384, help="llama-server -c (shared by its slots)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--slo", default="ttft_p95=2,itl_p95=1")
    p.add_argument("--duration", type=float, default=30.0, help="s per search window")
    p.add_argument("--hold", type=float, default=120.0, help="s: each limit's hold")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--port", type=int, default=8475)
    p.add_argument("--vllm-cmd", help="vLLM CPU's serve command, without --host / --port")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "limit_vs_llamacpp"))
    p.add_argument("--command-timeout", type=float, default=5400.0)
    return p.parse_args(argv)


def run(args, cmd: list[str], log_file: pathlib.Path) -> dict:
    return run_bounded(cmd, log_file, args.command_timeout, tail=1200)


def common(args) -> list[str]:
    return [*shlex.split(args.workload), "--slo", args.slo, "--duration", str(args.duration),
            "--hold-duration", str(args.hold), "--base-url", f"http://127.0.0.1:{args.port}", "--disable-tqdm"]


def inflight_limit(args, d: pathlib.Path, cycle: int) -> dict:
    out = d / f"inflight-{cycle}.json"
    info = run(args, [args.inflight, "--log-level", "warning", "bench", "capacity", "--calibrate", "--serve-cmd",
                      f"{args.inflight} serve --port {args.port}", "--rate-start", "4", *common(args),
                      "--save-result", str(out), "--report", str(d / f"inflight-report-{cycle}")],
               d / f"inflight-{cycle}.log")
    res = json.loads(out.read_text())["results"][0] if out.exists() else {"limits": [None], "failed_above": [None]}
    return {"server": "inflight (make serve)", "limit": res["limits"][0], "failed_above": res["failed_above"][0],
            "configuration": f"{args.inflight} serve (defaults)", "cycle": cycle, **info}


def llama_limit(args, d: pathlib.Path, cycle: int, label: str, gguf: str) -> dict:
    report = d / f"llama-{label}-{cycle}"
    serve = (f"{args.llama_server} -m {gguf} --host 127.0.0.1 --port {args.port} -c {args.context} "
             f"-t {args.threads} --metrics --parallel 16")
    info = run(args, [args.inflight, "--log-level", "warning", "bench", "tune", "--serve-cmd", serve,
                      "--knob", f"parallel={args.parallel}", "--rate-start", "2", *common(args),
                      "--report", str(report), "--fresh"], d / f"llama-{label}-{cycle}.log")
    path = report / "tune.json"
    rec = json.loads(path.read_text())["recommended"] if path.exists() else {"limits": [None], "command": None}
    return {"server": f"llama-server {label}", "limit": rec["limits"][0], "failed_above": (rec.get("failed_above")
            or [None])[0], "configuration": rec.get("command"), "cycle": cycle, **info}


def vllm_limit(args, d: pathlib.Path, cycle: int) -> dict:
    out = d / f"vllm-{cycle}.json"
    serve = f"{args.vllm_cmd} --host 127.0.0.1 --port {args.port}"
    info = run(args, [args.inflight, "--log-level", "warning", "bench", "capacity", "--serve-cmd", serve,
                      "--rate-start", "2", *common(args), "--save-result", str(out),
                      "--report", str(d / f"vllm-report-{cycle}")], d / f"vllm-{cycle}.log")
    res = json.loads(out.read_text())["results"][0] if out.exists() else {"limits": [None], "failed_above": [None]}
    return {"server": "vLLM CPU", "limit": res["limits"][0], "failed_above": res["failed_above"][0],
            "configuration": args.vllm_cmd, "cycle": cycle, **info}


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.llama_server and not args.vllm_cmd:
        print("skipped: give llama-server (--llama-server or $LLAMA_SERVER) or --vllm-cmd; "
              "nothing to compare")
        return 0
    ggufs = dict(g.split("=", 1) for g in args.gguf)
    if not ggufs:
        from inflight.model.bundled import find_bundled_model
        ggufs = {"q4_1": str(find_bundled_model())}
    stop_on_signals()
    d = pathlib.Path(args.out).resolve()
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for cycle in range(args.cycles):
        rows.append(inflight_limit(args, d, cycle))
        for label, gguf in ggufs.items() if args.llama_server else ():
            rows.append(llama_limit(args, d, cycle, label, gguf))
        if args.vllm_cmd:
            rows.append(vllm_limit(args, d, cycle))
        (d / "summary.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1, default=str))
    ours = [r["limit"] for r in rows if r["server"].startswith("inflight") and r["limit"]]
    theirs = [r["limit"] for r in rows if not r["server"].startswith("inflight") and r["limit"]]
    lines = ["| cycle | server | limit (req/s) | failed at | configuration | wall (min) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cycle']} | {r['server']} | {_f(r['limit'])} | {_f(r['failed_above'])} "
                     f"| {r.get('configuration') or '-'} | {r['wall_s'] / 60:.1f} |")
    if ours and theirs:
        lines += ["", f"best against best: {max(ours):.2f} / {max(theirs):.2f} = **{max(ours) / max(theirs):.2f}x**"]
    text = "\n".join(lines) + "\n"
    (d / "table.md").write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
