"""One stream's decode speed with a busy neighbour (issue 32, part 4): a step should slow in
proportion to the CPU it gets, not collapse.

Starts ``inflight serve`` itself on 127.0.0.1 (one server per ``--variant``), then per
repeat, for each mode of ``--modes``, sends one streamed greedy request (``--output-len``
tokens, ``ignore_eos``; ``--streams`` at once, their rates summed) to each server in turn
(order alternating per repeat) and reads its decode speed: streamed tokens after the first
over the time from the first to the last. Modes: ``idle``; ``core1`` / ``core0`` (a pure-Python busy loop in a process of its
own, pinned to that core with ``sched_setaffinity``); ``any`` (the loop unpinned). The
loop stops itself after ``--deadline-s`` + 5 s and is killed after each measurement; a
request still streaming at ``--deadline-s`` is cut there and measured on what arrived.

Per variant and mode it prints each repeat's tok/s, the median and the slowdown (idle
median over that mode's median); with each measurement, the load average and the cores'
worth of CPU other processes took (not the servers, the loop or this client), and the
summary again over only the measurements that others left alone. ``inflight serve`` bounds
libgomp's spin itself unless told otherwise, so libgomp's own default is the variant
``GOMP_SPINCOUNT=300000``:

    .venv/bin/python benchmarks/busy_neighbour.py --repeats 3
    .venv/bin/python benchmarks/busy_neighbour.py --variant 'before GOMP_SPINCOUNT=300000' \\
        --variant after --modes idle core1 core0 any --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _runs import free_port  # noqa: E402  (sibling benchmark module)

from inflight.bench.machine import BUSY_OTHERS_CORES, HostMonitor  # noqa: E402
from inflight.bench.server_proc import ServerProcess  # noqa: E402

# Pure Python: holds one core without touching OpenMP or the model; ends itself.
BUSY_LOOP = """
import os, sys, time
core, seconds = int(sys.argv[1]), float(sys.argv[2])
if core >= 0:
    os.sched_setaffinity(0, {core})
end = time.monotonic() + seconds
while time.monotonic() < end:
    pass
"""
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class Variant:
    """One server: a name, environment overrides and extra ``inflight serve`` flags."""

    name: str
    env: dict[str, str]
    flags: list[str]
    # Per mode: (decode tok/s, cores' worth other processes took meanwhile) per repeat.
    runs: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """``'NAME [KEY=VALUE ...] [-- FLAG ...]'``."""
        words = shlex.split(spec)
        cut = words.index("--") if "--" in words else len(words)
        env = dict(w.split("=", 1) for w in words[1:cut])
        return cls(words[0], env, words[cut + 1:])


@contextlib.contextmanager
def neighbour(mode: str, seconds: float) -> Iterator[int | None]:
    """A busy loop for ``mode`` (None for ``idle``), killed on exit; yields its pid."""
    if mode == "idle":
        yield None
        return
    core = -1 if mode == "any" else int(mode.removeprefix("core"))
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core), str(seconds + 5)])
    try:
        time.sleep(0.5)  # running and placed before the request starts
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(10)


async def decode_rate(base_url: str, output_len: int, deadline_s: float) -> tuple[float, int]:
    """One streamed greedy request; (decode tok/s after the first token, tokens seen)."""
    body = {"prompt": PROMPT, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    timeout = aiohttp.ClientTimeout(total=deadline_s + 30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(base_url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            end = time.monotonic() + deadline_s
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    times.append(time.monotonic())
                if time.monotonic() > end:
                    break  # closing the connection aborts the request
    if len(times) < 2:
        return 0.0, len(times)
    return (len(times) - 1) / (times[-1] - times[0]), len(times)


async def measure(server: ServerProcess, mode: str,
                  args: argparse.Namespace) -> tuple[float, float]:
    """One request to ``server`` under ``mode``; prints and returns its decode tok/s and the
    cores' worth of CPU other processes took meanwhile (nan where unknown)."""
    load = os.getloadavg()[0]
    with neighbour(mode, args.deadline_s) as pid:
        assert server.proc is not None
        monitor = HostMonitor([server.proc.pid] + ([pid] if pid else [])).start()
        streams = await asyncio.gather(*(decode_rate(server.base_url, args.output_len,
                                                     args.deadline_s)
                                         for _ in range(args.streams)))
        rate, n = sum(r for r, _ in streams), sum(k for _, k in streams)
        host = monitor.stop()
    others = host.others_cores if host else float("nan")
    print(f"  {mode:5s} {rate:7.1f} tok/s ({n} tokens)  load average {load:.2f}, other "
          f"processes {others:.2f} cores", flush=True)
    return rate, others


async def run(variants: list[Variant], args: argparse.Namespace) -> None:
    servers = []
    for v in variants:
        port = free_port()
        env = " ".join(f"{k}={shlex.quote(x)}" for k, x in v.env.items())
        cmd = (f"env {env} {REPO / '.venv/bin/inflight'} serve --host 127.0.0.1 --port {port} "
               + " ".join(v.flags))
        servers.append(ServerProcess(cmd, f"http://127.0.0.1:{port}", start_timeout=120))
    try:
        for s in servers:
            await s.start()
            await decode_rate(s.base_url, args.output_len, args.deadline_s)  # warm-up
        t_end = time.monotonic() + args.budget_s
        for r in range(args.repeats):
            order = list(zip(variants, servers))
            for mode in args.modes:
                for v, s in order if r % 2 == 0 else order[::-1]:
                    print(f"repeat {r + 1}, {v.name}:", end="", flush=True)
                    v.runs.setdefault(mode, []).append(await measure(s, mode, args))
            if time.monotonic() > t_end:
                print(f"budget of {args.budget_s:g} s spent after {r + 1} repeats")
                break
    finally:
        for s in servers:
            s.stop()


def _line(name: str, mode: str, rates: list[float], idle: list[float]) -> str:
    if not rates:
        return f"{name}, {mode}: no measurement"
    med = statistics.median(rates)
    slow = statistics.median(idle) / med if idle and med > 0 else float("nan")
    return (f"{name}, {mode}: {' '.join(f'{x:.1f}' for x in rates)} | {med:.1f} | "
            f"{slow:.2f}x")


def report(variants: list[Variant]) -> None:
    """Every measurement, then only those during which other processes took at most
    ``BUSY_OTHERS_CORES`` (the host's other work would otherwise count as the loop's)."""
    print("\nvariant, mode: tok/s per repeat | median | slowdown (idle median / this median)")
    for v in variants:
        idle = [r for r, _ in v.runs.get("idle", [])]
        for mode, runs in v.runs.items():
            print(_line(v.name, mode, [r for r, _ in runs], idle))
    print(f"\nthe same, only measurements with other processes <= {BUSY_OTHERS_CORES} cores:")
    for v in variants:
        idle = [r for r, o in v.runs.get("idle", []) if o <= BUSY_OTHERS_CORES]
        for mode, runs in v.runs.items():
            print(_line(v.name, mode, [r for r, o in runs if o <= BUSY_OTHERS_CORES], idle))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=None,
                   help="'NAME [KEY=VALUE ...] [-- serve flags]'; repeat for several servers "
                        "(default: one, 'default')")
    p.add_argument("--modes", nargs="+", default=["idle", "core1", "core0", "any"],
                   help="idle, coreN (busy loop pinned to core N), any (unpinned)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--streams", type=int, default=1,
                   help="requests sent at once per measurement; their decode tok/s summed")
    p.add_argument("--deadline-s", type=float, default=8.0,
                   help="cut a request after this many seconds of streaming")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="no new repeat after this many seconds of measuring")
    args = p.parse_args()
    variants = [Variant.parse(s) for s in args.variant or ["default"]]
    print(f"{os.cpu_count()} cores, affinity {sorted(os.sched_getaffinity(0))}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    asyncio.run(run(variants, args))
    report(variants)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
