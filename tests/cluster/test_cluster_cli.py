"""``inflight serve --data-parallel-size 2`` as a process: it serves, and SIGTERM stops it
with status 0 and every Ray process it started (gcs, raylet, replicas) gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'inflight-serve[cluster]'")

from tests.cluster.test_cluster_server import _alive, _descendants  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_dp2_and_sigterm_leaves_nothing():
    port = _free_port()
    cmd = [sys.executable, "-m", "inflight.cli", "serve", "--data-parallel-size", "2",
           "--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "512",
           "--max-num-seqs", "4", "--num-threads", "1", "--router", "least_load",
           "--stats-log-interval", "0", "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        stats = httpx.get(url + "/stats").json()
        assert stats["router"]["policy"] == "least_load"
        started = _descendants(proc.pid)
        names = {name for _, name in started}
        assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
        replica_pids = [r["pid"] for r in stats["replicas"]]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p, _ in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p, n) for p, n in started if _alive(p)]
    assert not left, left
    assert not any(_alive(p) for p in replica_pids)
    assert exit_s < 30, exit_s
    if os.environ.get("INFLIGHT_REPORT_TIMES"):
        print(f"exit after SIGTERM: {exit_s:.1f} s")
