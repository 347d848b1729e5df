"""Fixtures for server tests: a real uvicorn on 127.0.0.1 in a background thread.

One real engine (the bundled SmolLM2-135M, small KV pool) is shared by the whole session;
each module builds its own app (own metrics registry) around it and shuts it down after.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.server.app import build_app

MODEL = "smol"
API_KEY = "test-key"
SMALL_CONFIG = dict(num_kv_blocks=256, max_num_seqs=32, max_model_len=2048)


class ServerThread:
    """uvicorn serving ``app`` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


@pytest.fixture(scope="session")
def real_engine():
    """The bundled model with a small KV pool (~6 s to load), shared by all modules."""
    from inflight.engine import Engine
    return Engine(EngineConfig(**SMALL_CONFIG))


def serve(engine, **kwargs) -> tuple[ServerThread, AsyncEngine]:
    """Start an app around ``engine`` (an ``Engine``); returns the thread and the loop."""
    async_engine = AsyncEngine(engine, max_num_waiting=kwargs.pop("max_num_waiting", None),
                               log_interval_s=kwargs.pop("log_interval_s", 0))
    kwargs.setdefault("model_names", [MODEL])
    app = build_app(async_engine, **kwargs)
    return ServerThread(app).start(), async_engine


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until truthy (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for a server process to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_healthy(url: str, proc) -> bool:
    """``/health`` answers 200; fails with the process's output if it already exited."""
    assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def stop_process(proc) -> str:
    """Kill a server process the test started if it still runs; its whole output (stdout
    with stderr folded in)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    return proc.stdout.read().decode(errors="replace")


def get_json(base_url: str, path: str):
    return httpx.get(base_url + path, timeout=10).json()
