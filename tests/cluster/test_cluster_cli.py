"""``inflight serve --data-parallel-size 2`` as a process: it serves, and SIGTERM stops it
with status 0 and every Ray process it started (gcs, raylet, replicas) gone; with
``--ray-address`` it joins a running cluster (``ray start --head``) and leaves it running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'inflight-serve[cluster]'")

from tests.cluster.test_cluster_server import _alive, _descendants  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


SERVE = [sys.executable, "-m", "inflight.cli", "serve", "--data-parallel-size", "2",
         "--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "4",
         "--num-threads", "1", "--stats-log-interval", "0", "--shutdown-timeout", "1"]


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """``inflight serve`` with ``args`` on a free port, once /health answers 200."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: nobody reads it while it runs
    proc = subprocess.Popen(SERVE + ["--port", str(port), *args], stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 150
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(log.read()[-3000:])
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def test_serve_dp2_and_sigterm_leaves_nothing():
    proc, url = _start(["--router", "least_load"])
    try:
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


def test_ray_address_joins_a_running_cluster():
    """``ray start --head`` (its own temp dir and port), then ``--ray-address``: the server
    serves from it, and on SIGTERM kills its replicas but leaves the cluster running. The
    head's processes are then ended by their ids (found by the temp dir in their command
    lines)."""
    # Short: Ray's socket paths under it must fit a Unix socket name (107 bytes).
    temp_dir, port = tempfile.mkdtemp(prefix="inflight-ray-", dir="/tmp"), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # bind to 127.0.0.1 (runtime.py)
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2",
                    "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                    f"--temp-dir={temp_dir}"], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        proc, url = _start(["--ray-address", f"127.0.0.1:{port}"])
        try:
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200
            replica_pids = [x["pid"] for x in httpx.get(url + "/stats").json()["replicas"]]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in replica_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in replica_pids)
        assert _head_pids(temp_dir), "the joined cluster was stopped"
    finally:
        heads = _head_pids(temp_dir)
        below = [p for h in heads for p, _ in _descendants(h)]
        for p in below + heads:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def _head_pids(temp_dir: str) -> list[int]:
    """Live processes whose command line names ``temp_dir`` (the head's gcs, raylet, ...)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if temp_dir.encode() in f.read():
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_a_replica_that_cannot_start_stops_the_server_with_its_error():
    port = free_port()
    cmd = [*SERVE, "--port", str(port), "--num-kv-blocks", "4"]  # 64 tokens < max_model_len
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    started: list[tuple[int, str]] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        started += [d for d in _descendants(proc.pid) if d not in started]
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    errors.seek(0)
    err = errors.read()
    assert proc.returncode == 2, err[-2000:]
    assert "a replica failed to start: ValueError: max_model_len: 512 is larger than the KV " \
           "cache can hold" in err, err[-2000:]
    deadline = time.monotonic() + 20
    while any(_alive(p) for p, _ in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [(p, n) for p, n in started if _alive(p)]
