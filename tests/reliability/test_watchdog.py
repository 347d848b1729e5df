"""The step watchdog (issue 35): a step that never returns is noticed within its timeout;
``/health`` then answers 503, requests in flight end with an error their clients can tell
from a success, and ``inflight serve`` exits 70 for its supervisor to restart it. Faults
are injected at the runner (``FAULTS.arm(..., stall_s=...)``: a step that sleeps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from inflight.core.step_model import StepTimeModel
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.watchdog import AUTO_FLOOR_S, EXIT_ENGINE_DEAD, StepWatchdog
from inflight.faults import FAULTS
from tests.reliability.conftest import engine_sharing_model
from tests.server.conftest import (MODEL, ServerThread, free_port, process_healthy, stop_process,
                                   wait_until)


def test_fires_once_past_the_timeout_naming_the_step_and_its_plan():
    now, fired = [0.0], []
    wd = StepWatchdog(2.0, fired.append, lambda: "its plan", clock=lambda: now[0])
    assert not wd.check()  # no step in progress
    wd.step_began()
    now[0] = 1.9
    assert not wd.check()
    wd.step_ended()
    now[0] = 50.0
    assert not wd.check()  # time between steps (idle) never counts
    wd.step_began()
    now[0] = 52.5
    assert wd.check()
    assert fired == [wd.fired]
    assert fired[0] == ("engine step 2 did not return within the watchdog timeout of 2 s "
                        "(running for 2.5 s): its plan")
    now[0] = 99.0
    assert not wd.check() and len(fired) == 1  # once
    with pytest.raises(ValueError):
        StepWatchdog(0.0, fired.append)


def test_the_automatic_timeout_follows_the_engines_step_model():
    model = StepTimeModel()
    stub = SimpleNamespace(get_stats=lambda: None, scheduler=SimpleNamespace(step_model=model),
                           config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=256))
    engine = AsyncEngine(stub, log_interval_s=0)  # type: ignore[arg-type]
    assert engine.watchdog is not None and engine.watchdog.timeout_s == AUTO_FLOOR_S  # nothing learned
    for tokens in range(1, 400, 40):  # 10 ms + 2 ms per token: 4.106 s for 2048 tokens
        model.observe(tokens, 0.010 + 0.002 * tokens)
    assert engine.watchdog.timeout_s == pytest.approx(20 * 4.106)
    assert AsyncEngine(stub, log_interval_s=0, watchdog_timeout_s=0).watchdog is None  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AsyncEngine(stub, watchdog_timeout_s=-1)  # type: ignore[arg-type]


def test_the_backstop_ends_a_process_whose_stuck_thread_holds_the_gil():
    """A native call that never releases the GIL stops the watchdog thread too; the
    faulthandler timer it armed fires without the GIL, dumps the threads, exits 1."""
    script = textwrap.dedent("""
        import ctypes, time
        from inflight.engine.watchdog import StepWatchdog
        wd = StepWatchdog(0.3, print, backstop=True, backstop_s=0.5, check_interval_s=0.05)
        wd.start()
        time.sleep(0.2)
        wd.step_began()
        ctypes.PyDLL(None).sleep(30)  # PyDLL keeps the GIL through the call
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr
    assert "Timeout (0:00:00" in proc.stderr and "Thread" in proc.stderr
    assert took < 20


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stuck_step_ends_the_requests_in_flight_and_fails_health(base_engine):
    FAULTS.disarm()
    with engine_sharing_model(base_engine, max_num_seqs=4) as core:
        from inflight.server.app import build_app
        engine = AsyncEngine(core, log_interval_s=0, watchdog_timeout_s=0.5)
        died = []
        engine.on_dead.append(died.append)
        srv = ServerThread(build_app(engine, model_names=[MODEL])).start()
        url = srv.base_url
        try:
            ok = httpx.post(url + "/v1/completions", timeout=30,
                            json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
            assert ok.status_code == 200  # a step of normal length is not stuck
            body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json=body) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and next(lines).startswith("data: {")  # 200 went out
                FAULTS.arm("runner", stall_s=4.0)  # the stream's next decode step stalls
                t0 = time.monotonic()
                out: dict = {}
                t = threading.Thread(target=lambda: out.setdefault("plain", httpx.post(
                    url + "/v1/completions", timeout=30,
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})))
                t.start()
                rest = [ln for ln in lines if ln]
                noticed = time.monotonic() - t0
                t.join(10)
            # The stream whose 200 went out ends with an error event, then [DONE]: not a
            # success; the request that never got a token gets a real 503.
            assert rest[-1] == "data: [DONE]", rest
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert error["code"] == "server_unavailable" and "watchdog timeout of 0.5 s" in error["message"]
            plain = out["plain"]
            assert plain.status_code == 503 and plain.headers["retry-after"] == "1", plain.text
            assert plain.json()["error"]["code"] == "server_unavailable"
            assert "watchdog timeout of 0.5 s" in plain.json()["error"]["message"]
            assert noticed < 0.5 + 1.5, f"noticed after {noticed:.2f} s"
            assert len(died) == 1 and died[0].startswith("engine step ")
            assert "decode rows" in died[0]  # the plan of the stuck step is in the message
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503
            refused = httpx.post(url + "/v1/completions", timeout=5,
                                 json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503
        finally:
            FAULTS.disarm()
            srv.stop()
            engine.shutdown()
            # The stalled step returns after its sleep; the thread then sees the engine
            # dead and stops, before the next test steps the shared model.
            engine._thread.join(10)
            assert not engine._thread.is_alive()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_inflight_serve_exits_70_when_its_engine_is_stuck():
    """The whole path as a supervisor sees it: the process, not a thread, ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    driver = textwrap.dedent(f"""
        import sys
        from inflight.cli import main
        from inflight.faults import FAULTS
        FAULTS.arm("runner", nth=2, stall_s=600)  # the first request's first decode step
        sys.exit(main(["serve", "--port", "{port}", "--num-kv-blocks", "128", "--max-model-len",
                       "1024", "--max-num-seqs", "4", "--watchdog-timeout", "2"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: process_healthy(url, proc), timeout=120, interval=0.2, what="the server")
        t0 = time.monotonic()
        reply = httpx.post(url + "/v1/completions", timeout=30, json={"prompt": "Hi", "max_tokens": 20})
        assert reply.status_code == 503, reply.text
        assert "watchdog" in reply.json()["error"]["message"]
        assert proc.wait(timeout=30) == EXIT_ENGINE_DEAD
        assert time.monotonic() - t0 < 2 + 10
    finally:
        log = stop_process(proc)
    assert "did not return within the watchdog timeout of 2 s" in log, log
    assert "shutting down with exit status 70" in log, log
