"""The simulator as ``inflight bench`` uses it (``bench.simulation.Simulator``): sessions
simulated on a profile (``--simulate``), and limits predicted from a real server's own steps
(``--calibrate``). The command line hands it ``inflight serve``'s parser, which reads the
engine settings of a ``--serve-cmd``."""

from __future__ import annotations

from inflight.bench.datasets import DatasetConfig
from inflight.bench.limit import Predictor
from inflight.bench.session import LoadConfig, Session
from inflight.bench.simulation import SearchPlan, SimulateOptions
from inflight.sim.bench import ServeParser, open_sim_session, parse_serve_command, sim_setup
from inflight.sim.calibrate import CalibratedPredictor


class BenchSimulator:
    """``bench.simulation.Simulator`` on :mod:`inflight.sim`; ``parse_serve``: ``inflight
    serve``'s argument parser (its flags after ``serve`` -> Namespace)."""

    def __init__(self, parse_serve: ServeParser) -> None:
        self.parse_serve = parse_serve

    def check_command(self, command: str) -> None:
        parse_serve_command(command, self.parse_serve)

    async def open_session(self, options: SimulateOptions, load: LoadConfig, dataset: DatasetConfig,
                           command: str | None) -> Session:
        setup = sim_setup(options.profile, command, self.parse_serve, options.replicas, options.router)
        return await open_sim_session(load, dataset, setup)

    def predictor(self, command: str, step_log: str, profile_out: str, pids: list[int],
                  plan: SearchPlan) -> Predictor:
        return CalibratedPredictor(step_log, command, plan, self.parse_serve, pids, profile_out=profile_out)
