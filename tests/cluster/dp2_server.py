"""A two-replica server on Ray for running the one-engine server suites against
``--data-parallel-size 2`` (``test_*_dp2.py``): their ``server`` and ``real_engine``
fixtures, replaced."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from inflight.cluster import replica_metrics as cluster_metrics
from inflight.cluster.ray_engine import ClusterEngine
from inflight.cluster.runtime import RayRuntime
from inflight.config import EngineConfig
from inflight.server.app import build_app
from tests.server.conftest import MODEL, SMALL_CONFIG, ServerThread


def dp2_server(**app_kwargs: Any) -> Iterator[tuple[ServerThread, Any]]:
    """Ray, two replicas (1 thread, the suites' small KV pool each) and the app around
    them; yields ``(server thread, real_engine stand-in with the tokenizer)``, then stops
    it all."""
    runtime = RayRuntime(None, num_cpus=2)
    engine = ClusterEngine(EngineConfig(**SMALL_CONFIG, num_threads=1), num_replicas=2,
                           model_name=MODEL, log_interval_s=0, log_level="WARNING")
    app = build_app(engine, model_names=[MODEL], **app_kwargs)
    cluster_metrics.install(app, engine)
    srv = ServerThread(app).start()
    try:
        yield srv, SimpleNamespace(tokenizer=engine.tokenizer)
    finally:
        srv.stop()
        engine.shutdown()
        runtime.stop()
