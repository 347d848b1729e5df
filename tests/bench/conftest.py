"""Fixtures for the bench tests: a fake OpenAI server in-process, the shared data folder."""

from __future__ import annotations

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
# The fake server module lives next to the tests; make it importable whatever the import mode.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_fake_openai import FakeServer, ServerState  # noqa: E402

from tests.conftest import DATA_DIR, require_data  # noqa: E402


@pytest.fixture
def data_dir() -> pathlib.Path:
    require_data("vllm_sonnet.txt")
    return DATA_DIR


@pytest.fixture
def fake_server():
    """A factory: ``fake_server(state)`` starts a FakeServer, stopped at teardown."""
    started = []

    def start(state: ServerState | None = None) -> FakeServer:
        srv = FakeServer(state).__enter__()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.__exit__(None, None, None)
