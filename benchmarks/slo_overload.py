"""SLO-aware scheduling and load shedding under overload: ``fcfs`` vs ``slo`` (issue 5).

Workload: the Azure conversation slice (lengths x1/8, capped at 256 in / 128 out, as in
``benchmarks/policies.py``), Poisson arrivals, every server knob equal except the
scheduling policy. Two phases, each a series of ``inflight bench sweep`` commands that start
and stop their own server (``--serve-cmd``):

1. fcfs capacity: a sweep over ``--capacity-rates``; the capacity is the highest rate at which
   the aggregate SLO holds (p95 TTFT and p95 ITL) *and* the server completed at least 90% of
   the offered rate (a short burst absorbed is not a sustained load).
2. overload: each config at ``--loads`` x that capacity (default 1.5x and 3x), ``--repeats``
   rounds with the config order rotated per round. Reported per config and load: goodput
   (completed requests that met the per-request SLO, per second: DistServe's definition),
   how many were shed (503), and p50/p95 TTFT and p95 ITL of the admitted requests.

Configs: ``fcfs`` (no shedding), ``slo`` (``--scheduling-policy slo --ttft-slo --itl-slo``:
EDF, ITL-capped step budget, shedding of requests whose TTFT deadline is out of reach) and
``fcfs-mqt`` (fcfs plus ``--max-queue-time`` = the TTFT target: a timeout, for contrast).

Traffic goes to 127.0.0.1 only; every command is bounded (``--num-prompts``,
``--request-timeout``, ``--command-timeout``). The defaults take about 20 minutes on 2 cores.

    .venv/bin/python benchmarks/slo_overload.py                       # the full run
    .venv/bin/python benchmarks/slo_overload.py --capacity 3.5        # skip phase 1
    .venv/bin/python benchmarks/slo_overload.py --num-prompts 8 --capacity 3 --repeats 1 \\
        --configs fcfs,slo --out /tmp/slo-smoke                        # smoke run (~2 min)
    .venv/bin/python benchmarks/slo_overload.py --report-only          # tables/plot again
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import pathlib
import shlex
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from policies import _f, machine_state, run_command  # noqa: E402  (sibling benchmark script)

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results" / "slo_overload"
CONFIGS = ("fcfs", "slo", "fcfs-mqt")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--port", type=int, default=8472)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="s: server target and goodput SLO")
    p.add_argument("--itl-slo", type=float, default=1.0, help="s: server target and goodput SLO")
    p.add_argument("--capacity", type=float, default=None, help="fcfs capacity (req/s); skips phase 1")
    p.add_argument("--capacity-rates", default="2,3,4,5,6", help="phase 1 sweep (req/s)")
    p.add_argument("--loads", default="1.5,3", help="multiples of the fcfs capacity")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=100, help="measured requests per point")
    p.add_argument("--num-warmups", type=int, default=10, help="also train the step-time model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--command-timeout", type=float, default=900.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", default="512M")
    p.add_argument("--log-dir", default="/tmp/inflight-slo-logs")
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def serve_template(args, config: str) -> str:
    policy = "slo" if config == "slo" else "fcfs"
    cmd = [args.inflight, "--log-level", "warning", "serve", "--port", str(args.port),
           "--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--kv-cache-memory-bytes", args.kv_cache_memory_bytes, "--seed", str(args.seed)]
    if config == "slo":
        cmd += ["--ttft-slo", str(args.ttft_slo), "--itl-slo", str(args.itl_slo)]
    if config == "fcfs-mqt":
        cmd += ["--max-queue-time", str(args.ttft_slo)]
    return shlex.join(cmd)  # the bench's --values only names the config in rows and logs


def sweep_cmd(args, config: str, rates: list[float], seed: int, out: pathlib.Path) -> list[str]:
    slo = (f"ttft={args.ttft_slo}s,itl={args.itl_slo}s,"
           f"ttft_p95={args.ttft_slo}s,itl_p95={args.itl_slo}s")
    return [args.inflight, "--log-level", "warning", "bench", "sweep",
            "--base-url", f"http://127.0.0.1:{args.port}", "--dataset", "trace",
            "--length-scale", "0.125", "--max-input-len", "256", "--max-output-len", "128",
            "--arrival", "poisson", "--request-rates", ",".join(f"{r:.4g}" for r in rates),
            "--num-prompts", str(args.num_prompts), "--num-warmups", str(args.num_warmups),
            "--seed", str(seed), "--request-timeout", str(args.request_timeout), "--slo", slo,
            "--disable-tqdm", "--reset-prefix-cache", "--server-log-dir", args.log_dir,
            "--serve-cmd", serve_template(args, config), "--values", config,
            "--save-result", str(out)]


def pick_capacity(doc: dict, ttft: float, itl: float) -> float | None:
    """Highest offered rate with p95 TTFT/ITL within target and >= 90% of it completed."""
    best = None
    for r in doc["rows"]:
        ok = (r["ttft_p95"] is not None and r["ttft_p95"] <= ttft and r["itl_p95"] is not None
              and r["itl_p95"] <= itl and r["failed"] == 0
              and r["request_throughput"] >= 0.9 * r["offered_rate"])
        if ok and (best is None or r["rate"] > best):
            best = r["rate"]
    return best


def run(args, out: pathlib.Path) -> None:
    configs = args.configs.split(",")
    log: list[dict] = []
    capacity = args.capacity
    if capacity is None:
        rates = [float(x) for x in args.capacity_rates.split(",")]
        f = out / "capacity-fcfs.json"
        run_command(sweep_cmd(args, "fcfs", rates, args.seed, f), args.command_timeout, log,
                    "fcfs capacity sweep")
        capacity = pick_capacity(json.loads(f.read_text()), args.ttft_slo, args.itl_slo)
        if capacity is None:
            raise SystemExit(f"no rate in {rates} met the SLO under fcfs; lower --capacity-rates")
    (out / "capacity.json").write_text(json.dumps({"fcfs_capacity": capacity}))
    loads = [float(x) for x in args.loads.split(",")]
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for config in order:
            run_command(sweep_cmd(args, config, [capacity * k for k in loads], args.seed + rep,
                                  out / f"overload-{config}-r{rep}.json"),
                        args.command_timeout, log, f"{config} round {rep}")
    (out / "runs.json").write_text(json.dumps(log, indent=2))


def report(args, out: pathlib.Path) -> str:
    capacity = json.loads((out / "capacity.json").read_text())["fcfs_capacity"]
    loads = [float(x) for x in args.loads.split(",")]
    rows = []
    for config in args.configs.split(","):
        points = []
        for f in sorted(out.glob(f"overload-{config}-r*.json")):
            doc = json.loads(f.read_text())
            points += [(round(row["rate"] / capacity, 2), row, pt["summary"])
                       for row, pt in zip(doc["rows"], doc["points"])]
        for k in loads:
            got = [(row, s) for load, row, s in points if abs(load - k) < 0.01]
            if not got:
                continue

            def mean(fn):
                vals = [fn(row, s) for row, s in got]
                vals = [v for v in vals if v is not None]
                return statistics.fmean(vals) if vals else None

            rows.append({
                "config": config, "load": k, "offered_rate": mean(lambda r, s: r["offered_rate"]),
                "runs": len(got), "goodput": mean(lambda r, s: s["goodput"]),
                "goodput_runs": [s["goodput"] for _, s in got],
                "completed": mean(lambda r, s: s["completed"]), "shed": mean(lambda r, s: s["failed"]),
                "good": mean(lambda r, s: s["good_requests"]),
                "request_throughput": mean(lambda r, s: s["request_throughput"]),
                "ttft_p50": mean(lambda r, s: s["ttft"]["median"]),
                "ttft_p95": mean(lambda r, s: s["ttft"]["p95"]),
                "itl_p95": mean(lambda r, s: s["itl"]["p95"]),
                "errors": sorted({e for _, s in got for e in s["errors"]})})
    (out / "summary.json").write_text(json.dumps({"fcfs_capacity": capacity, "rows": rows,
                                                  "generated_at": dt.datetime.now().isoformat(
                                                      timespec="seconds")}, indent=2))
    n = args.num_prompts

    lines = [f"fcfs capacity at the SLO: {capacity:g} req/s. {n} measured requests per point; "
             f"means over runs.", "",
             "| config | load | offered req/s | goodput req/s (runs) | completed | shed | "
             "met SLO | TTFT p50 s | TTFT p95 s | ITL p95 s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['load']:g}x | {_f(r['offered_rate'])} | {_f(r['goodput'])} "
                     f"({', '.join(_f(g) for g in r['goodput_runs'])}) | {_f(r['completed'], 0)}/{n} | "
                     f"{_f(r['shed'], 0)} | {_f(r['good'], 0)} | {_f(r['ttft_p50'])} | "
                     f"{_f(r['ttft_p95'])} | {_f(r['itl_p95'])} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    plot(rows, loads, capacity, out / "slo_overload.png", args)
    return table


def plot(rows: list[dict], loads: list[float], capacity: float, path: pathlib.Path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(configs), 1)
    for i, c in enumerate(configs):
        xs = [j + i * width for j, _ in enumerate(loads)]
        by = {r["load"]: r for r in rows if r["config"] == c}
        axes[0].bar(xs, [by.get(k, {}).get("goodput") or 0 for k in loads], width, label=c)
        axes[1].bar(xs, [by.get(k, {}).get("ttft_p95") or 0 for k in loads], width, label=c)
    for ax in axes:
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(loads))],
                      [f"{k:g}x capacity\n({k * capacity:.2g} req/s)" for k in loads])
        ax.legend()
    axes[0].axhline(capacity, color="grey", ls=":", lw=1)
    axes[0].set_ylabel(f"goodput, req/s (TTFT <= {args.ttft_slo:g} s, every ITL <= {args.itl_slo:g} s)")
    axes[1].axhline(args.ttft_slo, color="grey", ls=":", lw=1)
    axes[1].set_ylabel("p95 TTFT of admitted requests, s")
    axes[1].set_yscale("log")
    fig.suptitle("fcfs vs slo scheduling under overload (Azure conv slice, Poisson arrivals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        print(f"machine: {machine_state()['loadavg']}", flush=True)
        run(args, out)
    print(report(args, out))


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
