"""Start and stop a server per knob value (``--serve-cmd 'inflight serve --max-num-seqs {value}'``).

The command runs in its own process group so a wrapper script and its children stop
together. Stop is SIGINT (a clean shutdown), then SIGTERM, then SIGKILL, each bounded.

A benchmark must never leave its server behind. Besides the ``async with`` exit (which also
runs when the bench is cancelled, as ``run_bench`` does on SIGTERM), every started server
is stopped at interpreter exit, and on Linux the server's own process is asked to receive
SIGTERM when the bench process dies, even by SIGKILL (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp

from inflight.bench.client import HTTP_ERRORS, make_client

_RUNNING: set["ServerProcess"] = set()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: a failure here must not stop the exec.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@atexit.register
def _stop_all() -> None:
    for proc in list(_RUNNING):
        proc.stop()


class ServerProcess:
    """A server started from ``command`` and ready when ``GET {base_url}/health`` says 200."""

    def __init__(self, command: str, base_url: str, start_timeout: float = 600.0,
                 stop_timeout: float = 15.0, log_path: str | None = None) -> None:
        self.command = command
        self.base_url = base_url.rstrip("/")
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="inflight-bench-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    async def _healthy(self, client: aiohttp.ClientSession) -> bool:
        try:
            async with client.get(self.base_url + "/health",
                                  timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                return resp.status == 200
        except HTTP_ERRORS:
            return False

    async def start(self) -> None:
        async with make_client() as client:
            if await self._healthy(client):
                # Benchmarking a server we did not start would credit the wrong knob value.
                raise RuntimeError(f"a server already answers at {self.base_url}; stop it or change --base-url")
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(shlex.split(self.command), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            _RUNNING.add(self)
            try:
                await self._wait_healthy(client)
            except BaseException:
                # Also on Ctrl-C or cancellation: never leave a half-started server behind.
                self.stop()
                raise

    async def _wait_healthy(self, client: aiohttp.ClientSession) -> None:
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
        _RUNNING.discard(self)
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

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
