"""What the server adds to a decode step at low concurrency (issue 17: client ITL p50 within
10 % of the engine's own step time for the same batch).

Three figures for the same engine flags and load (``--streams`` concurrent streams, each
request ``--input-len`` prompt tokens and ``--output-len`` tokens out, ignore_eos, greedy):

- **engine step**: offline, ``Engine.step()`` wall time of pure decode steps with
  ``--streams`` requests running (median), in a process of its own with no server;
- **engine iteration in the server**: from ``inflight serve --step-log``, the time between
  consecutive decode steps' publications (the engine thread's whole loop: commands, step,
  delivery, metrics) while the HTTP server and the client run on the same cores;
- **client ITL**: the median gap between streamed tokens, as ``inflight bench serve``
  measures it (its streaming client, ``inflight.bench.client``, on the same event loop).

The host's own speed can drift by tens of percent within minutes (a shared VM), so the
offline engine and the server are started once and kept: each of ``--cycles`` pairs is a
burst on the offline engine (one wave of ``--streams`` requests) and right after it a
burst of ``--requests`` streamed requests on the server, while the other process idles.
Each pair's ratio compares two bursts seconds apart; the summary gives the pairs' median
ratio and their spread.

    .venv/bin/python benchmarks/serving_overhead.py --streams 1 --cycles 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _runs import free_port  # noqa: E402  (sibling benchmark module)

from inflight.bench.client import (RequestRecord, event_loop_factory, make_client,  # noqa: E402
                                   stream_request)
from inflight.bench.server_proc import ServerProcess  # noqa: E402

# Reads a line per burst on stdin; answers with the burst's pure-decode step times (s).
OFFLINE_WORKER = """
import argparse, json, sys, time
from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.sampling_params import SamplingParams
flags, streams, input_len, output_len = json.loads(sys.argv[1])
p = argparse.ArgumentParser(); EngineConfig.add_cli_args(p)
engine = Engine(EngineConfig.from_cli_args(p.parse_args(flags)))
sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
print("ready", flush=True)
for burst, _ in enumerate(sys.stdin):
    for i in range(streams):
        engine.add_request(f"{burst}-{i}", [1000 + 7 * i + j for j in range(input_len)], sp)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter(); engine.step(); dt = time.perf_counter() - t
        plan = engine.last_plan
        if plan is not None and len(plan.scheduled) == streams \\
                and all(len(r.token_ids) == 1 for r in plan.scheduled):
            times.append(dt)
    print(json.dumps(times), flush=True)
"""


class OfflineEngine:
    """The engine without a server, in its own interpreter (the server's thread setup is
    not shared), run one burst at a time."""

    def __init__(self, flags: list[str], streams: int, input_len: int, output_len: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OFFLINE_WORKER, json.dumps([flags, streams, input_len, output_len])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the offline engine did not start")

    def burst(self) -> list[float]:
        """One wave of requests to the end; the decode steps' wall times (s)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


async def served_burst(base_url: str, streams: int, input_len: int, output_len: int,
                       requests: int) -> tuple[float, float, list[float]]:
    """``requests`` streamed requests, ``streams`` at a time (closed loop); returns the
    burst's monotonic start and end and every gap between streamed tokens (s)."""
    gaps: list[float] = []
    queue = list(range(requests))
    async with make_client(max_connections=streams) as client:

        async def stream_loop(s: int) -> None:
            while queue:
                i = queue.pop()
                body = {"prompt": [1000 + 7 * s + j for j in range(input_len)],
                        "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
                        "stream": True}
                r = await stream_request(client, base_url + "/v1/completions", body,
                                         RequestRecord(i, 0.0))
                if not r.success:
                    raise RuntimeError(f"request failed: {r.error}")
                gaps.extend(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]))

        start = time.monotonic()
        await asyncio.gather(*(stream_loop(s) for s in range(streams)))
        return start, time.monotonic(), gaps


def iterations_in(log: pathlib.Path, streams: int, windows: list[tuple[float, float]],
                  ) -> list[list[float]]:
    """Per window, the engine thread's back-to-back decode iterations (s) in the step log."""
    out: list[list[float]] = [[] for _ in windows]
    with open(log) as f:
        f.readline()  # the header
        prev = None
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                break
            if prev is not None and row[1] == prev[1] and row[2] == row[3] == streams:
                for k, (t0, t1) in enumerate(windows):
                    if t0 <= prev[0] and row[0] <= t1:
                        out[k].append(row[0] - prev[0])
            prev = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=2, help="streamed requests per served burst")
    p.add_argument("--cycles", type=int, default=10, help="pairs of bursts (offline, served)")
    p.add_argument("--flags", default="", help="engine flags for both, e.g. '--dtype bfloat16'")
    args = p.parse_args()
    flags = args.flags.split()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "steps.jsonl"
        server = ServerProcess(f"{REPO / '.venv/bin/inflight'} serve --host 127.0.0.1 "
                               f"--port {port} --step-log {log} " + " ".join(flags), base_url)
        offline = OfflineEngine(flags, args.streams, args.input_len, args.output_len)
        rows, windows = [], []
        runner = asyncio.Runner(loop_factory=event_loop_factory())  # as inflight bench's
        try:
            runner.run(server.start())
            offline.burst()  # warm-ups: neither first burst counts
            runner.run(served_burst(base_url, args.streams, args.input_len, args.output_len,
                                    args.streams))
            for _ in range(args.cycles):
                load = os.getloadavg()[0]
                step = statistics.median(offline.burst())
                t0, t1, gaps = runner.run(served_burst(
                    base_url, args.streams, args.input_len, args.output_len, args.requests))
                rows.append((load, step, statistics.median(gaps)))
                windows.append((t0, t1))
        finally:
            runner.close()
            offline.close()
            server.stop()
        iterations = [statistics.median(w) if w else float("nan")
                      for w in iterations_in(log, args.streams, windows)]
    ratios = []
    for k, ((load, step, itl), it) in enumerate(zip(rows, iterations)):
        ratios.append(itl / step)
        print(f"pair {k + 1} (load average {load:.2f}): engine step {step * 1e3:.2f} ms, server "
              f"iteration {it * 1e3:.2f} ms, client ITL p50 {itl * 1e3:.2f} ms = "
              f"{itl / step:.2f}x the step", flush=True)
    steps = [r[1] for r in rows]
    print(f"{len(rows)} pairs: client ITL / engine step median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x); engine step "
          f"{min(steps) * 1e3:.2f}-{max(steps) * 1e3:.2f} ms, server iteration median "
          f"{statistics.median(iterations) * 1e3:.2f} ms")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
