"""What the server adds to a decode step at low concurrency (issue 17: client ITL p50 within
10 % of the engine's own step time for the same batch).

Three figures for the same engine flags and load (``--streams`` closed-loop streams,
``--input-len`` prompt tokens, ``--output-len`` tokens out, ignore_eos, greedy), taken in
alternation over ``--cycles``:

- **engine step**: offline, in this process, ``Engine.step()`` wall time of pure decode
  steps with ``--streams`` requests running (the median);
- **engine iteration in the server**: from ``inflight serve --step-log``, the time between
  consecutive decode steps' publications (the engine thread's whole loop: commands, step,
  delivery, metrics) while the HTTP server and the client run on the same cores;
- **client ITL**: ``inflight bench serve``'s median gap between streamed tokens.

    .venv/bin/python benchmarks/serving_overhead.py --streams 1 --cycles 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def offline_step_ms(flags: list[str], streams: int, input_len: int, output_len: int) -> float:
    """Median ms of pure decode steps with ``streams`` running, in a fresh interpreter (the
    server's own thread setup is not shared with this process)."""
    code = f"""
import argparse, json, statistics, time
from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.sampling_params import SamplingParams
p = argparse.ArgumentParser(); EngineConfig.add_cli_args(p)
engine = Engine(EngineConfig.from_cli_args(p.parse_args({flags!r})))
sp = SamplingParams(temperature=0, max_tokens={output_len}, ignore_eos=True)
times = []
for rep in range(2):
    for i in range({streams}):
        engine.add_request(f"{{rep}}-{{i}}", [1000 + 7 * i + j for j in range({input_len})], sp)
    while engine.has_unfinished_requests():
        t = time.perf_counter(); engine.step(); dt = time.perf_counter() - t
        plan = engine.last_plan
        if rep and plan is not None and all(len(r.token_ids) == 1 for r in plan.scheduled) \\
                and len(plan.scheduled) == {streams}:
            times.append(dt)
print(json.dumps(statistics.median(times) * 1e3))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(flags: list[str], streams: int, input_len: int, output_len: int, requests: int,
           workdir: pathlib.Path) -> tuple[float, float]:
    """(server engine-iteration median ms, client ITL median ms) for one server run."""
    from inflight.sim.steplog import read_step_logs

    port = free_port()
    log = workdir / f"steps-{port}.jsonl"
    result = workdir / f"bench-{port}.json"
    serve = (f"{REPO / '.venv/bin/inflight'} serve --host 127.0.0.1 --port {port} "
             f"--step-log {log} " + " ".join(flags))
    cmd = [str(REPO / ".venv/bin/inflight"), "bench", "serve", "--serve-cmd", serve,
           "--base-url", f"http://127.0.0.1:{port}", "--dataset", "random",
           "--input-len", str(input_len), "--output-len", str(output_len), "--range-ratio", "0",
           "--ignore-eos", "--temperature", "0", "--max-concurrency", str(streams),
           "--request-rate", "inf", "--num-prompts", str(requests), "--num-warmups",
           str(streams), "--no-metrics", "--disable-tqdm", "--save-result", str(result)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    with open(result) as f:
        itl = json.load(f)["summary"]["itl"]["median"] * 1e3
    _, shapes, seconds = read_step_logs([log])
    decode = [s for shape, s in zip(shapes, seconds)
              if shape.rows == streams and shape.tokens == streams]
    return statistics.median(decode) * 1e3, itl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--flags", default="", help="engine flags for both, e.g. '--dtype bfloat16'")
    args = p.parse_args()
    flags = args.flags.split()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cycle in range(args.cycles):
            load = os.getloadavg()[0]
            step = offline_step_ms(flags, args.streams, args.input_len, args.output_len)
            iteration, itl = served(flags, args.streams, args.input_len, args.output_len,
                                    args.requests, pathlib.Path(tmp))
            rows.append((step, iteration, itl))
            print(f"cycle {cycle + 1} (load average {load:.2f} before): engine step "
                  f"{step:.2f} ms, server iteration {iteration:.2f} ms, client ITL p50 "
                  f"{itl:.2f} ms = {itl / step:.2f}x the step", flush=True)
            time.sleep(1)
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"median of {args.cycles} cycles: engine step {med[0]:.2f} ms, server iteration "
          f"{med[1]:.2f} ms, client ITL {med[2]:.2f} ms ({med[2] / med[0]:.2f}x)")


if __name__ == "__main__":
    main()
