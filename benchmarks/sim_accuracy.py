"""Simulated vs measured: the same windowed points on a real server and on the simulator.

Two phases, so the slow one runs once:

``measure``: for each case (trace, engine config, load) run ``inflight bench serve``
against a server it starts (``--serve-cmd``, with ``--step-log``), one case at a time on
an otherwise idle machine; record the summary, the load average and the CPU time stolen
by the hypervisor (``/proc/stat``) during the run.

``simulate``: replay every measured case with ``--simulate`` on each ``--profile`` and
print p50 / p95 TTFT, ITL and E2E, output throughput and preemptions side by side with
simulated / measured ratios. ``--profile holdout`` fits, per trace, a profile to the step
logs of the *other* traces' runs (``inflight profile --from-step-log``): the serving cost
of this machine at this hour, never fitted on the case it predicts.

    .venv/bin/python benchmarks/sim_accuracy.py measure --out acc.json \\
        --case azure:base:1,3,5 --case mooncake:base:0.25,0.5,0.8 --case azure:small:1,2.5,4
    .venv/bin/python benchmarks/sim_accuracy.py simulate --out acc.json --profile holdout \\
        --profile offline-profile.json

Traces: ``azure`` (conversation slice) and ``mooncake``, lengths scaled to this small model.
Configs: ``base`` (``--dtype bfloat16``), ``small`` (also ``--max-num-seqs 16
--max-num-batched-tokens 256``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

TRACES = {
    "azure": ["--dataset", "trace", "--length-scale", "0.125", "--max-input-len", "256", "--max-output-len", "128"],
    "mooncake": ["--dataset", "trace", "--trace-file", "mooncake_conversation_0-30min.jsonl", "--length-scale",
                 "0.0625", "--max-input-len", "1024", "--max-output-len", "128"],
}
CONFIGS = {"base": "", "small": "--max-num-seqs 16 --max-num-batched-tokens 256"}
KEYS = [("ttft", "median"), ("ttft", "p95"), ("itl", "median"), ("itl", "p95"), ("e2e", "median"), ("e2e", "p95")]


def _steal() -> tuple[int, int]:
    """(stolen, total) CPU ticks so far, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return vals[7], sum(vals)


def bench(args, case: dict, out: str, simulate: str | None = None, step_log: str | None = None) -> dict:
    serve = f"{args.inflight} serve --port {args.port} --dtype bfloat16 {CONFIGS[case['config']]}".strip()
    if step_log:
        serve += f" --step-log {step_log}"
    cmd = [args.inflight, "bench", "serve", *TRACES[case["trace"]], "--request-rate", str(case["rate"]),
           "--duration", str(args.duration), "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
           "--disable-tqdm", "--base-url", f"http://127.0.0.1:{args.port}", "--serve-cmd", serve,
           "--save-result", out]
    if simulate:
        cmd += ["--simulate", simulate]
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    if rc not in (0, 1):  # 1: nothing completed, still a result
        raise RuntimeError(f"{shlex.join(cmd)} exited {rc}")
    with open(out) as f:
        return json.load(f)


def measure(args) -> None:
    os.makedirs(args.log_dir, exist_ok=True)
    doc = {"command": shlex.join(sys.argv), "duration": args.duration, "num_prompts": args.num_prompts,
           "seed": args.seed, "cases": []}
    for spec in args.case:
        trace, config, rates = spec.split(":")
        for rate in [float(x) for x in rates.split(",")]:
            case = {"trace": trace, "config": config, "rate": rate}
            log = os.path.join(args.log_dir, f"steps-{trace}-{config}-{rate:g}.jsonl")
            load, steal = os.getloadavg(), _steal()
            real = bench(args, case, os.path.join(args.log_dir, "real.json"), step_log=log)
            steal2 = _steal()
            case.update(measured=real["summary"], step_log=log, loadavg=[load, os.getloadavg()],
                        steal_pct=100 * (steal2[0] - steal[0]) / max(steal2[1] - steal[1], 1))
            doc["cases"].append(case)
            print(f"measured {trace} {config} {rate:g}: steal {case['steal_pct']:.1f}%, load {load[0]:.2f}",
                  file=sys.stderr, flush=True)
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)


def holdout_profile(cases: list[dict], trace: str, path: str) -> str:
    """A serving profile fitted to the step logs of every case not on ``trace``."""
    from inflight.sim.measure import from_step_logs
    from inflight.sim.profile import save_profile
    logs = [c["step_log"] for c in cases if c["trace"] != trace]
    prof = from_step_logs(logs)
    save_profile(path, prof)
    return path


def _lat(summary: dict, metric: str, stat: str) -> float | None:
    v = (summary.get(metric) or {}).get(stat)
    return None if v is None else v * 1000


def row(name: str, rs: dict, ss: dict) -> str:
    cells = []
    for m, st in KEYS:
        a, b = _lat(rs, m, st), _lat(ss, m, st)
        cells.append("-" if a is None or b is None else f"{a:.0f} / {b:.0f} ({b / a:.2f})")
    tr, ts = rs["output_throughput"] or 0, ss["output_throughput"] or 0
    cells.append(f"{tr:.1f} / {ts:.1f} ({ts / tr:.2f})" if tr else "-")
    cells.append(f"{rs.get('preemptions')} / {ss.get('preemptions')}")
    return f"| {name} | " + " | ".join(cells) + " |"


def simulate(args) -> None:
    with open(args.out) as f:
        doc = json.load(f)
    tmp = tempfile.mkdtemp(prefix="sim-acc-")
    lines = []
    for case in doc["cases"]:
        case.setdefault("simulated", {})
        for prof in args.profile:
            path = prof
            if prof == "holdout":
                path = holdout_profile(doc["cases"], case["trace"], os.path.join(tmp, f"holdout-{case['trace']}.json"))
            sim = bench(args, case, os.path.join(tmp, "sim.json"), simulate=path)
            case["simulated"][os.path.basename(prof)] = sim["summary"]
            name = f"{case['trace']} {case['config']} {case['rate']:g} req/s, {os.path.basename(prof)}"
            lines.append(row(name, case["measured"], sim["summary"]) + f" {case['steal_pct']:.0f}% |")
            print(lines[-1], file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    head = "| case, profile | " + " | ".join(f"{m.upper()} {'p50' if s == 'median' else s} ms" for m, s in KEYS)
    print(head + " | out tok/s | preemptions | steal |")
    print("|" + "---|" * (len(KEYS) + 4))
    print("\n".join(lines))
    print("\ncells: measured / simulated (simulated / measured)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("measure", "simulate"))
    p.add_argument("--case", action="append", metavar="TRACE:CONFIG:RATE,RATE,...")
    p.add_argument("--profile", action="append", help="simulate: a profile file, or holdout (repeatable)")
    p.add_argument("--out", default="sim_accuracy.json")
    p.add_argument("--log-dir", default="sim-accuracy-logs")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--inflight", default=os.path.join(os.path.dirname(sys.executable), "inflight"))
    args = p.parse_args()
    if args.phase == "measure":
        if not args.case:
            p.error("measure needs --case")
        measure(args)
    else:
        if not args.profile:
            p.error("simulate needs --profile")
        with open(args.out) as f:
            saved = json.load(f)
        args.duration, args.num_prompts, args.seed = saved["duration"], saved["num_prompts"], saved["seed"]
        simulate(args)
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    sys.exit(main())
