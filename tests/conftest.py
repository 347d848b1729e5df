"""Shared fixtures: fake runner for torch-free engine tests, the bundled model path; the
``isa`` mark on the tests whose numbers depend on the CPU's instruction-set path."""

from __future__ import annotations

import os
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


# Kernels, model numerics and greedy texts: their results depend on which instruction set
# the kernels and oneDNN use (AMX tiles, AVX-512, AVX2), so `make test` runs them again
# under each path this host can emulate (tests/isa_paths.py).
ISA_SENSITIVE = ("tests/model/", "tests/e2e/")


def pytest_collection_modifyitems(config, items):
    root = Path(str(config.rootpath))
    for item in items:
        rel = Path(str(item.path)).relative_to(root).as_posix()
        if rel.startswith(ISA_SENSITIVE):
            item.add_marker(pytest.mark.isa)


def pytest_report_header(config):
    """Which instruction-set path this run's numerics take (issue 29: a bound tuned on one
    path failed on the other; issue 50: a property held on one path only)."""
    try:
        import torch

        from inflight.model.kernels.gemm import gemm_path
        from inflight.model.kernels.native_lib import host_isa, isa_path, onednn_has_amx
        path, own = isa_path(), host_isa()
        gemm = {str(d).removeprefix("torch."): gemm_path(d) for d in (torch.bfloat16, torch.float32)}
        amx = onednn_has_amx()
    except Exception as e:  # noqa: BLE001 - a header must not stop the run
        return f"cpu path: unknown ({type(e).__name__})"
    return (f"cpu path: {path}{' (emulated on an ' + str(own) + ' host)' if path != own else ''}; "
            f"prompt GEMM {gemm}; oneDNN {'with' if amx else 'without'} AMX tiles "
            f"(ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'ALL')})")


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
