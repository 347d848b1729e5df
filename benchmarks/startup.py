"""Start-up time: launch ``inflight serve`` and time the first answered request (issue 6).

Starts the server on 127.0.0.1 with the given flags, sends a one-token completion every
50 ms until one succeeds, prints the seconds from launch to that answer, stops the server.
Repeats ``--repeats`` times (the first run may include the kernel build and a cold page
cache; the target is <= 6 s on the bundled model).

    .venv/bin/python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def one_run(port: int, extra: list[str], timeout: float) -> float:
    exe = Path(sys.executable).with_name("inflight")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(exe), "--log-level", "warning", "serve", "--port", str(port),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        with httpx.Client(trust_env=False) as client:
            while time.monotonic() - t0 < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}")
                try:
                    r = client.post(f"http://127.0.0.1:{port}/v1/completions", timeout=5,
                                    json={"prompt": "Hi", "max_tokens": 1})
                    if r.status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"no answer within {timeout} s")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8473)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("server_args", nargs="*", help="extra flags for inflight serve")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    times = [one_run(args.port, args.server_args, args.timeout) for _ in range(args.repeats)]
    for i, t in enumerate(times):
        print(f"[{i}] launch -> first answer: {t:.2f} s")
    print(f"best {min(times):.2f} s, worst {max(times):.2f} s")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
