"""``inflight serve --data-parallel-size N`` (N > 1): the app in this process, N engine
replicas as Ray actors (``client.ClusterEngine``), Ray started here or joined.

The same OpenAI API, admission, drain on SIGINT/SIGTERM and exit as the one-engine
``server.app.run_serve``; on exit every replica is killed and a Ray started here is shut
down with its processes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import replace

import uvicorn

from inflight.cluster import replica_metrics as cluster_metrics
from inflight.cluster.ray_engine import ClusterEngine, load_tokenizer
from inflight.cluster.runtime import RayRuntime
from inflight.config import EngineConfig
from inflight.server.tenants import TenantSettings, describe_tenants
from inflight.server.app import (_CLOSE_GRACE_S, API_KEY_ENV, _bind_socket, _Server, build_app,
                                 default_model_name, load_chat_template)

logger = logging.getLogger(__name__)


def replica_threads(config: EngineConfig, num_replicas: int) -> int:
    """Torch threads per replica: ``--num-threads``, else this machine's cores shared out
    (at least 1)."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // num_replicas)


def run_cluster_serve(args: argparse.Namespace) -> int:
    """Serve ``args.data_parallel_size`` replicas until SIGINT/SIGTERM; 0 on a clean exit.

    Raises:
        ValueError: a bad flag (engine flags as ``run_serve``; ``--step-log`` is one engine's).
        RuntimeError: Ray is not installed, or a replica failed to start.
        FileNotFoundError: no such model.
    """
    n = args.data_parallel_size
    config = EngineConfig.from_cli_args(args)
    if args.max_num_waiting < 0:
        raise ValueError(f"max_num_waiting: must be >= 0, got {args.max_num_waiting}")
    if args.step_log:
        raise ValueError("--step-log records one engine's steps; not with --data-parallel-size > 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")
    config = replace(config, num_threads=replica_threads(config, n))
    template = load_chat_template(args.chat_template) if args.chat_template else None
    tenants = TenantSettings.from_cli_args(args, os.environ.get(API_KEY_ENV))
    names = args.served_model_name or [default_model_name(config.model)]
    tokenizer = load_tokenizer(config.model)
    if template is not None:
        from inflight.tokenizer import check_chat_template

        tokenizer.chat_template = template  # templating happens here, in the ingress
        check_chat_template(tokenizer, args.chat_template)
    sock = _bind_socket(args.host, args.port)
    log_level = getattr(args, "log_level", "info")
    runtime = RayRuntime(args.ray_address,
                         num_cpus=max(os.cpu_count() or 1, n * (config.num_threads or 1)))
    engine: ClusterEngine | None = None
    server = None
    previous = {}
    try:
        engine = ClusterEngine(config, num_replicas=n, model_name=names[0], tokenizer=tokenizer,
                               router=args.router, router_threshold=args.router_threshold,
                               max_num_waiting=args.max_num_waiting,
                               stats_window_s=args.stats_window,
                               log_interval_s=args.stats_log_interval, log_level=log_level,
                               watchdog_timeout_s=args.watchdog_timeout)
        app = build_app(engine, model_names=names, tenants=tenants,  # type: ignore[arg-type]
                        max_body_bytes=args.max_request_body_bytes,
                        stats_window_s=args.stats_window, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        max_tokens_default=args.max_tokens_default)
        cluster_metrics.install(app, engine)
        uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level.lower(),
                                   access_log=args.access_log, lifespan="on",
                                   timeout_graceful_shutdown=_CLOSE_GRACE_S)  # type: ignore[arg-type]
        server = _Server(uv_config, engine, args.shutdown_timeout)  # type: ignore[arg-type]
        logger.info("serving %s on http://%s:%d from %d replicas x %d threads, router %s "
                    "(%s)", names[0], args.host, args.port, n, config.num_threads,
                    args.router, describe_tenants(tenants))
        previous = {sig: signal.signal(sig, lambda *_: None)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if engine is not None:
            engine.shutdown()
        runtime.stop()
    return 0 if server is not None and server.started else 1
