"""Batching policies compared on a replayed Azure conversation slice: static vs dynamic vs
continuous, each served by ``inflight serve --batching-policy P`` with every other knob equal.

The driver runs ``inflight bench`` commands (the recipe of docs/bench.md, "Recipe: batching
policies compared"), each starting and stopping its own server through ``--serve-cmd``:

1. per policy, ``inflight bench sweep`` over ``--time-scales``: throughput and p95 TTFT / ITL
   from light load to overload (the trace's own arrival times, stretched by the time scale);
2. ``--repeats`` rounds of ``inflight bench capacity --repeats 1``, one per policy per round
   (order rotated each round): the smallest time scale (highest load) at which the aggregate
   SLO holds and nothing fails. Interleaving spreads load from other work on a shared
   machine over all policies instead of one.

Every point starts with a cold prefix cache (``--reset-prefix-cache``): the same prompts
are sent at every load, and cached prefixes would otherwise make later points cheaper.

Then it merges the results into ``policies.json`` / ``policies.csv``, draws
``policies.png`` (p95 TTFT and p95 ITL against achieved throughput, one line per policy,
and the capacity per policy) and prints the tables in Markdown (also ``table.md``).
Capacity is reported in req/s: ``offered rate = (N - 1) / (span of the N trace arrivals x
time scale)``, next to what the server completed at that limit (completed / duration,
drain included). With few requests per point, a fast server can absorb a short burst
above the rate it sustains; the completed rate is then the conservative figure.
Results and their caveats: docs/policies.md.

Traffic goes to 127.0.0.1 only. Every run is bounded: ``--num-prompts`` requests per point,
``--request-timeout`` per request, ``--max-points`` per capacity search and
``--command-timeout`` per ``inflight bench`` command. The defaults took 18 minutes on 2
CPU cores (about 25 with other work on the machine).

    .venv/bin/python benchmarks/policies.py                      # the full run
    .venv/bin/python benchmarks/policies.py --num-prompts 6 --time-scales 2,1 --repeats 1 \\
        --max-points 2 --out /tmp/policies-smoke                  # a smoke run (~2 min)
    .venv/bin/python benchmarks/policies.py --report-only         # tables/plot from saved JSON
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results" / "policies"
POLICIES = ("static", "dynamic", "continuous")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for JSON/CSV/PNG/Markdown")
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"),
                   help="the inflight executable (servers and the bench client)")
    p.add_argument("--port", type=int, default=8471, help="server port on 127.0.0.1")
    # workload: the Azure conversation slice, scaled
    g = p.add_argument_group("workload")
    g.add_argument("--trace-file", default="azure_llm_2023_conv_1815-1900.csv")
    g.add_argument("--trace-skip", type=int, default=0)
    g.add_argument("--length-scale", type=float, default=0.125, help="x trace prompt/output lengths")
    g.add_argument("--max-input-len", type=int, default=256, help="cap after scaling")
    g.add_argument("--max-output-len", type=int, default=128, help="cap after scaling")
    g.add_argument("--num-prompts", type=int, default=30,
                   help="measured requests per point (too few and a point is a short burst the "
                        "server absorbs, not a sustained load)")
    g.add_argument("--num-warmups", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=60.0, help="s; a request over it fails")
    # server knobs: identical for every policy
    g = p.add_argument_group("server (same for every policy)")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-queue-delay", type=float, default=0.5, help="s (used by dynamic only)")
    g.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget of a step (the server default 2048 is a ~4 s step on 2 cores)")
    g.add_argument("--kv-cache-memory-bytes", default="512M")
    g.add_argument("--num-threads", type=int, default=2)
    g.add_argument("--server-args", default="", help="more flags for every server")
    # measurement
    g = p.add_argument_group("measurement")
    g.add_argument("--slo", default="ttft_p95=2s,itl_p95=1s")
    g.add_argument("--time-scales", default="4,2,1,0.5,0.25", help="sweep points (x trace time)")
    g.add_argument("--capacity-start", type=float, default=1.0, help="first time scale of each search")
    g.add_argument("--repeats", type=int, default=3, help="capacity searches per policy")
    g.add_argument("--tolerance", type=float, default=0.25, help="search stops at hi/lo <= 1 + this")
    g.add_argument("--max-points", type=int, default=6, help="points per capacity search")
    g.add_argument("--command-timeout", type=float, default=900.0, help="s per inflight bench command")
    g.add_argument("--log-dir", default="/tmp/inflight-policies-logs", help="server logs")
    g.add_argument("--skip-sweep", action="store_true")
    g.add_argument("--skip-capacity", action="store_true")
    g.add_argument("--report-only", action="store_true", help="only rebuild tables/plot from --out")
    return p.parse_args(argv)


# ---------------------------------------------------------------- commands


def serve_template(args) -> str:
    cmd = [args.inflight, "--log-level", "warning", "serve", "--port", str(args.port),
           "--batching-policy", "{value}", "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-queue-delay", str(args.max_queue_delay),
           "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
           "--num-threads", str(args.num_threads), "--seed", str(args.seed)]
    return shlex.join(cmd) + (" " + args.server_args if args.server_args else "")


def common_flags(args) -> list[str]:
    return ["--base-url", f"http://127.0.0.1:{args.port}",
            "--dataset", "trace", "--trace-file", args.trace_file, "--trace-skip", str(args.trace_skip),
            "--length-scale", str(args.length_scale), "--max-input-len", str(args.max_input_len),
            "--max-output-len", str(args.max_output_len), "--arrival", "trace",
            "--num-prompts", str(args.num_prompts), "--num-warmups", str(args.num_warmups),
            "--seed", str(args.seed), "--request-timeout", str(args.request_timeout),
            "--slo", args.slo, "--disable-tqdm", "--server-log-dir", args.log_dir,
            # Every point sends the same prompts: without a reset, later points would find
            # their prompts in the prefix cache and skip most of the prefill work.
            "--reset-prefix-cache"]


def sweep_cmd(args, policy: str, out: pathlib.Path) -> list[str]:
    return [args.inflight, "--log-level", "warning", "bench", "sweep", *common_flags(args),
            "--time-scales", args.time_scales, "--serve-cmd", serve_template(args), "--values", policy,
            "--save-result", str(out / f"sweep-{policy}.json"), "--save-csv", str(out / f"sweep-{policy}.csv")]


def capacity_cmd(args, policy: str, out: pathlib.Path, rep: int) -> list[str]:
    """One search (``--repeats 1``); the driver interleaves repeats across policies, so that
    a stretch of load from other work on the machine does not land on one policy only."""
    return [args.inflight, "--log-level", "warning", "bench", "capacity", *common_flags(args),
            "--time-scale", str(args.capacity_start), "--repeats", "1",
            "--tolerance", str(args.tolerance), "--max-points", str(args.max_points),
            "--serve-cmd", serve_template(args), "--values", policy,
            "--save-result", str(out / f"capacity-{policy}-r{rep}.json")]


def _is_serve(argv: list[str]) -> bool:
    """``... inflight [--log-level L] serve ...``: an inflight server, not a bench client."""
    for i, tok in enumerate(argv):
        if pathlib.Path(tok).name == "inflight":
            rest = argv[i + 1:]
            while rest[:1] == ["--log-level"]:
                rest = rest[2:]
            return rest[:1] == ["serve"]
    return False


def machine_state() -> dict:
    """Load average and other inflight servers running now (the machine is shared)."""
    try:
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,args"], capture_output=True, text=True, timeout=10).stdout
        others = [" ".join(line.split()) for line in ps.splitlines() if _is_serve(line.split()[2:])]
    except (OSError, subprocess.SubprocessError):
        others = []
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = None
    # Others may edit the engine while this runs: the newest source file shows whether every
    # server ran the same code.
    newest = max((f.stat().st_mtime, str(f.relative_to(REPO))) for f in (REPO / "inflight").rglob("*")
                 if f.suffix in (".py", ".c") and f.is_file())
    return {"time": dt.datetime.now().isoformat(timespec="seconds"), "loadavg": list(os.getloadavg()),
            "inflight_serve_processes": others, "git_head": head,
            "newest_source": {"file": newest[1],
                              "mtime": dt.datetime.fromtimestamp(newest[0]).isoformat(timespec="seconds")}}


def run_command(cmd: list[str], timeout: float, log: list[dict], label: str) -> int:
    print(f"\n=== {label}\n$ {shlex.join(cmd)}", flush=True)
    before, t0 = machine_state(), time.monotonic()
    print(f"load average before: {before['loadavg']}", flush=True)
    # Own process group: on timeout or Ctrl-C the client and the server it started stop
    # together (SIGINT first: the client then stops its server cleanly).
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        if isinstance(e, KeyboardInterrupt):
            raise
        rc = -1
        print(f"!!! {label}: over {timeout:g} s, stopped", flush=True)
    after = machine_state()
    wall = time.monotonic() - t0
    print(f"{label}: exit {rc} in {wall:.0f} s; load average after: {after['loadavg']}", flush=True)
    log.append({"label": label, "command": shlex.join(cmd), "exit": rc, "wall_s": round(wall, 1),
                "before": before, "after": after})
    return rc


# ---------------------------------------------------------------- report


def trace_rate_factor(args) -> float:
    """K such that the offered rate at time scale ts is K / ts (req/s): (N - 1) / span of the
    measured trace rows (the warm-up rows come first and are not part of the schedule)."""
    from inflight.bench.datasets import default_data_dir, load_trace
    path = pathlib.Path(args.trace_file)
    if not path.exists():
        path = default_data_dir() / args.trace_file
    start = args.trace_skip + args.num_warmups
    rows = load_trace(path)[start: start + args.num_prompts]
    span = rows[-1].time - rows[0].time
    return (len(rows) - 1) / span


def load_json(path: pathlib.Path):
    return json.loads(path.read_text()) if path.exists() else None


def _f(v, digits=2):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def build_report(args, out: pathlib.Path, policies: list[str], runs: list[dict]) -> dict:
    k = trace_rate_factor(args)
    capacity, rows = {}, []
    for pol in policies:
        sw = load_json(out / f"sweep-{pol}.json")
        hits = {p["arrival"]["time_scale"]: (p.get("server_counters") or {}).get(
            "inflight:prefix_cache_hits_total") for p in (sw or {}).get("points", [])}
        for r in (sw or {}).get("rows", []):
            rows.append({"policy": pol, "time_scale": r["time_scale"], "offered_rate": r["offered_rate"],
                         "request_throughput": r["request_throughput"],
                         "output_throughput": r["output_throughput"], "ttft_p95": r["ttft_p95"],
                         "itl_p95": r["itl_p95"], "ttft_median": r["ttft_median"], "e2e_p95": r["e2e_p95"],
                         "completed": r["completed"], "failed": r["failed"],
                         "peak_concurrency": r["peak_concurrency"], "preemptions": r["preemptions"],
                         "prefix_cache_hit_tokens": hits.get(r["time_scale"])})
        searches = []  # (repeat, result of one search)
        for f in sorted(out.glob(f"capacity-{pol}-r*.json"), key=lambda f: int(f.stem.rsplit("-r", 1)[1])):
            doc = load_json(f)
            if doc and doc.get("results"):
                searches.append((int(f.stem.rsplit("-r", 1)[1]), doc["results"][0]))
        if searches:
            res = {"limits": [r["limits"][0] for _, r in searches],
                   "bounded": all(r["bounded"] for _, r in searches),
                   "curve": [{**p, "repeat": i} for i, r in searches for p in r["curve"]],
                   "fixed": searches[0][1]["fixed"]}
            ts_limits = res["limits"]
            rates = [k / ts for ts in ts_limits if ts]
            # What the server completed at each search's limit (req/s): well below the offered
            # rate means the point was a burst absorbed, not a load sustained.
            at_limit = [next((p["summary"].get("request_throughput") for p in res["curve"]
                              if p["repeat"] == i and p["passed"] and ts and abs(p["x"] - ts) < 1e-9), None)
                        for i, ts in enumerate(ts_limits)]
            capacity[pol] = {
                "time_scale_limits": ts_limits, "rate_limits": rates, "bounded": res["bounded"],
                "found": len(rates), "repeats": len(ts_limits),
                "mean": statistics.fmean(rates) if rates else None,
                "std": statistics.pstdev(rates) if len(rates) > 1 else (0.0 if rates else None),
                "min": min(rates) if rates else None, "max": max(rates) if rates else None,
                "achieved_at_limit": at_limit,
                "achieved_mean": (statistics.fmean([v for v in at_limit if v is not None])
                                  if any(v is not None for v in at_limit) else None),
                "points": [{"repeat": p["repeat"], "time_scale": p["x"], "rate": k * p["load"],
                            "passed": p["passed"], "reasons": p["reasons"],
                            "prefix_cache_hit_tokens": (p["summary"].get("server_counters") or {}).get(
                                "inflight:prefix_cache_hits_total"),
                            "request_throughput": p["summary"].get("request_throughput"),
                            "ttft_p95": (p["summary"].get("ttft") or {}).get("p95"),
                            "itl_p95": (p["summary"].get("itl") or {}).get("p95")}
                           for p in res["curve"]],
                "lengths": res["fixed"].get("lengths"), "server_info": res["fixed"].get("server_info")}
    slo = {}
    for part in args.slo.split(","):
        key, _, val = part.partition("=")
        slo[key.strip()] = val.strip()
    report = {"generated_at": dt.datetime.now().isoformat(timespec="seconds"),
              "driver": "benchmarks/policies.py " + shlex.join(sys.argv[1:]),
              "workload": {"trace_file": args.trace_file, "trace_skip": args.trace_skip,
                           "length_scale": args.length_scale, "max_input_len": args.max_input_len,
                           "max_output_len": args.max_output_len, "num_prompts": args.num_prompts,
                           "num_warmups": args.num_warmups, "seed": args.seed,
                           "rate_at_time_scale_1": k},
              "server_template": serve_template(args), "slo": slo, "capacity": capacity, "sweep": rows,
              "runs": runs}
    return report


def markdown_tables(report: dict) -> str:
    cap, rows = report["capacity"], report["sweep"]
    lines = []
    if cap:
        cont = (cap.get("continuous") or {}).get("mean")
        cont_done = (cap.get("continuous") or {}).get("achieved_mean")
        n = next(iter(cap.values()))["repeats"]
        lines += [f"Capacity under the SLO ({', '.join(f'{k}={v}' for k, v in report['slo'].items())}), "
                  f"{n} search{'es' if n != 1 else ''} per policy:", "",
                  "| policy | capacity (req/s), mean ± std | min – max (req/s) | time scale at the limit "
                  "(per search) | completed req/s at the limit (per search) | continuous / policy, "
                  "capacity | continuous / policy, completed at the limit |",
                  "|---|---|---|---|---|---|---|"]
        for pol, c in cap.items():
            ts = ", ".join("-" if t is None else f"{t:.3g}" for t in c["time_scale_limits"])
            ratio = cont / c["mean"] if cont and c["mean"] else None
            note = "" if c["bounded"] else " (lower bound)"
            done = ", ".join(_f(v) for v in c.get("achieved_at_limit") or [])
            ratio_done = (cont_done / c["achieved_mean"]
                          if cont_done and c.get("achieved_mean") else None)
            lines.append(f"| {pol} | {_f(c['mean'])} ± {_f(c['std'])}{note} | {_f(c['min'])} – {_f(c['max'])} "
                         f"| {ts} | {done} | {_f(ratio)}x | {_f(ratio_done)}x |")
        lines.append("")
    if rows:
        lines += ["Sweep (same requests at each load; p95 over the measured requests):", "",
                  "| policy | time scale | offered (req/s) | achieved (req/s) | output tok/s | p95 TTFT (s) "
                  "| p95 ITL (s) | median TTFT (s) | failed | peak in flight |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['policy']} | {r['time_scale']:g} | {_f(r['offered_rate'])} "
                         f"| {_f(r['request_throughput'])} | {_f(r['output_throughput'], 1)} "
                         f"| {_f(r['ttft_p95'])} | {_f(r['itl_p95'])} | {_f(r['ttft_median'])} "
                         f"| {r['failed']} | {r['peak_concurrency']} |")
    return "\n".join(lines) + "\n"


def _slo_seconds(text: str | None) -> float | None:
    if not text:
        return None
    t = text.strip().lower()
    if t.endswith("ms"):
        return float(t[:-2]) / 1000
    return float(t.rstrip("s"))


def plot(report: dict, path: pathlib.Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter
    fig = Figure(figsize=(12, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    (a1, a2), (a3, a4) = fig.subplots(2, 2)
    colors = {"static": "tab:red", "dynamic": "tab:orange", "continuous": "tab:blue"}
    pols = list(dict.fromkeys([r["policy"] for r in report["sweep"]] + list(report["capacity"])))
    for pol in pols:
        rs = sorted([r for r in report["sweep"] if r["policy"] == pol], key=lambda r: r["offered_rate"])
        c = colors.get(pol)
        x = [r["request_throughput"] for r in rs]
        for ax, key in ((a1, "ttft_p95"), (a2, "itl_p95")):
            ax.plot(x, [r[key] if r[key] is not None else math.nan for r in rs], marker="o", color=c, label=pol)
            for r in rs:
                if r["failed"]:
                    ax.annotate(f"{r['failed']} failed", (r["request_throughput"], r[key] or 0), fontsize=7,
                                color=c, textcoords="offset points", xytext=(4, -10))
        a3.plot([r["offered_rate"] for r in rs], [r["output_throughput"] for r in rs], marker="o", color=c,
                label=pol)
    for ax, key, name in ((a1, "ttft_p95", "p95 TTFT (s)"), (a2, "itl_p95", "p95 ITL (s)")):
        target = _slo_seconds(report["slo"].get(key))
        if target:
            ax.axhline(target, color="black", ls="--", lw=1, label=f"SLO {target:g} s")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xlabel("achieved throughput (req/s)")
        ax.set_ylabel(name)
        ax.set_title(f"{name} vs throughput (sweep over time scales)")
        ax.legend(loc="upper left")
    a3.set_xscale("log")
    offered = sorted({round(r["offered_rate"], 2) for r in report["sweep"] if r["offered_rate"]})
    a3.set_xticks(offered, [f"{v:g}" for v in offered])
    a3.minorticks_off()
    a3.set_xlabel("offered rate (req/s, log)")
    a3.set_ylabel("output tokens/s")
    a3.set_title("output throughput vs offered load")
    a3.legend(loc="upper left")
    cap = report["capacity"]
    names = [p for p in pols if p in cap and cap[p]["mean"] is not None]
    means = [cap[p]["mean"] for p in names]
    err = [[cap[p]["mean"] - cap[p]["min"] for p in names], [cap[p]["max"] - cap[p]["mean"] for p in names]]
    a4.bar(names, means, yerr=err, capsize=6, color=[colors.get(p) for p in names])
    for i, p in enumerate(names):
        for j, v in enumerate(cap[p]["rate_limits"]):
            a4.plot(i, v, "k.", ms=5, label="each search (offered req/s)" if i == j == 0 else None)
        done = [v for v in cap[p].get("achieved_at_limit") or [] if v is not None]
        a4.plot([i + 0.25] * len(done), done, "kx", ms=6,
                label="completed req/s at the limit" if i == 0 else None)
        a4.annotate(("" if cap[p]["bounded"] else ">=") + f"{cap[p]['mean']:.2f}", (i, cap[p]["max"]), textcoords="offset points", xytext=(0, 6),
                    ha="center")
    if names:
        a4.set_ylim(0, max(cap[p]["max"] for p in names) * 1.15)
    a4.set_ylabel("capacity (req/s) under the SLO")
    a4.set_title("capacity: mean, min–max and each search")
    a4.legend(loc="upper left")
    w = report["workload"]
    fig.suptitle(f"inflight batching policies, Azure conv trace (lengths x{w['length_scale']:g}, caps "
                 f"{w['max_input_len']}/{w['max_output_len']}, {w['num_prompts']} requests per point), "
                 f"SLO {', '.join(f'{k}={v}' for k, v in report['slo'].items())}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def write_outputs(report: dict, out: pathlib.Path) -> str:
    (out / "policies.json").write_text(json.dumps(report, indent=1) + "\n")
    if report["sweep"]:
        with (out / "policies.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(report["sweep"][0]))
            w.writeheader()
            w.writerows(report["sweep"])
    table = markdown_tables(report)
    (out / "table.md").write_text(table)
    plot(report, out / "policies.png")
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    # A shell starts background jobs with SIGINT ignored, and children inherit that: the
    # bench client could then not stop its server with SIGINT. A handler here is reset to
    # the default in every child.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: list[dict] = []
    old = None
    if args.report_only:
        old = load_json(out / "policies.json")
        runs = (old or {}).get("runs", [])
    else:
        t0 = time.monotonic()
        runs.append({"label": "start", **machine_state()})
        if not args.skip_sweep:
            for pol in policies:
                run_command(sweep_cmd(args, pol, out), args.command_timeout, runs, f"sweep {pol}")
        if not args.skip_capacity:
            for rep in range(args.repeats):
                # Rotate the order each round, so no policy always runs first or last.
                for pol in policies[rep % len(policies):] + policies[:rep % len(policies)]:
                    run_command(capacity_cmd(args, pol, out, rep), args.command_timeout, runs,
                                f"capacity {pol} search {rep + 1}/{args.repeats}")
        runs.append({"label": "end", "total_wall_s": round(time.monotonic() - t0, 1), **machine_state()})
    report = build_report(args, out, policies, runs)
    if args.report_only and old and old.get("driver"):
        report["driver"] = old["driver"]
    table = write_outputs(report, out)
    print("\n" + table)
    print(f"written: {out}/policies.json, policies.csv, policies.png, table.md (+ sweep-*, capacity-*-r* JSON)")
    return 0 if all(r.get("exit", 0) == 0 for r in runs) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        sys.exit(130)
