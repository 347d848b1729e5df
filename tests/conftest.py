"""Shared fixtures: fake runner for torch-free engine tests, the bundled model path."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.bench.datasets import default_data_dir
from inflight.core.output import SampleResult

# Workload data: ../shared/data next to the checkout, as CI lays it out, or
# $INFLIGHT_DATA_DIR (the bench tool's own lookup).
DATA_DIR = default_data_dir()


def require_data(name: str) -> Path:
    """Path of a shared data file; skips the calling test, saying where it looked, if absent."""
    path = DATA_DIR / name
    if not path.is_file():
        pytest.skip(f"{path} not found: put the shared data folder next to the checkout "
                    f"or set INFLIGHT_DATA_DIR")
    return path


class FakeRunner:
    """Stands in for ``ModelRunner``: every sampling row gets ``token_id``.

    Records each step's ``SchedulerOutput`` so tests can assert exact schedules.
    """

    def __init__(self, token_id: int = 7) -> None:
        self.token_id = token_id
        self.steps = []

    def execute(self, out):
        self.steps.append(out)
        return [SampleResult(s.request, self.token_id, None) for s in out.scheduled if s.samples]


@pytest.fixture
def fake_runner():
    return FakeRunner()


@pytest.fixture(scope="session")
def bundled_model_path():
    from inflight.model.bundled import find_bundled_model
    return find_bundled_model()
