"""Start and stop a server per knob value (``--serve-cmd 'inflight serve --max-num-seqs {value}'``).

The command runs in its own process group so a wrapper script and its children stop
together. Stop is SIGINT (a clean shutdown), then SIGTERM, then SIGKILL, each bounded.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import subprocess
import tempfile
import time

import httpx


class ServerProcess:
    """A server started from ``template.format(value=...)`` and ready when /health says 200."""

    def __init__(self, template: str, value: str, base_url: str, start_timeout: float = 600.0,
                 stop_timeout: float = 15.0, log_path: str | None = None) -> None:
        self.command = template.replace("{value}", str(value))
        self.base_url = base_url.rstrip("/")
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="inflight-bench-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(self.base_url + "/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def start(self) -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            if await self._healthy(client):
                # Benchmarking a server we did not start would credit the wrong knob value.
                raise RuntimeError(f"a server already answers at {self.base_url}; stop it or change --base-url")
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(shlex.split(self.command), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                await self._wait_healthy(client)
            except BaseException:
                # Also on Ctrl-C or cancellation: never leave a half-started server behind.
                self.stop()
                raise

    async def _wait_healthy(self, client: httpx.AsyncClient) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            if await self._healthy(client):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"server not healthy after {self.start_timeout:g} s; log: {self.log_path}")

    def stop(self) -> int | None:
        """Stop the server's process group; returns its exit code (None if it never started)."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGINT, self.stop_timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    async def __aenter__(self) -> "ServerProcess":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop()
