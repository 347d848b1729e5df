"""The one-engine server's OpenAI API suite (``tests/server/test_openai_api.py``), run
against ``--data-parallel-size 2``: the same test functions, with the ``server`` fixture
backed by two Ray replicas (1 thread each) behind ``ClusterEngine``."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'inflight-serve[cluster]'")

from tests.server.test_openai_api import *  # noqa: E402,F401,F403  (the tests and their client fixtures)
from tests.cluster.dp2_server import dp2_server  # noqa: E402
from tests.server.conftest import API_KEY  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster_server():
    yield from dp2_server(api_key=API_KEY)


@pytest.fixture(scope="module")
def server(cluster_server):  # noqa: F811  (replaces the one-engine fixture)
    return cluster_server[0]


@pytest.fixture(scope="module")
def real_engine(cluster_server):  # noqa: F811  (the tests read only its tokenizer)
    return cluster_server[1]
