"""``inflight serve`` as a process: flags, the API key from the environment, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import free_port, process_healthy, stop_process, wait_until

pytestmark = pytest.mark.slow


GRACE_S = 2.0


def test_serve_sigterm_drains_then_aborts_and_exits_in_time():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "INFLIGHT_API_KEY": "secret"}
    cmd = [sys.executable, "-m", "inflight.cli", "serve", "--port", str(port),
           "--served-model-name", "m", "--num-kv-blocks", "128", "--max-model-len", "1024",
           "--max-num-seqs", "4", "--shutdown-timeout", str(GRACE_S)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: process_healthy(url, proc), timeout=90, interval=0.2, what="the server")
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer secret"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "m"

        body = {"model": "m", "prompt": "Tell me a story.", "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth,
                          timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # During the drain the port stays open: health and new requests hear why.
            health = wait_until(lambda: _status(url + "/health", "GET"), timeout=GRACE_S / 2,
                                interval=0.02, what="/health to answer 503")
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "server_unavailable"
            refused = httpx.post(url + "/v1/completions", headers=auth, timeout=5,
                                 json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert time.monotonic() - signalled < GRACE_S, "probes ran past the drain"
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "shutting down" in refused.json()["error"]["message"]
            rest = [line for line in lines if line]
        # The stream was not dropped: after the grace period it was cut, and says so with an
        # error event (not a success with finish_reason abort, issue 35), then [DONE].
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2].removeprefix("data: "))
        assert last["error"]["code"] == "server_unavailable" and "cut short" in last["error"]["message"]
        assert proc.wait(timeout=30) == 0
        exit_s = time.monotonic() - signalled
        assert exit_s < GRACE_S + 1.0, f"exit took {exit_s:.2f} s"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        log = stop_process(proc)
    assert "serving m on" in log, log
    assert "shutdown: 0 requests finished during the" in log and "drain, 1 aborted" in log, log


def _status(url: str, method: str) -> httpx.Response | None:
    """The response if it is a 503, None while the server still answers 200."""
    r = httpx.request(method, url, timeout=2)
    return r if r.status_code == 503 else None
