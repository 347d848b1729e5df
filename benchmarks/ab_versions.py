"""Two checkouts of inflight side by side: serving and offline figures, interleaved.

For a change that must not move performance (a restructuring, a refactor), run the same
measurements on checkout A and checkout B in turns, the order alternating per repeat, so
host drift lands on both:

- **serving**: a fresh ``inflight serve`` from each checkout (default flags, bundled model),
  measured by one fixed client (``inflight bench serve`` from ``--client-root``, so the
  instrument does not change with the code under test) at each ``--concurrency``: random
  prompts, ``--input-len`` in / ``--output-len`` out, ignore_eos; output tok/s, median TTFT
  and median ITL from the vLLM-style result JSON, and the CPU seconds the server spent on
  all of them (less sensitive to the host's moment than wall-clock figures);
- **offline**: ``LLM.generate`` of ``--offline-requests`` requests of the same lengths in a
  process of its own; output tok/s.

Each checkout runs with ``PYTHONPATH=<root>``, from ``<root>`` as its working directory, and
this repository's virtual environment. (The working directory matters: ``python -m`` puts
it ahead of ``PYTHONPATH``, so run from this checkout both sides imported this checkout's
code; the comparison of 2026-12-04 03:00 in docs/performance.md measured the after side
twice.)

    .venv/bin/python benchmarks/ab_versions.py --a /tmp/old --b . --repeats 3

Prints one line per measurement and a summary: per figure, A and B medians and the median
of the per-repeat B/A ratios with their min..max.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from _runs import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python")
OFFLINE = """
import sys, time
from inflight import LLM, SamplingParams
n, inp, out = (int(a) for a in sys.argv[1:4])
llm = LLM()
prompts = [[100 + (i * 7 + j) % 20000 for j in range(inp)] for i in range(n)]
params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
t = time.perf_counter()
res = llm.generate(prompts, params, use_tqdm=False)
dt = time.perf_counter() - t
print(sum(len(r.outputs[0].token_ids) for r in res) / dt)
"""


def _env(root: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(pathlib.Path(root).resolve())}


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not healthy")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serving(root: str, args: argparse.Namespace, out_dir: pathlib.Path) -> dict[str, float]:
    """Starts a server from ``root``, runs the fixed client at each concurrency, stops it."""
    port = free_port()
    log = open(out_dir / f"server-{port}.log", "wb")
    proc = subprocess.Popen([PYTHON, "-m", "inflight.cli", "serve", "--port", str(port)],
                            env=_env(root), cwd=root, stdout=log, stderr=subprocess.STDOUT)
    figures: dict[str, float] = {}
    try:
        _wait_healthy(port, proc)
        cpu_at_start = _cpu_seconds(proc.pid)
        for c in args.concurrency:
            result = out_dir / f"serve-{port}-{c}.json"
            subprocess.run([PYTHON, "-m", "inflight.cli", "bench", "serve",
                            "--base-url", f"http://127.0.0.1:{port}", "--dataset", "random",
                            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--ignore-eos", "--max-concurrency", str(c),
                            "--num-prompts", str(max(args.min_prompts, 4 * c)),
                            "--save-result", str(result)],
                           env=_env(args.client_root), cwd=args.client_root, check=True,
                           capture_output=True)
            r = json.loads(result.read_text())
            figures[f"c{c} output tok/s"] = r["output_throughput"]
            figures[f"c{c} TTFT p50 ms"] = r["median_ttft_ms"]
            figures[f"c{c} ITL p50 ms"] = r["median_itl_ms"]
        # The server's CPU for the fixed workload: wall-clock figures move with the host's
        # moment, the work done for the same requests much less.
        figures["server CPU s"] = _cpu_seconds(proc.pid) - cpu_at_start
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return figures


def offline(root: str, args: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run([PYTHON, "-c", OFFLINE, str(args.offline_requests), str(args.input_len),
                          str(args.output_len)], env=_env(root), cwd=root, check=True,
                         capture_output=True, text=True)
    return {"offline output tok/s": float(out.stdout.strip().splitlines()[-1])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="checkout A (the before)")
    p.add_argument("--b", required=True, help="checkout B (the after)")
    p.add_argument("--client-root", default=None, help="checkout whose bench client measures both (default A)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--offline-requests", type=int, default=32, help="0: no offline figure")
    args = p.parse_args()
    args.client_root = args.client_root or args.a
    rows: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for label in (("A", "B") if rep % 2 == 0 else ("B", "A")):
                root = args.a if label == "A" else args.b
                figs = serving(root, args, pathlib.Path(tmp))
                if args.offline_requests:
                    figs.update(offline(root, args))
                load = os.getloadavg()[0]
                for k, v in figs.items():
                    rows[label].setdefault(k, []).append(v)
                print(f"repeat {rep} {label}: load {load:.2f} "
                      + ", ".join(f"{k} {v:.1f}" for k, v in figs.items()), flush=True)
    print("\nfigure | A median | B median | B/A per repeat: median (min..max)")
    for k in rows["A"]:
        a, b = rows["A"][k], rows["B"][k]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"{k} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    sys.exit(main())
