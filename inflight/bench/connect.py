"""Sessions on a run's target: the server (one already running at ``--base-url``, or one
bench starts per configuration from ``--serve-cmd``) or, with ``--simulate``, the simulator;
the host probed before a real search; ``--calibrate``'s predictor."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from inflight.bench.client import make_client
from inflight.bench.http_target import open_session
from inflight.bench.limit import Predictor
from inflight.bench.machine import HostLoad, probe_host
from inflight.bench.run_config import BenchConfig
from inflight.bench.server_proc import ServerProcess
from inflight.bench.session import Session
from inflight.bench.simulation import Simulator

HOST_PROBE_S = 3.0


@dataclass(frozen=True)
class Run:
    """A sub-command's run: its configuration, and the simulator the command line plugged
    in (None: ``--simulate`` and ``--calibrate`` are unavailable)."""

    config: BenchConfig
    simulator: Simulator | None = None

    @property
    def simulated(self) -> bool:
        return self.config.simulate is not None

    def need_simulator(self) -> Simulator:
        if self.simulator is None:
            raise ValueError("--simulate and --calibrate run the simulator: run them as `inflight bench ...`")
        return self.simulator

    def title(self, base: str) -> str:
        return f"{base} (SIMULATED)" if self.simulated else base


def header(config: BenchConfig, kind: str) -> dict[str, Any]:
    """The keys every result starts with: what ran, the process's command line, the flags."""
    return {"kind": kind, "tool": "inflight bench", "command": shlex.join(sys.orig_argv), "args": config.recorded,
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


@contextlib.asynccontextmanager
async def started_server(config: BenchConfig, command: str, name: object = None) -> AsyncIterator[ServerProcess]:
    """Start ``command`` (with ``--lora-modules``' server flags: ``ServerOptions.launch_command``)
    as the server under test; stop it on exit, however the block ends."""
    server = config.server
    log = None
    if server.log_dir:
        os.makedirs(server.log_dir, exist_ok=True)
        log = os.path.join(server.log_dir, f"server-{safe_name(name)}.log")
    proc = ServerProcess(server.launch_command(command), config.load.base_url, server.start_timeout,
                         server.stop_timeout, log)
    print(f"starting: {proc.command}", file=sys.stderr)
    async with proc:
        yield proc
    print(f"stopped (exit {proc.proc.returncode if proc.proc else None}); log: {proc.log_path}", file=sys.stderr)


def safe_name(name: object) -> str:
    """``name`` as a file name part."""
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in str(name))[:120] or "server"


@contextlib.asynccontextmanager
async def server_for(run: Run, value: str | None) -> AsyncIterator[ServerProcess | None]:
    """The server of knob ``value`` (``--serve-cmd``), or none (no command, or simulated)."""
    command = run.config.server.command(value)
    if command is None or run.simulated:
        yield None
        return
    async with started_server(run.config, command, value or "server") as proc:
        yield proc


async def open_any_session(run: Run, stack: contextlib.AsyncExitStack, command: str | None) -> Session:
    """The run's session: simulated with ``--simulate`` (engine settings from ``command``,
    else the profile's), else over HTTP with a client that ``stack`` closes."""
    config = run.config
    if config.simulate is not None:
        session = await run.need_simulator().open_session(config.simulate, config.load, config.dataset, command)
    else:
        client = await stack.enter_async_context(make_client(timeout=config.load.request_timeout))
        session = await open_session(config.load, config.dataset, client)
    print(session.target.banner(session), file=sys.stderr)
    return session


def connector(run: Run, stack: contextlib.AsyncExitStack, command: str | None, value: str | None = None,
              pids: list[int] | None = None) -> Callable[[], Awaitable[Session]]:
    """A ``connect()`` for ``limit.find_limit``: start the server (``command``, if any) and
    open the session on first use; ``stack`` closes both. The host is probed first (what
    else runs here: ``machine.probe_host``); a busy one is named at once, and with
    ``--on-busy-host stop`` ends the run. ``pids`` receives the started server's pid."""
    async def connect() -> Session:
        own: list[int] = []
        if command is not None and not run.simulated:
            proc = await stack.enter_async_context(started_server(run.config, command, value))
            if proc.proc is not None:
                own.append(proc.proc.pid)
                if pids is not None:
                    pids.append(proc.proc.pid)
        if not run.simulated:
            await check_host(run.config.server.on_busy_host, own)
        return await open_any_session(run, stack, command)
    return connect


async def check_host(on_busy_host: str, pids: list[int]) -> HostLoad | None:
    """Probe the host for ``HOST_PROBE_S`` before measuring (``pids``: ours, not counted);
    say at once if it is busy.

    Raises:
        RuntimeError: busy, with ``on_busy_host`` "stop".
    """
    host = await probe_host(HOST_PROBE_S, pids)
    if host is None:
        return None
    if host.is_busy():
        message = (f"the host is busy before the run: {host.describe()}. On a shared machine every step "
                   f"slows with it, and the limit measured is this host's at this time, not the server's")
        if on_busy_host == "stop":
            raise RuntimeError(message + " (--on-busy-host stop)")
        print(f"WARNING: {message}", file=sys.stderr)
    else:
        print(f"host: idle before the run ({host.describe()})", file=sys.stderr)
    return host


def calibration(run: Run, command: str | None, value: str | None = None,
                ) -> tuple[str, Predictor, list[int]]:
    """``--calibrate``: the server command with ``--step-log`` added, the ``limit.Predictor``
    that ramps it, fits its steps and simulates the search, and the server pids it will
    read (filled by ``connector``). ValueError where calibration cannot run."""
    if run.simulated:
        raise ValueError("--calibrate measures a real server; --simulate has nothing to calibrate")
    if not command:
        raise ValueError("--calibrate needs --serve-cmd 'inflight serve ...': it adds --step-log to the "
                         "server command to fit the server's own steps")
    simulator = run.need_simulator()
    simulator.check_command(command)  # ValueError: not an inflight server
    folder = run.config.output.report or run.config.server.log_dir
    if folder is None:
        folder = tempfile.mkdtemp(prefix="inflight-calibrate-")
    os.makedirs(folder, exist_ok=True)
    step_log = os.path.join(folder, f"steps-{safe_name(value or 'server')}.jsonl")
    profile = os.path.join(folder, f"profile-{safe_name(value or 'server')}.json")
    command = f"{command} --step-log {shlex.quote(step_log)}"
    pids: list[int] = []
    predictor = simulator.predictor(command, step_log, profile, pids, run.config.plan())
    return command, predictor, pids
