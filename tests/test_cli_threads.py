"""The CLI bounds OpenMP's spin-wait before torch loads libgomp, and leaves a user's own
setting alone (docs/performance.md, "A busy neighbour").

libgomp prints the settings it read when ``OMP_DISPLAY_ENV=verbose`` is set, so the
subprocess tests read the spin count PyTorch's own libgomp actually took.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inflight import cli
from inflight.config import EngineConfig


def test_sets_the_bounded_spin_in_an_environment_without_one():
    env: dict[str, str] = {"PATH": "/bin"}
    assert cli.bound_openmp_spin(env, loaded=set()) == "300"
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "300"}


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "5000"), ("GOMP_SPINCOUNT", "infinite"),
                                         ("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_WAIT_POLICY", "")])
def test_a_users_wait_setting_is_left_alone(name, value):
    env = {name: value}
    assert cli.bound_openmp_spin(env, loaded=set()) is None
    assert env == {name: value}


def test_nothing_is_set_once_torch_is_loaded():
    env: dict[str, str] = {}
    assert cli.bound_openmp_spin(env, loaded={"torch", "numpy"}) is None
    assert env == {}


def _libgomp_settings(code: str, **env: str) -> dict[str, str]:
    """Run ``code`` (which imports torch) in a fresh interpreter; libgomp's settings as it
    printed them: ``{"GOMP_SPINCOUNT": "'300'", ...}``."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code],
                         env={**base, **env, "OMP_DISPLAY_ENV": "verbose"},
                         capture_output=True, text=True, timeout=120, check=True)
    rows = (line.strip().split(" = ", 1) for line in out.stderr.splitlines() if " = " in line)
    return {k: v for k, v in rows}


MAIN_THEN_TORCH = """
import sys
from inflight import cli
assert "torch" not in sys.modules, "importing the CLI must not load torch"
try:
    cli.main(["--help"])
except SystemExit:
    pass
import torch
torch.ones(2).sum()
"""


def test_main_sets_the_spin_before_torch_loads_libgomp():
    assert _libgomp_settings(MAIN_THEN_TORCH)["GOMP_SPINCOUNT"] == "'300'"


def test_main_keeps_a_users_spin_count():
    assert _libgomp_settings(MAIN_THEN_TORCH, GOMP_SPINCOUNT="20000")["GOMP_SPINCOUNT"] == "'20000'"


def test_without_the_cli_libgomp_spins_its_own_default():
    # What a plain `import torch` gets: 300,000 pauses, 13 ms on this host, which collapses
    # a step beside a busy neighbour; the reason the CLI sets a bound at all.
    assert _libgomp_settings("import torch")["GOMP_SPINCOUNT"] == "'300000'"


def test_default_thread_count_follows_the_affinity():
    # --num-threads left unset: torch's pool takes one thread per CPU the process may run
    # on (libgomp reads the affinity when it loads), so a server started under taskset
    # does not put two threads on one core.
    assert EngineConfig().num_threads is None
    cpu = min(os.sched_getaffinity(0))
    pinned = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
                            capture_output=True, text=True, timeout=120, check=True)
    assert pinned.stdout.strip() == "1"
