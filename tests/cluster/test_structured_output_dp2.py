"""The one-engine structured-output suite (``tests/server/test_structured_output.py``)
against ``--data-parallel-size 2``: grammars compiled in the ingress (to refuse a bad spec
with a 400) and again in each replica that runs the request."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'inflight-serve[cluster]'")

from tests.server.test_structured_output import *  # noqa: E402,F401,F403  (the tests and their client fixture)
from tests.cluster.dp2_server import dp2_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster_server():
    yield from dp2_server()


@pytest.fixture(scope="module")
def server(cluster_server):  # noqa: F811  (replaces the one-engine fixture)
    return cluster_server[0]


@pytest.fixture(scope="module")
def real_engine(cluster_server):  # noqa: F811
    return cluster_server[1]
