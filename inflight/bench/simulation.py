"""What bench asks of a simulator standing in for the server, for ``--simulate`` and
``--calibrate``. ``inflight.sim`` implements :class:`Simulator`, and the top-level command
line (``inflight bench``) hands one to :func:`inflight.bench.arguments.run_bench`: bench
itself imports no simulator, and a measuring run never loads one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from inflight.bench.datasets import DatasetConfig
from inflight.bench.limit import Predictor, SearchSpace
from inflight.bench.session import ArrivalConfig, LoadConfig, Session
from inflight.bench.summary import SLO
from inflight.bench.sustain import Thresholds


@dataclass(frozen=True)
class SimulateOptions:
    """``--simulate PROFILE.json``: the step-time profile, engine replicas, their router."""

    profile: str
    replicas: int = 1
    router: str = "prefix_affinity"


@dataclass(frozen=True)
class SearchPlan:
    """What every point of an operating-limit search measures: how requests are sent, the
    mix, the base arrivals, the SLO, the search and what a sustained point must show."""

    load: LoadConfig
    dataset: DatasetConfig
    base: ArrivalConfig
    slo: SLO
    space: SearchSpace
    thresholds: Thresholds


class Simulator(Protocol):
    """A simulator of the server under test: sessions whose points are simulated, and
    limits predicted from a real server's own steps."""

    def check_command(self, command: str) -> None:
        """ValueError unless ``command`` is an ``inflight serve ...`` command it can read."""

    async def open_session(self, options: SimulateOptions, load: LoadConfig, dataset: DatasetConfig,
                           command: str | None) -> Session:
        """A session simulated on ``options``' profile, with ``command``'s engine settings
        (else the profile's). ValueError: bad profile, command, replicas or router;
        FileNotFoundError: no profile, or its model file is gone."""

    def predictor(self, command: str, step_log: str, profile_out: str, pids: list[int],
                  plan: SearchPlan) -> Predictor:
        """A ``limit.Predictor`` for the server ``command`` starts, logging its steps to
        ``step_log``; the fitted profile saved to ``profile_out``; ``pids``: the server's
        processes, filled when it starts."""
