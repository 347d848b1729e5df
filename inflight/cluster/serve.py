"""``inflight serve --data-parallel-size N`` (N > 1): the app in this process, N engine
replicas as Ray actors (``ray_engine.ClusterEngine``), Ray started here or joined.

``RayReplicas`` is the ``EngineLauncher`` that ``server.lifecycle.run_serve`` (the one
launch path) is given (``inflight/cli.py``), so the OpenAI API, admission, drain on SIGINT/SIGTERM and exit are
the one-engine server's; on exit every replica is killed and a Ray started here is shut
down with its processes.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from fastapi import FastAPI

from inflight.cluster import replica_metrics as cluster_metrics
from inflight.cluster.ray_engine import ClusterEngine
from inflight.cluster.replica_state import load_tokenizer
from inflight.cluster.runtime import RayRuntime
from inflight.config import EngineConfig, ServingConfig
from inflight.engine.engine_client import EngineClient


def replica_threads(config: EngineConfig, num_replicas: int) -> int:
    """Torch threads per replica: ``--num-threads``, else this machine's cores shared out
    (at least 1)."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // num_replicas)


class RayReplicas:
    """``args.data_parallel_size`` engine replicas on Ray behind one ``ClusterEngine``.

    Args:
        args: the parsed ``serve`` flags.

    Raises:
        ValueError: a bad flag (engine flags as one engine; ``--step-log`` is one engine's).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        if args.step_log:
            raise ValueError("--step-log records one engine's steps; not with "
                             "--data-parallel-size > 1")
        self.args = args
        self.num_replicas: int = args.data_parallel_size
        config = EngineConfig.from_cli_args(args)
        self.config = replace(config, num_threads=replica_threads(config, self.num_replicas))
        self._tokenizer: Any = None
        self._runtime: RayRuntime | None = None
        self._client: ClusterEngine | None = None

    def prepare(self, chat_template: str | None) -> None:
        """Load the tokenizer: templating and tokenizing happen here, in the ingress.
        Raises ``FileNotFoundError`` (no model), ``UnsafeChatTemplateError``."""
        self._tokenizer = load_tokenizer(self.config.model)
        if chat_template is not None:
            from inflight.tokenizer import check_chat_template

            self._tokenizer.chat_template = chat_template
            check_chat_template(self._tokenizer, self.args.chat_template)

    def start(self, serving: ServingConfig, model_name: str) -> EngineClient:
        """Start (or join) Ray and the replicas; returns once every engine is loaded.
        Raises ``RuntimeError`` (Ray missing, a replica that did not start)."""
        args, n = self.args, self.num_replicas
        self._runtime = RayRuntime(args.ray_address,
                                   num_cpus=max(os.cpu_count() or 1, n * (self.config.num_threads or 1)))
        self._client = ClusterEngine(
            self.config, num_replicas=n, model_name=model_name, tokenizer=self._tokenizer,
            router=args.router, router_threshold=args.router_threshold,
            max_num_waiting=serving.max_num_waiting, stats_window_s=args.stats_window,
            log_interval_s=args.stats_log_interval, log_level=getattr(args, "log_level", "info"),
            watchdog_timeout_s=args.watchdog_timeout)
        return self._client

    def install(self, app: FastAPI, client: EngineClient) -> None:
        """``/metrics`` and ``/stats`` across replicas (``replica_metrics``)."""
        assert self._client is not None and client is self._client
        cluster_metrics.install(app, self._client)

    def describe(self) -> str:
        return (f" from {self.num_replicas} replicas x {self.config.num_threads} threads, "
                f"router {self.args.router}")

    def stop(self) -> None:
        """Kill the replicas; stop a Ray started here."""
        if self._client is not None:
            self._client.shutdown()
        if self._runtime is not None:
            self._runtime.stop()

