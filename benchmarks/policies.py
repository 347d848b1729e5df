"""Batching policies compared on a replayed Azure conversation slice: static vs dynamic vs
continuous, each served by ``inflight serve --batching-policy P`` with every other knob equal.

The driver runs ``inflight bench`` commands (the recipe of docs/bench.md, "Recipe: batching
policies compared"), each starting and stopping its own server through ``--serve-cmd``:

1. per policy, ``inflight bench sweep`` over ``--time-scales``: throughput and p95 TTFT / ITL
   from light load to overload (the trace's own arrival times, stretched by the time scale);
2. ``--repeats`` rounds of ``inflight bench capacity --repeats 1``, one per policy per round
   (order rotated each round): the smallest time scale (highest load) at which the aggregate
   SLO holds and nothing fails, then that limit **held** for ``--hold-duration`` (stepping
   down by the tolerance when the hold fails, docs/capacity.md). Interleaving spreads load
   from other work on a shared machine over all policies instead of one.

Every point is a sustained window (``--duration``, 60 s, of at least ``--num-prompts``
requests, after a warm-up and before a cool-down; docs/capacity.md) and passes only on the
evidence of ``inflight.bench.sustain``: the completed rate keeps up with the offered one,
the queue does not grow, each p95's 95 % interval is within its target. Each capacity
search replays its own stretch of the trace (``--trace-skip`` + repeat x ``--repeat-skip``
rows): trace arrivals ignore the seed, so repeats of one stretch would only measure noise.
Every point starts with a cold prefix cache (``--reset-prefix-cache``): the same prompts
are sent at every load, and cached prefixes would otherwise make later points cheaper.

Then it merges the results into ``policies.json`` / ``policies.csv``, draws
``policies.png`` (p95 TTFT and p95 ITL against the offered rate, one line per policy, from
the sweep or, with ``--skip-sweep``, from the searches' own points; the operating limit per
policy) and prints the tables in Markdown (also ``table.md``).
The limit is reported as the offered rate in the window of the highest sustained point
(requests arrived / window seconds), next to what the server completed in that window.
Results and their caveats: docs/policies.md.

Traffic goes to 127.0.0.1 only. Every run is bounded: the window and its drain timeout per
point, ``--request-timeout`` per request, ``--max-points`` per capacity search and
``--command-timeout`` per ``inflight bench`` command. The defaults take about 2.5 hours on
2 CPU cores; ``--skip-sweep`` about 80 minutes.

    .venv/bin/python benchmarks/policies.py                      # the full run
    .venv/bin/python benchmarks/policies.py --duration 10 --num-prompts 20 --time-scales 4,1 \\
        --repeats 1 --max-points 2 --out /tmp/policies-smoke      # a smoke run (~6 min)
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

from inflight.bench.limit_doc import best_point, lost_because
from inflight.bench.machine import cpu_shares, cpu_ticks

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
    g.add_argument("--num-prompts", type=int, default=100,
                   help="measured requests per point, at least (the window stretches to hold them)")
    g.add_argument("--duration", type=float, default=60.0,
                   help="s: each point's measurement window (after a warm-up of duration / 6, "
                        "before a cool-down): a sustained load, not a burst")
    g.add_argument("--repeat-skip", type=int, default=2000,
                   help="trace rows between the stretches that successive capacity searches replay")
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
    g.add_argument("--time-scales", default="8,4,2,1.4,1", help="sweep points (x trace time)")
    g.add_argument("--capacity-start", type=float, default=2.0, help="first time scale of each search")
    g.add_argument("--repeats", type=int, default=2, help="capacity searches per policy")
    g.add_argument("--tolerance", type=float, default=0.15, help="search stops at hi/lo <= 1 + this")
    g.add_argument("--max-points", type=int, default=6, help="points per capacity search")
    g.add_argument("--hold-duration", type=float, default=180.0,
                   help="s: each search's limit is held this long, stepping down on failure")
    g.add_argument("--max-holds", type=int, default=2, help="holds per search")
    g.add_argument("--command-timeout", type=float, default=2400.0, help="s per inflight bench command")
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


def common_flags(args, rep: int = 0) -> list[str]:
    """Every point a sustained window; search ``rep`` replays its own stretch of the trace
    (the seed moves no trace arrival, so repeats of one stretch would only measure noise)."""
    return ["--base-url", f"http://127.0.0.1:{args.port}", "--duration", str(args.duration),
            "--dataset", "trace", "--trace-file", args.trace_file,
            "--trace-skip", str(args.trace_skip + rep * args.repeat_skip),
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
    return [args.inflight, "--log-level", "warning", "bench", "capacity", *common_flags(args, rep),
            "--time-scale", str(args.capacity_start), "--repeats", "1",
            "--tolerance", str(args.tolerance), "--max-points", str(args.max_points),
            "--hold-duration", str(args.hold_duration), "--max-holds", str(args.max_holds),
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
            "cpu_ticks": cpu_ticks(),
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
    shares = cpu_shares(before, after)
    print(f"{label}: exit {rc} in {wall:.0f} s; load average after: {after['loadavg']}; CPU {shares}", flush=True)
    log.append({"label": label, "command": shlex.join(cmd), "exit": rc, "wall_s": round(wall, 1),
                "before": before, "after": after, "cpu_shares": shares})
    return rc


# ---------------------------------------------------------------- report


def load_json(path: pathlib.Path):
    return json.loads(path.read_text()) if path.exists() else None


def _f(v, digits=2):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def _ci(ev: dict, key: str) -> dict | None:
    iv = (ev.get("slo") or {}).get(key)
    return None if not iv else {k: iv[k] for k in ("estimate", "lo", "hi", "n")}


def build_report(args, out: pathlib.Path, policies: list[str], runs: list[dict]) -> dict:
    capacity, rows = {}, []
    for pol in policies:
        sw = load_json(out / f"sweep-{pol}.json")
        for r, p in zip((sw or {}).get("rows", []), (sw or {}).get("points", [])):
            ev = (p.get("verdict") or {}).get("evidence") or {}
            rows.append({"policy": pol, "time_scale": r["time_scale"], "offered_rate": ev.get("offered_rate"),
                         "completed_rate": ev.get("completed_rate"), "sustained": r.get("sustained"),
                         "output_throughput": r["output_throughput"], "ttft_p95": r["ttft_p95"],
                         "itl_p95": r["itl_p95"], "ttft_median": r["ttft_median"], "e2e_p95": r["e2e_p95"],
                         "ttft_p95_ci": _ci(ev, "ttft_p95"), "itl_p95_ci": _ci(ev, "itl_p95"),
                         "completed": r["completed"], "failed": r["failed"], "unfinished": ev.get("unfinished"),
                         "queue_growth": (ev.get("queue") or {}).get("growth"),
                         "peak_concurrency": r["peak_concurrency"], "preemptions": r["preemptions"],
                         "reasons": (p.get("verdict") or {}).get("reasons"),
                         "prefix_cache_hit_tokens": (p.get("server_counters") or {}).get(
                             "inflight:prefix_cache_hits_total")})
        searches = []  # (repeat, result of one search)
        for f in sorted(out.glob(f"capacity-{pol}-r*.json"), key=lambda f: int(f.stem.rsplit("-r", 1)[1])):
            doc = load_json(f)
            if doc and doc.get("results"):
                searches.append((int(f.stem.rsplit("-r", 1)[1]), doc["results"][0]))
        if not searches:
            continue
        limits = []
        for rep, res in searches:
            p = best_point(res)
            ev = (p or {}).get("evidence") or {}
            limits.append({"repeat": rep, "trace_skip": args.trace_skip + rep * args.repeat_skip,
                           "time_scale": res["limits"][0], "failed_above": res["failed_above"][0],
                           "offered_rate": ev.get("offered_rate"), "completed_rate": ev.get("completed_rate"),
                           "ttft_p95_ci": _ci(ev, "ttft_p95"), "itl_p95_ci": _ci(ev, "itl_p95"),
                           "lost_because": sorted(lost_because(res))})
        rates = [x["offered_rate"] for x in limits if x["offered_rate"] is not None]
        done = [x["completed_rate"] for x in limits if x["completed_rate"] is not None]
        capacity[pol] = {
            "searches": limits, "bounded": all(r["bounded"] for _, r in searches), "found": len(rates),
            "repeats": len(limits), "mean": statistics.fmean(rates) if rates else None,
            "std": statistics.pstdev(rates) if len(rates) > 1 else (0.0 if rates else None),
            "min": min(rates) if rates else None, "max": max(rates) if rates else None,
            "completed_mean": statistics.fmean(done) if done else None,
            "points": [{"repeat": rep, "time_scale": p["x"], "held": bool(p.get("held")), "passed": p["passed"],
                        "reasons": p["reasons"], "offered_rate": p["evidence"].get("offered_rate"),
                        "completed_rate": p["evidence"].get("completed_rate"),
                        "output_throughput": p["summary"].get("output_throughput"),
                        "ttft_p95": (p["summary"].get("ttft") or {}).get("p95"),
                        "itl_p95": (p["summary"].get("itl") or {}).get("p95"),
                        "unfinished": p["evidence"].get("unfinished"), "failed": p["evidence"].get("failed"),
                        "ttft_p95_ci": _ci(p["evidence"], "ttft_p95"), "causes": p["evidence"].get("causes", [])}
                       for rep, res in searches for p in res["curve"]],
            "lengths": searches[0][1]["fixed"].get("lengths"), "server_info": searches[0][1]["fixed"].get("server_info")}
    slo = {}
    for part in args.slo.split(","):
        key, _, val = part.partition("=")
        slo[key.strip()] = val.strip()
    return {"generated_at": dt.datetime.now().isoformat(timespec="seconds"),
            "driver": "benchmarks/policies.py " + shlex.join(sys.argv[1:]),
            "workload": {"trace_file": args.trace_file, "trace_skip": args.trace_skip,
                         "repeat_skip": args.repeat_skip, "length_scale": args.length_scale,
                         "max_input_len": args.max_input_len, "max_output_len": args.max_output_len,
                         "num_prompts": args.num_prompts, "duration": args.duration,
                         "num_warmups": args.num_warmups, "seed": args.seed,
                         "hold_duration": args.hold_duration, "max_holds": args.max_holds},
            "server_template": serve_template(args), "slo": slo, "capacity": capacity, "sweep": rows,
            "runs": runs}


def _iv(ci: dict | None) -> str:
    return "-" if not ci else f"{_f(ci['estimate'])} [{_f(ci['lo'])}, {_f(ci['hi'])}]"


def markdown_tables(report: dict) -> str:
    cap, rows = report["capacity"], report["sweep"]
    lines = []
    if cap:
        cont = (cap.get("continuous") or {}).get("mean")
        n = next(iter(cap.values()))["repeats"]
        lines += [f"Operating limit under the SLO ({', '.join(f'{k}={v}' for k, v in report['slo'].items())}), "
                  f"sustained {report['workload']['duration']:g} s windows, {n} search{'es' if n != 1 else ''} "
                  "per policy (each on its own stretch of the trace):", "",
                  "| policy | limit: offered req/s, mean ± std | completed req/s at the limit | per search: "
                  "offered (time scale) | p95 TTFT at the limit [95% CI] (s) | broke above it | continuous / "
                  "policy |", "|---|---|---|---|---|---|---|"]
        for pol, c in cap.items():
            if c["mean"] is None:
                low = min(c["points"], key=lambda q: q["offered_rate"] or math.inf, default=None)
                lines.append(f"| {pol} | none found | - | lowest load tried: {_f(low and low['offered_rate'])} "
                             f"({_f(low and low['time_scale'], 3)}), failed | p95 TTFT there: "
                             f"{_iv(low and low.get('ttft_p95_ci'))} | {', '.join(low['causes']) if low else '-'} "
                             "| - |")
                continue
            per = ", ".join(f"{_f(x['offered_rate'])} ({_f(x['time_scale'], 3)})" for x in c["searches"])
            ratio = cont / c["mean"] if cont and c["mean"] else None
            note = "" if c["bounded"] else " (lower bound)"
            ttft = "; ".join(_iv(x["ttft_p95_ci"]) for x in c["searches"])
            broke = "; ".join(", ".join(x["lost_because"]) or "-" for x in c["searches"])
            lines.append(f"| {pol} | {_f(c['mean'])} ± {_f(c['std'])}{note} | {_f(c['completed_mean'])} | {per} "
                         f"| {ttft} | {broke} | {_f(ratio)}x |")
        lines.append("")
    if rows:
        lines += ["Sweep (each point a sustained window; p95 with its 95% interval):", "",
                  "| policy | time scale | offered (req/s) | completed (req/s) | sustained | output tok/s "
                  "| p95 TTFT [CI] (s) | p95 ITL [CI] (s) | queue growth | unfinished | failed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            sus = {True: "yes", False: "no", None: "-"}[r["sustained"]]
            lines.append(f"| {r['policy']} | {r['time_scale']:g} | {_f(r['offered_rate'])} "
                         f"| {_f(r['completed_rate'])} | {sus} | {_f(r['output_throughput'], 1)} "
                         f"| {_iv(r['ttft_p95_ci'])} | {_iv(r['itl_p95_ci'])} | {_f(r['queue_growth'], 1)} "
                         f"| {r['unfinished']} | {r['failed']} |")
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
    # Without a sweep, the capacity searches' own points (holds included) draw the curves.
    source = "sweep over time scales" if report["sweep"] else "capacity-search points"
    curve = report["sweep"] or [{"policy": pol, **pt} for pol, c in report["capacity"].items() for pt in c["points"]]
    pols = list(dict.fromkeys([r["policy"] for r in curve] + list(report["capacity"])))
    for pol in pols:
        rs = sorted([r for r in curve if r["policy"] == pol], key=lambda r: r["offered_rate"] or 0)
        c = colors.get(pol)
        x = [r["offered_rate"] for r in rs]
        for ax, key in ((a1, "ttft_p95"), (a2, "itl_p95")):
            ax.plot(x, [r[key] if r[key] is not None else math.nan for r in rs], marker="o", color=c, label=pol)
            held = [r for r in rs if r.get("held")]
            ax.plot([r["offered_rate"] for r in held], [r[key] or math.nan for r in held], "s", ms=9, mfc="none",
                    color=c, label=f"{pol}: held {report['workload'].get('hold_duration', 0):g} s" if held else None)
            for r in rs:
                if r["unfinished"] or r["failed"]:
                    ax.annotate(f"{r['unfinished'] or r['failed']} unfinished", (r["offered_rate"], r[key] or 0),
                                fontsize=7, color=c, textcoords="offset points", xytext=(4, -10))
        a3.plot([r["offered_rate"] for r in rs], [r["output_throughput"] or math.nan for r in rs], marker="o", color=c,
                label=pol)
    for ax, key, name in ((a1, "ttft_p95", "p95 TTFT (s)"), (a2, "itl_p95", "p95 ITL (s)")):
        target = _slo_seconds(report["slo"].get(key))
        if target:
            ax.axhline(target, color="black", ls="--", lw=1, label=f"SLO {target:g} s")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xlabel("offered in the window (req/s)")
        ax.set_ylabel(name)
        ax.set_title(f"{name} vs offered load ({source})")
        ax.legend(loc="upper left")
    a3.set_xscale("log")
    offered = sorted({round(r["offered_rate"], 1) for r in curve if r["offered_rate"]})
    ticks = []
    for v in offered:  # ticks at least 10 % apart stay readable
        if not ticks or v >= ticks[-1] * 1.1:
            ticks.append(v)
    offered = ticks
    a3.set_xticks(offered, [f"{v:g}" for v in offered], fontsize=7)
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
    for p in (p for p in pols if p in cap and cap[p]["mean"] is None):  # a bar of nothing, said in words
        low = min((q["offered_rate"] for q in cap[p]["points"] if q["offered_rate"]), default=None)
        a4.bar([p], [0], color=colors.get(p))
        a4.annotate(f"none: failed down to\n{low:.2g} req/s" if low else "none", (p, 0), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    for i, p in enumerate(names):
        offered = [x["offered_rate"] for x in cap[p]["searches"] if x["offered_rate"] is not None]
        done = [x["completed_rate"] for x in cap[p]["searches"] if x["completed_rate"] is not None]
        a4.plot([i - 0.1] * len(offered), offered, "k.", ms=6, label="each search: offered" if i == 0 else None)
        a4.plot([i + 0.1] * len(done), done, "kx", ms=6, label="each search: completed" if i == 0 else None)
        a4.annotate(("" if cap[p]["bounded"] else ">=") + f"{cap[p]['mean']:.2f}", (i, cap[p]["max"]),
                    textcoords="offset points", xytext=(0, 6), ha="center")
    if names:
        a4.set_ylim(0, max(cap[p]["max"] for p in names) * 1.35)
    a4.set_ylabel("operating limit (req/s offered)")
    a4.set_title("sustained operating limit: mean, min–max and each search")
    a4.legend(loc="upper right")
    w = report["workload"]
    fig.suptitle(f"inflight batching policies, Azure conv trace (lengths x{w['length_scale']:g}, caps "
                 f"{w['max_input_len']}/{w['max_output_len']}, {w['duration']:g} s windows of >= "
                 f"{w['num_prompts']} requests), "
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
        runs = (old or {}).get("runs") or load_json(out / "runs.json") or []
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
                    # A run stopped between rounds still reports what it measured (--report-only).
                    (out / "runs.json").write_text(json.dumps(runs, indent=1))
        runs.append({"label": "end", "total_wall_s": round(time.monotonic() - t0, 1), **machine_state()})
    report = build_report(args, out, policies, runs)
    if args.report_only and old and old.get("driver"):
        report["driver"] = old["driver"]
    table = write_outputs(report, out)
    print("\n" + table)
    print(f"written: {out}/policies.json, policies.csv, policies.png, table.md (+ sweep-*, capacity-*-r* JSON)")
    return 0 if all(r.get("exit", 0) == 0 for r in runs) else 1


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        sys.exit(130)
