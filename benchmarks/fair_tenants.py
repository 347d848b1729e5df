"""A light tenant at its fair share beside a heavy one at 3x its share (issue 35).

Two tenants share one `inflight serve` (named API keys): ``light`` sends at half the
default server's operating limit L (its fair share of two), ``heavy`` at 1.5 L (three times
its share), both Poisson, the limit_validation.py workload, two `inflight bench serve`
clients at once. Reported: the light tenant's p95 TTFT, goodput and refusals, against the
same light load alone, under ``fcfs`` and ``fair`` (Virtual Token Counter), and under
``fair`` with the heavy tenant at its share (``fair-share``: the server at its limit with no
excess, what isolation from the excess can reach on a machine whose step time grows with
every row); ``fair-capped`` adds a per-tenant concurrency limit. Each setup gets a fresh
server, started and stopped here; traffic goes to 127.0.0.1 only, every command is bounded.

    .venv/bin/python benchmarks/fair_tenants.py                      # ~11 min
    .venv/bin/python benchmarks/fair_tenants.py --setups alone,fair --duration 60
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _runs import REPO, stop_on_signals  # noqa: E402  (sibling benchmark module)
from inflight.bench.machine import describe_machine  # noqa: E402
from limit_validation import WORKLOADS, _f  # noqa: E402

KEYS = {"light": "sk-light", "heavy": "sk-heavy"}
# setup -> (server flags, tenants sending, heavy's rate in fair shares: None = --heavy-share)
SETUPS = {
    "alone": ("", ("light",), None),
    "fcfs": ("", ("light", "heavy"), None),
    "fair": ("--scheduling-policy fair", ("light", "heavy"), None),
    # heavy at its share: the server at its limit with no excess to isolate the light
    # tenant from (at the limit p95 TTFT is near the SLO by definition, so a noisy reference)
    "fair-share": ("--scheduling-policy fair", ("light", "heavy"), 1.0),
    "fair-capped": ("--scheduling-policy fair --tenant-max-concurrent-requests {cap}", ("light", "heavy"), None),
}
DEFAULT_SETUPS = "alone,fcfs,fair"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--limit", type=float, default=6.14, help="req/s: L, the default server's limit")
    p.add_argument("--heavy-share", type=float, default=3.0, help="heavy's rate, x its fair share L/2")
    p.add_argument("--cap", type=int, default=16, help="fair-capped: requests in flight per tenant")
    p.add_argument("--setups", default=DEFAULT_SETUPS, help=f"of {', '.join(SETUPS)}")
    p.add_argument("--server-args", default="", help="more flags for every setup's `inflight serve`")
    p.add_argument("--duration", type=float, default=120.0, help="s: the light client's window")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="azure-conv")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "fair_tenants"))
    p.add_argument("--inflight", default=str(pathlib.Path(sys.executable).parent / "inflight"))
    p.add_argument("--port", type=int, default=8478)
    p.add_argument("--keep-requests", action="store_true", help="keep each request's record in the results")
    return p.parse_args(argv)


def start_server(args, flags: str, log: pathlib.Path) -> subprocess.Popen:
    keys = [f"--api-key={t}={k}" for t, k in KEYS.items()]
    cmd = [args.inflight, "serve", "--port", str(args.port), *keys, *shlex.split(flags)]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in 180 s")


def client_cmd(args, tenant: str, rate: float, duration: float, result: pathlib.Path) -> list[str]:
    flags, _ = WORKLOADS[args.workload]
    return [args.inflight, "--log-level", "warning", "bench", "serve", "--base-url",
            f"http://127.0.0.1:{args.port}", "--api-key", KEYS[tenant], *shlex.split(flags),
            "--slo", "ttft=2,itl=1", "--disable-tqdm", "--request-rate", f"{rate:.6g}",
            "--duration", str(duration), "--seed", "11" if tenant == "light" else "12",
            "--save-result", str(result)]


def summary(path: pathlib.Path, keep_requests: bool = False) -> dict:
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    if not keep_requests:
        doc.pop("requests", None)
        path.write_text(json.dumps(doc, default=str))
    s = doc.get("summary", doc)
    return {k: s.get(k) for k in ("completed", "failed", "goodput", "good_requests", "request_throughput")} | {
        "ttft_p50": (s.get("ttft") or {}).get("median"), "ttft_p95": (s.get("ttft") or {}).get("p95"),
        "itl_p95": (s.get("itl") or {}).get("p95"), "errors": s.get("errors")}


def run_setup(args, name: str, out: pathlib.Path) -> dict:
    flags, tenants, heavy_share = SETUPS[name]
    flags = f"{flags.format(cap=args.cap)} {args.server_args}".strip()
    server = start_server(args, flags, out / f"{name}-server.log")
    before = describe_machine().get("loadavg")
    light_rate = args.limit / 2
    rates = {"light": light_rate, "heavy": light_rate * (heavy_share or args.heavy_share)}
    procs = {}
    try:
        for t in tenants:  # heavy's window covers light's warm-up to drain
            duration = args.duration if t == "light" else args.duration * 1.3
            cmd = client_cmd(args, t, rates[t], duration, out / f"{name}-{t}.json")
            print("$", shlex.join(cmd), flush=True)
            procs[t] = subprocess.Popen(cmd, stdout=open(out / f"{name}-{t}.log", "w"),
                                        stderr=subprocess.STDOUT, cwd=REPO)
        for p in procs.values():
            p.wait(timeout=args.duration * 4 + 300)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        server.terminate()
        server.wait(60)
    return {"setup": name, "server_flags": flags, "rates": {t: rates[t] for t in tenants},
            "loadavg_before": before, "loadavg_after": describe_machine().get("loadavg"),
            **{t: summary(out / f"{name}-{t}.json", args.keep_requests) for t in tenants}}


def table(rows: list[dict]) -> str:
    def light_p95(setup: str) -> float | None:
        return next((r["light"].get("ttft_p95") for r in rows if r["setup"] == setup), None)

    def ratio(p95: float | None, ref: float | None) -> str:
        return f"{p95 / ref:.2f}" if p95 and ref else "-"

    alone, share = light_p95("alone"), light_p95("fair-share")
    lines = ["| setup | light req/s | heavy req/s | light p95 TTFT s | x alone | x fair-share | light p50 TTFT s "
             "| light goodput | light completed / refused | heavy completed / refused | load average |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lt, hv = r.get("light") or {}, r.get("heavy") or {}
        p95 = lt.get("ttft_p95")
        flags = f" (`{r['server_flags']}`)" if r.get("server_flags") else ""
        lines.append(f"| {r['setup']}{flags} | {r['rates'].get('light', 0):.2f} | {r['rates'].get('heavy', 0):.2f} | {_f(p95)} "
                     f"| {ratio(p95, alone)} | {ratio(p95, share)} | {_f(lt.get('ttft_p50'))} | {_f(lt.get('goodput'))} | {lt.get('completed', '-')} / "
                     f"{lt.get('failed', '-')} | {hv.get('completed', '-')} / {hv.get('failed', '-')} "
                     f"| {(r.get('loadavg_after') or ['-'])[0]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.setups.split(","):
        rows.append(run_setup(args, name, out))
        (out / "summary.json").write_text(json.dumps({"limit": args.limit, "rows": rows}, indent=1, default=str))
        (out / "table.md").write_text(table(rows))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
