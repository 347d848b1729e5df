"""Speculative decoding against plain decoding, side by side, interleaved and repeated (issue 31).

Two servers of the same build, one at a time on 127.0.0.1 (never both: on a 2-core host
they would share the cores):

- **plain**: ``inflight serve --host 127.0.0.1 --port P`` (default flags);
- **spec**: the same plus ``--speculative-config '{"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'``
  (prompt-lookup drafting, K from ``--k``, default 4).

Each repeat starts each server once, the order alternating per repeat (plain, spec | spec,
plain | ...) so a drifting host lands on both, and measures with ``inflight bench serve``
(closed loop: ``--max-concurrency`` streams, each sending its next request when the last
ends; greedy) at each ``--concurrency`` on two workloads:

- **copy**: copy-heavy chat prompts through ``/v1/chat/completions`` ("repeat this text
  exactly", "rewrite this paragraph with one word changed", "rename one function in this
  code", "repeat these CSV rows": ``_spec_workloads.copy_prompts``, from the sonnet text
  and Azure trace rows in ``../shared/data``), ``max_tokens`` ``--copy-max-tokens``,
  stopping at EOS (``ignore_eos`` off): where prompt lookup finds its drafts;
- **conv**: the Azure LLM 2023 conversation trace (``azure_llm_2023_conv_1815-1900.csv``,
  rows shuffled with a fixed seed): prompts of the trace's lengths cut from the sonnet text
  (``inflight.bench.datasets.build_trace``) through ``/v1/completions``, outputs of the
  trace's lengths (``ignore_eos``), lengths times ``--conv-length-scale`` and capped by
  ``--conv-max-input-len`` / ``--conv-max-output-len``: what speculation must not slow.

Per point: output tokens/s (all streams; decode tok/s), TTFT p50, ITL p50 (the gap between
streamed chunks: with speculation one chunk may carry several tokens), TPOT p50; the spec
server's acceptance rate, mean acceptance length and accepted share per draft position
(``GET /stats`` ``spec_decode``, else ``*spec_decode_*`` counters in ``GET /metrics``,
scraped before and after; absent when the server reports neither); the 1-minute load
average before and after and the CPU other processes took (cores' worth). Greedy outputs of
the two servers should be the same text; the count of identical outputs is printed as a
check (batched float sums may legitimately differ in a late token at high concurrency).

The summary gives, per workload and concurrency, min/median/max of each figure over the
repeats and the ratio of medians spec/plain, and checks the goals of issue 31:

- copy-heavy, 1 stream: output tok/s spec/plain >= 1.5;
- conversation mix, 1 stream: >= 1.0;
- 32 streams (every workload): >= 0.97.

``--capacity`` also runs ``inflight bench capacity`` (the highest request rate meeting the
SLOs, ``--capacity-slo``) on the conversation mix against each server and prints the two
operating limits side by side (off by default: it takes many minutes per server).

    .venv/bin/python benchmarks/speculative.py --repeats 3 --concurrency 1 32 --out spec.json
    .venv/bin/python benchmarks/speculative.py --repeats 1 --concurrency 1 --num-prompts 4 \\
        --copy-max-tokens 32 --conv-max-output-len 32 --out /tmp/spec-smoke.json   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _runs import REPO, free_port, run_bounded, stop_on_signals
from _spec_workloads import RunNoise, spec_counters, spec_delta, wait_quiet, write_copy_jsonl

from inflight.bench.datasets import AZURE_CONV_FILE, default_data_dir
from inflight.bench.server_proc import ServerProcess

INFLIGHT = str(REPO / ".venv" / "bin" / "inflight")
FIGURES = (("output_tok_s", "tok/s", True), ("ttft_p50_ms", "TTFT p50 ms", False),
           ("itl_p50_ms", "ITL p50 ms", False), ("tpot_p50_ms", "TPOT p50 ms", False))
GOALS = (("copy", 1, 1.5), ("conv", 1, 1.0), ("copy", 32, 0.97), ("conv", 32, 0.97))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--spec-config", default=None, help="full --speculative-config JSON (overrides --k)")
    p.add_argument("--serve-args", default="", help="extra flags for both servers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--workloads", nargs="+", default=["copy", "conv"], choices=["copy", "conv"])
    p.add_argument("--num-prompts", type=int, default=16, help="requests per point, at least")
    p.add_argument("--prompts-per-stream", type=int, default=2, help="requests per point: at least this x streams")
    p.add_argument("--warmups-per-stream", type=int, default=1, help="uncounted requests first, x streams")
    p.add_argument("--copy-max-tokens", type=int, default=160)
    p.add_argument("--conv-length-scale", type=float, default=1.0)
    p.add_argument("--conv-max-input-len", type=int, default=1024)
    p.add_argument("--conv-max-output-len", type=int, default=256)
    p.add_argument("--data-dir", default=str(default_data_dir()))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-load", type=float, default=0.0,
                   help="before each server, wait (up to --quiet-wait s) for the 1-min load average to fall to this")
    p.add_argument("--quiet-wait", type=float, default=120.0)
    p.add_argument("--point-timeout", type=float, default=1800.0, help="s per bench run")
    p.add_argument("--capacity", action="store_true", help="also the operating limit of each server (slow)")
    p.add_argument("--capacity-slo", default="ttft_p95=2,itl_p95=1")
    p.add_argument("--capacity-duration", type=float, default=30.0, help="s per search window")
    p.add_argument("--capacity-args", default="", help="extra `bench capacity` flags, e.g. '--max-points 4'")
    p.add_argument("--capacity-timeout", type=float, default=5400.0)
    p.add_argument("--log-dir", default=None, help="server logs and bench results (default: a temp dir)")
    p.add_argument("--out", default=None, help="write every run and the summary as JSON here")
    return p.parse_args(argv)


def spec_config(args: argparse.Namespace) -> str:
    return args.spec_config or json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2})


def serve_command(args: argparse.Namespace, variant: str, port: int) -> str:
    cmd = f"{INFLIGHT} serve --host 127.0.0.1 --port {port} {args.serve_args}".rstrip()
    return cmd + (f" --speculative-config {shlex.quote(spec_config(args))}" if variant == "spec" else "")


def workload_flags(args: argparse.Namespace, workload: str, copy_file: pathlib.Path) -> list[str]:
    """``inflight bench serve`` flags of a workload (shared with ``--capacity``)."""
    if workload == "copy":
        return ["--dataset", "chat", "--chat-file", str(copy_file), "--endpoint-type", "chat",
                "--output-len", str(args.copy_max_tokens), "--no-ignore-eos"]
    return ["--dataset", "trace", "--trace-file", AZURE_CONV_FILE, "--shuffle", "--endpoint-type", "completions",
            "--length-scale", str(args.conv_length_scale), "--max-input-len", str(args.conv_max_input_len),
            "--max-output-len", str(args.conv_max_output_len), "--ignore-eos"]


def bench_point(args: argparse.Namespace, base_url: str, workload: str, streams: int,
                copy_file: pathlib.Path, out_json: pathlib.Path) -> dict:
    """One ``inflight bench serve`` run; returns its result document. Raises RuntimeError
    when the bench fails."""
    n = max(args.num_prompts, args.prompts_per_stream * streams)
    cmd = [INFLIGHT, "--log-level", "warning", "bench", "serve", "--base-url", base_url,
           *workload_flags(args, workload, copy_file), "--data-dir", args.data_dir,
           "--temperature", "0", "--max-concurrency", str(streams), "--request-rate", "inf",
           "--num-prompts", str(n), "--num-warmups", str(args.warmups_per_stream * streams),
           "--seed", str(args.seed), "--reset-prefix-cache", "--no-metrics", "--disable-tqdm",
           "--save-result", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout, cwd=REPO)
    if proc.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"bench failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(out_json.read_text())


def _ms(stat: dict | None, key: str = "median") -> float | None:
    v = (stat or {}).get(key)
    return None if v is None else 1e3 * v


def point_figures(doc: dict) -> dict:
    """The figures of one bench result, plus the generated texts in request order (for the
    plain/spec identity check; not saved)."""
    s = doc["summary"]
    texts = [r.get("generated_text", "") for r in sorted(doc.get("requests", []), key=lambda r: r["index"])
             if r.get("phase") == "sample"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50_ms": _ms(s["ttft"]), "itl_p50_ms": _ms(s["itl"]),
            "tpot_p50_ms": _ms(s["tpot"]), "completed": s["completed"], "failed": s["failed"],
            "output_tokens": s["total_output_tokens"], "duration_s": s["duration"], "_texts": texts}


async def run_server(args: argparse.Namespace, variant: str, rep: int, copy_file: pathlib.Path,
                     log_dir: pathlib.Path) -> dict:
    """Starts one server, measures every workload and concurrency on it, stops it."""
    load_wait = wait_quiet(args.quiet_load, args.quiet_wait)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(args, variant, port)
    server = ServerProcess(cmd, base, start_timeout=600, log_path=str(log_dir / f"server-{variant}-{rep}.log"))
    points: dict[str, dict] = {}
    async with server:
        pid = server.proc.pid if server.proc else None
        for workload in args.workloads:
            for c in args.concurrency:
                before, noise = spec_counters(base), RunNoise(pid)
                out_json = log_dir / f"bench-{variant}-{rep}-{workload}-c{c}.json"
                try:
                    doc = await asyncio.to_thread(bench_point, args, base, workload, c, copy_file, out_json)
                    fig = point_figures(doc)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    fig = {"error": str(e)[-2000:]}
                fig.update(noise.stop(), spec=spec_delta(before, spec_counters(base)))
                points[f"{workload} c{c}"] = fig
                print(point_line(variant, rep, workload, c, fig), flush=True)
    return {"variant": variant, "repeat": rep, "command": cmd, "loadavg1_at_start": load_wait, "points": points,
            "server_log": server.log_path}


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def point_line(variant: str, rep: int, workload: str, c: int, f: dict) -> str:
    head = f"  rep {rep} {variant:5s} {workload:4s} c{c:<3d}"
    if "error" in f:
        return f"{head} FAILED: {f['error'].strip().splitlines()[0] if f['error'].strip() else '?'}"
    line = (f"{head} {_f(f['output_tok_s']):>7s} tok/s  TTFT p50 {_f(f['ttft_p50_ms']):>7s} ms  "
            f"ITL p50 {_f(f['itl_p50_ms']):>6s} ms  {f['output_tokens']} tok  "
            f"load {f['loadavg1_before']:.2f}->{f['loadavg1_after']:.2f}")
    if "others_cores" in f:
        line += f" others {f['others_cores']:.2f} cores"
    sd = f.get("spec")
    if sd and sd.get("acceptance_rate") is not None:
        line += (f"  accept {sd['acceptance_rate']:.2f}, {sd['mean_acceptance_length']:.2f} tok/verify, per pos "
                 + "/".join(f"{x:.2f}" for x in sd["accepted_per_position"]))
    return line


def identical_outputs(runs: list[dict], key: str) -> tuple[int, int]:
    """(identical, compared) generated texts between the plain and spec run of each repeat."""
    same = total = 0
    for rep in {r["repeat"] for r in runs}:
        by = {r["variant"]: r["points"].get(key, {}) for r in runs if r["repeat"] == rep}
        a, b = by.get("plain", {}).get("_texts"), by.get("spec", {}).get("_texts")
        if a and b:
            same += sum(x == y for x, y in zip(a, b))
            total += min(len(a), len(b))
    return same, total


def _values(runs: list[dict], variant: str, key: str, fig: str) -> list[float]:
    return [r["points"][key][fig] for r in runs if r["variant"] == variant and key in r["points"]
            and r["points"][key].get(fig) is not None]


def summarize(runs: list[dict], args: argparse.Namespace) -> dict:
    """Per workload and concurrency: min/median/max per figure and variant, ratio of
    medians spec/plain, median acceptance, identical outputs; and the goals."""
    out: dict[str, dict] = {}
    for workload in args.workloads:
        for c in args.concurrency:
            key = f"{workload} c{c}"
            row: dict = {}
            for fig, _, _ in FIGURES:
                cell: dict[str, Any] = {}
                for v in ("plain", "spec"):
                    vals = _values(runs, v, key, fig)
                    cell[v] = ({"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}
                               if vals else None)
                if cell["plain"] and cell["spec"] and cell["plain"]["median"]:
                    cell["ratio_of_medians"] = cell["spec"]["median"] / cell["plain"]["median"]
                row[fig] = cell
            acc = [r["points"][key]["spec"]["acceptance_rate"] for r in runs if r["variant"] == "spec"
                   and (r["points"].get(key, {}).get("spec") or {}).get("acceptance_rate") is not None]
            row["acceptance_rate_median"] = statistics.median(acc) if acc else None
            row["identical_outputs"] = identical_outputs(runs, key)
            out[key] = row
    goals = []
    for workload, c, target in GOALS:
        ratio = out.get(f"{workload} c{c}", {}).get("output_tok_s", {}).get("ratio_of_medians")
        goals.append({"workload": workload, "concurrency": c, "target": target, "ratio": ratio,
                      "met": None if ratio is None else ratio >= target})
    return {"points": out, "goals": goals}


def table(summary: dict) -> str:
    lines = ["", "figure: plain min/median/max | spec min/median/max | spec/plain (ratio of medians)"]
    for key, row in summary["points"].items():
        same, total = row["identical_outputs"]
        acc = row["acceptance_rate_median"]
        lines.append(f"\n{key}  (acceptance median {_f(acc, '.2f')}; identical greedy outputs {same}/{total})")
        for fig, label, _ in FIGURES:
            cell = row[fig]
            mmm = ["/".join(_f(cell[v][k]) for k in ("min", "median", "max")) if cell[v] else "-"
                   for v in ("plain", "spec")]
            lines.append(f"  {label:12s} {mmm[0]:>24s} | {mmm[1]:>24s} | {_f(cell.get('ratio_of_medians'), '.3f')}x")
    lines.append("\ngoals (issue 31), output tok/s spec/plain:")
    for g in summary["goals"]:
        state = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        lines.append(f"  {g['workload']:4s} {g['concurrency']:>2d} stream(s): {_f(g['ratio'], '.3f')}x "
                     f"(goal >= {g['target']}) {state}")
    return "\n".join(lines)


def capacity(args: argparse.Namespace, log_dir: pathlib.Path, copy_file: pathlib.Path) -> list[dict]:
    """``inflight bench capacity`` on the conversation mix against each server in turn (each
    started and stopped by the bench); returns the limits (req/s)."""
    rows = []
    for variant in ("plain", "spec"):
        out = log_dir / f"capacity-{variant}.json"
        cmd = [INFLIGHT, "--log-level", "warning", "bench", "capacity", "--serve-cmd",
               serve_command(args, variant, port := free_port()), "--base-url", f"http://127.0.0.1:{port}",
               *workload_flags(args, "conv", copy_file), "--data-dir", args.data_dir, "--slo", args.capacity_slo,
               "--duration", str(args.capacity_duration), "--disable-tqdm", "--save-result", str(out),
               *shlex.split(args.capacity_args)]
        info = run_bounded(cmd, log_dir / f"capacity-{variant}.log", args.capacity_timeout, tail=600)
        res = json.loads(out.read_text())["results"][0] if out.exists() else {}
        rows.append({"variant": variant, "limit_req_s": (res.get("limits") or [None])[0],
                     "failed_above": (res.get("failed_above") or [None])[0], **info})
    plain, spec = rows[0]["limit_req_s"], rows[1]["limit_req_s"]
    print(f"\noperating limit, conversation mix, SLO {args.capacity_slo}: plain {_f(plain, '.3f')} req/s, "
          f"spec {_f(spec, '.3f')} req/s" + (f", spec/plain {spec / plain:.3f}x" if plain and spec else ""))
    return rows


def _strip_texts(runs: list[dict]) -> list[dict]:
    return [{**r, "points": {k: {f: v for f, v in p.items() if f != "_texts"} for k, p in r["points"].items()}}
            for r in runs]


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="spec-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    needed = max(args.num_prompts, args.prompts_per_stream * max(args.concurrency)) \
        + args.warmups_per_stream * max(args.concurrency)
    copy_file = write_copy_jsonl(log_dir / "copy_prompts.jsonl", pathlib.Path(args.data_dir), needed, args.seed)
    print(f"speculative config {spec_config(args)}; {args.repeats} repeats x {args.workloads} x streams "
          f"{args.concurrency}; logs in {log_dir}", flush=True)
    runs, t0 = [], time.monotonic()
    for rep in range(args.repeats):
        for variant in (("plain", "spec") if rep % 2 == 0 else ("spec", "plain")):
            try:
                runs.append(await run_server(args, variant, rep, copy_file, log_dir))
            except RuntimeError as e:  # a server that fails to start is a result, not the end
                print(f"  rep {rep} {variant}: server failed: {str(e).splitlines()[0]}", flush=True)
                runs.append({"variant": variant, "repeat": rep, "points": {}, "error": str(e)})
    summary = summarize(runs, args)
    if runs:
        print(table(summary))
    print(f"\nwall {(time.monotonic() - t0) / 60:.1f} min, 1-min load average now {os.getloadavg()[0]:.2f}")
    doc = {"args": vars(args), "speculative_config": spec_config(args), "runs": _strip_texts(runs),
           "summary": summary}
    if args.capacity:
        doc["capacity"] = capacity(args, log_dir, copy_file)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(asyncio.run(main()))
