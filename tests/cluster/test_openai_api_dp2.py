"""The one-engine server's OpenAI API suite (``tests/server/test_openai_api.py``), run
against ``--data-parallel-size 2``: the same test functions, with the ``server`` fixture
backed by two Ray replicas (1 thread each) behind ``ClusterEngine``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'inflight-serve[cluster]'")

from tests.server.test_openai_api import *  # noqa: E402,F401,F403  (the tests and their client fixtures)
from inflight.cluster import metrics as cluster_metrics  # noqa: E402
from inflight.cluster.client import ClusterEngine  # noqa: E402
from inflight.cluster.runtime import RayRuntime  # noqa: E402
from inflight.config import EngineConfig  # noqa: E402
from inflight.server.app import build_app  # noqa: E402
from tests.server.conftest import API_KEY, MODEL, SMALL_CONFIG, ServerThread  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster_server():
    runtime = RayRuntime(None, num_cpus=2)
    engine = ClusterEngine(EngineConfig(**SMALL_CONFIG, num_threads=1), num_replicas=2,
                           model_name=MODEL, log_interval_s=0, log_level="WARNING")
    app = build_app(engine, model_names=[MODEL], api_key=API_KEY)  # type: ignore[arg-type]
    cluster_metrics.install(app, engine)
    srv = ServerThread(app).start()
    yield srv, engine
    srv.stop()
    engine.shutdown()
    runtime.stop()


@pytest.fixture(scope="module")
def server(cluster_server):  # noqa: F811  (replaces the one-engine fixture)
    return cluster_server[0]


@pytest.fixture(scope="module")
def real_engine(cluster_server):  # noqa: F811  (the tests read only its tokenizer)
    return SimpleNamespace(tokenizer=cluster_server[1].tokenizer)
