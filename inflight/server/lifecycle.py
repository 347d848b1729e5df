"""``inflight serve``'s process: bind, build the engine client, serve, drain, exit.

``run_serve`` is the one launch path for one engine and for N replicas; an
``EngineLauncher`` says how the engine client is built (``local_engine.LocalEngine``: an
``AsyncEngine`` in this process; ``cluster.serve.RayReplicas``: a Ray ``ClusterEngine``)
and what else it needs around the app.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import uvicorn
from fastapi import FastAPI

from inflight.config import EngineConfig, ServingConfig
from inflight.engine.engine_client import EngineClient
from inflight.engine.watchdog import EXIT_ENGINE_DEAD
from inflight.server.app import build_app
from inflight.server.tenants import TenantSettings, describe_tenants
from inflight.server.tool_parsers import check_tool_choice_flags

logger = logging.getLogger(__name__)

API_KEY_ENV = "INFLIGHT_API_KEY"
T = TypeVar("T")


class EngineLauncher(Protocol):
    """How ``run_serve`` gets its engine client, built from the parsed flags.

    Attributes:
        config: the engine settings (as each engine runs them); computing them raised
            ``ValueError`` for a bad flag, before anything was bound or loaded.
    """

    config: EngineConfig

    def prepare(self, chat_template: str | None) -> None:
        """Work before the socket is bound (a cluster ingress loads its tokenizer here,
        with ``chat_template`` when given)."""
        ...

    def start(self, serving: ServingConfig, model_name: str) -> EngineClient:
        """Build the engine client (loads the model; minutes at most)."""
        ...

    def install(self, app: FastAPI, client: EngineClient) -> None:
        """Add what this kind of client serves beside the app's routes."""
        ...

    def describe(self) -> str:
        """Words for the "serving" log line after the address (may be empty)."""
        ...

    def stop(self) -> None:
        """Shut the client and whatever it started down (idempotent; after ``start``
        failed too)."""
        ...


def run_serve(args: argparse.Namespace, launcher: EngineLauncher | None = None) -> int:
    """``inflight serve``: build the engine client, serve until SIGINT/SIGTERM, exit 0;
    exit ``EXIT_ENGINE_DEAD`` (70) when the engine died (the step watchdog, a crashed
    loop), 1 when the server never started.

    Args:
        args: the parsed ``serve`` flags.
        launcher: how the engine client is built; None: one engine in this process
            (``local_engine.LocalEngine``).

    Raises:
        ValueError: a bad flag. FileNotFoundError: a missing model or chat template.
        RuntimeError: (a cluster) Ray is missing, or a replica failed to start.
    """
    if launcher is None:
        from inflight.server.local_engine import LocalEngine
        launcher = LocalEngine(args)
    serving = ServingConfig(max_num_waiting=args.max_num_waiting)
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ValueError(f"max_tokens_default: must be >= 1, got {args.max_tokens_default}")
    check_tool_choice_flags(args.tool_call_parser, args.enable_auto_tool_choice)
    template = load_chat_template(args.chat_template) if args.chat_template else None
    tenants = TenantSettings.from_cli_args(args, os.environ.get(API_KEY_ENV))
    names = args.served_model_name or default_model_names(launcher.config.model)
    launcher.prepare(template)
    sock = bind_socket(args.host, args.port)
    try:
        client = launcher.start(serving, names[0])
        app = build_app(client, model_names=names, tenants=tenants,
                        max_body_bytes=args.max_request_body_bytes,
                        stats_window_s=args.stats_window, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        max_tokens_default=args.max_tokens_default, pooling=args.pooling)
        launcher.install(app, client)
        server = _server(app, client, args)
        logger.info("serving %s on http://%s:%d%s (%s)", names[0], args.host, args.port,
                    launcher.describe(), describe_tenants(tenants))
        _run_until_signalled(server, sock)
        return server.exit_code or (0 if server.started else 1)
    finally:
        sock.close()
        launcher.stop()


def _server(app: FastAPI, client: EngineClient, args: argparse.Namespace) -> "DrainingServer":
    log_level = getattr(args, "log_level", "info").lower()
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                               access_log=args.access_log, lifespan="on",
                               # typed int, but uvicorn hands it to asyncio.wait_for
                               timeout_graceful_shutdown=_CLOSE_GRACE_S)  # type: ignore[arg-type]
    server = DrainingServer(uv_config, client, args.shutdown_timeout)
    client.on_dead.append(server.engine_died)
    return server


def _run_until_signalled(server: "DrainingServer", sock: socket.socket) -> None:
    # uvicorn re-raises the signal it shut down on once it has restored the previous
    # handlers; a no-op handler here turns that into a clean return (exit status 0).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a taken port or a bad address
    fails in a second, not after start-up. Raises ``ValueError`` saying which."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def default_model_names(model: str | None) -> list[str]:
    """The names requests may give without ``--served-model-name``, the reported one first:
    vLLM reports the ``--model`` argument; for no ``--model``, the bundled GGUF's model name
    (``SmolLM2-135M-Instruct``). A packaged model answers to both its short name and its
    file's model name, so ``--model smollm2-135m`` serves README's examples too."""
    from inflight.model.bundled import BUNDLED_SHORT_NAME, PACKAGED_MODELS

    short = BUNDLED_SHORT_NAME if model is None else model
    if short not in PACKAGED_MODELS:
        return [short]
    file_name = PACKAGED_MODELS[short]().name.split(".")[0]
    return [short, file_name] if model is not None else [file_name, short]


def load_chat_template(arg: str) -> str:
    """``--chat-template``: a file's text, or the argument itself when it holds Jinja
    (vLLM's rule). Raises ``FileNotFoundError`` for a path that is neither."""
    path = pathlib.Path(arg)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in arg or "{%" in arg:
        return arg
    raise FileNotFoundError(f"chat_template: no such file: {arg}")


def build_engine_off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` run on a short-lived thread, its result returned (its exception raised).

    Loading the model runs PyTorch's first parallel ops, and libgomp keeps the thread team
    of the thread that ran them for the life of that thread. Built on the main thread (the
    event loop's, alive for ever), that team stayed, and every step on the engine thread
    then ran 3-4x slower on this 2-core machine (8 decode rows: 55-60 ms offline, 175-260 ms
    on the engine thread; docs/simulator.md). A helper thread takes its team with it.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["engine"] = build()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e
    t = threading.Thread(target=run, name="inflight-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    built: T = box["engine"]
    return built


# After the drain: how long aborts get to land (one engine step), then how long connections
# get to deliver their last bytes before uvicorn closes them. Together under a second.
_ABORT_WAIT_S = 0.3
_CLOSE_GRACE_S = 0.5


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain in front of its graceful shutdown.

    On SIGINT/SIGTERM the socket stays open for up to ``grace_s``: requests in flight run
    on, new ones get 503 (``server_unavailable``) and ``/health`` 503, instead of a refused
    connection. Requests still running then are cut, and their clients hear it as an error
    (a 503 with ``Retry-After``, or an error event and ``[DONE]`` on a stream whose 200 went
    out), never as a success; the log says how many finished and how many were aborted.
    uvicorn then closes the socket and connections (``_CLOSE_GRACE_S`` for their last
    bytes). The process exits within about ``grace_s + 1`` s.
    """

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s
        self.exit_code = 0

    def engine_died(self, reason: str) -> None:
        """``EngineClient.on_dead``: stop serving and exit ``EXIT_ENGINE_DEAD``. The requests
        in flight already got their errors; uvicorn's shutdown gives them
        ``_CLOSE_GRACE_S`` to go out. Any thread may call it (uvicorn polls the flag)."""
        logger.critical("engine dead (%s); shutting down with exit status %d", reason, EXIT_ENGINE_DEAD)
        self.exit_code = EXIT_ENGINE_DEAD
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = self._engine
        engine.drain()
        start, in_flight = time.monotonic(), engine.num_in_flight
        if in_flight:
            logger.info("shutting down: %d requests in flight get %.1f s to finish",
                        in_flight, self._grace_s)
        while engine.num_in_flight and time.monotonic() - start < self._grace_s:
            await asyncio.sleep(0.02)
        left = engine.num_in_flight
        if left:
            engine.abort_all()
            # The aborts land after the engine's current step; their final outputs go out
            # before uvicorn starts closing connections.
            deadline = time.monotonic() + _ABORT_WAIT_S
            while engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        logger.info("shutdown: %d requests finished during the %.1f s drain, %d aborted",
                    max(0, in_flight - left), time.monotonic() - start, left)
        await super().shutdown(sockets)
