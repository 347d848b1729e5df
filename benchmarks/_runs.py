"""What the benchmarks share: the host a run was on, printed by every benchmark as it starts
(``record_host``); a bench command run bounded, its output in a log file, with the
machine's load average before and after (``limit_validation.py``, ``limit_vs_peers.py``);
a free local port for a server they start."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import time

from inflight.bench.machine import describe_machine

REPO = pathlib.Path(__file__).resolve().parents[1]


def record_host() -> dict:
    """Print, as one ``host:`` JSON line, the machine this run is on: CPU model, its
    instruction-set flags, VM or not, cores, the thread and instruction-set settings in
    force, load average (``bench.machine.describe_machine``); and the load average again
    when the run ends. Results from hosts that differ 2.5x must never be compared by
    accident (issue 51). Returns the record."""
    host = {k: v for k, v in describe_machine().items() if k != "cpu_ticks"}
    print("host: " + json.dumps(host), flush=True)
    atexit.register(_print_end_load)
    return host


def _print_end_load() -> None:
    try:
        print(f"host: load average at the end {list(os.getloadavg())}", flush=True)
    except OSError:  # stdout closed (a pipe's reader left)
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_bounded(cmd: list[str], log_file: pathlib.Path, timeout: float, tail: int = 1500) -> dict:
    """Run ``cmd`` from the repository root, stdout and stderr to ``log_file``, for at most
    ``timeout`` s (then SIGTERM: the bench stops its server and exits 143); print the log's
    last ``tail`` characters. Returns the command, its exit status, wall seconds and the
    1/5/15-minute load averages before and after. KeyboardInterrupt (``stop_on_signals``)
    ends the command, then propagates."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    before, t0 = describe_machine(), time.monotonic()
    with open(log_file, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            proc.terminate()
            rc = proc.wait(timeout=60)
            if isinstance(e, KeyboardInterrupt):
                raise
    print(log_file.read_text()[-tail:], flush=True)
    return {"command": shlex.join(cmd), "exit": rc, "wall_s": round(time.monotonic() - t0, 1),
            "loadavg_before": before.get("loadavg"), "loadavg_after": describe_machine().get("loadavg")}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so the running command is ended (a shell
    starts background jobs with SIGINT ignored)."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
