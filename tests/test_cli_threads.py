"""The CLI leaves how OpenMP waits to libgomp and the user (issue 51): a busy neighbour is met
by the model's thread team (model/thread_team.py, tests/test_thread_team.py), not by a spin
bound fixed at import, which cost one stream 2.5x on an Intel KVM host.

libgomp prints the settings it read when ``OMP_DISPLAY_ENV=verbose`` is set, so the
subprocess tests read the spin count PyTorch's own libgomp actually took.
"""

from __future__ import annotations

import os
import subprocess
import sys

from inflight.config import EngineConfig


def _libgomp_settings(code: str, **env: str) -> dict[str, str]:
    """Run ``code`` (which imports torch) in a fresh interpreter; libgomp's settings as it
    printed them: ``{"GOMP_SPINCOUNT": "'300000'", ...}``."""
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


def test_the_cli_leaves_libgomps_own_spin():
    assert _libgomp_settings(MAIN_THEN_TORCH)["GOMP_SPINCOUNT"] == "'300000'"


def test_the_cli_keeps_a_users_spin_count():
    assert _libgomp_settings(MAIN_THEN_TORCH, GOMP_SPINCOUNT="20000")["GOMP_SPINCOUNT"] == "'20000'"


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
