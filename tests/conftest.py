"""Shared fixtures: fake runner for torch-free engine tests, the bundled model path."""

from __future__ import annotations

import pytest

from inflight.sampler import SampleResult


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
