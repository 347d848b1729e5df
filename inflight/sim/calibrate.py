"""``bench capacity --calibrate``: predict the operating limit from the server's own steps.

The server under test is started with ``--step-log`` (``bench.connect.calibration`` adds it
to an ``inflight serve`` command). Before the search, a calibration ramp (``bench.ramp``) loads
it up to saturation; a profile is fitted to the step log so far (``fitted_cost.fit_cost_model``
on the back-to-back steps, as ``inflight profile --from-step-log`` does), and the same
capacity search, holds included, runs on the simulator with that profile and the same
request mix, SLO and thresholds: the predicted limit, in seconds. The real search then
starts at the prediction and verifies around it (``limit.find_limit``).

A prediction is not used silently when it cannot be trusted (``profile.profile_warnings``:
a fit whose mean error over the steps is high, too few steps, or other processes busy on
the host during the ramp, ``bench.machine.HostMonitor``): it is then unusable, with notes
that say why, and the search runs as it would without ``--calibrate``.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable, Sequence

from inflight.bench.datasets import RequestSpec
from inflight.bench.limit import Prediction, SearchSpace, find_limit
from inflight.bench.machine import HostMonitor, describe_machine
from inflight.bench.ramp import run_ramp
from inflight.bench.session import Session
from inflight.bench.simulation import SearchPlan
from inflight.bench.summary import SLO
from inflight.sim.acceptance import acceptance_of
from inflight.sim.bench import ServeParser, open_sim_session, parse_serve_command, sim_setup
from inflight.sim.fitted_cost import fit_cost_model, summary_line
from inflight.sim.profile import StepProfile, profile_warnings, sample_row, save_profile
from inflight.sim.steplog import read_step_logs

SIMULATED_MAX_HOLDS = 12  # 1.1**-12: down to a third of the search's limit


def fit_step_log(path: str | pathlib.Path, host: dict[str, Any] | None = None,
                 ) -> tuple[StepProfile, dict[str, Any]]:
    """A serving profile fitted to a step log, and its fit errors by step kind (mean and
    p95 |error| in %, steps); ``host``: the host's load while it was logged (saved in the
    profile's machine). ValueError when the log holds no back-to-back steps."""
    header, shapes, seconds = read_step_logs([path])
    if not shapes:
        raise ValueError(f"{path}: no back-to-back steps logged yet")
    cost = fit_cost_model(shapes, seconds)
    errors = {kind: {"mean_abs_pct": fit.error.get("in_sample_mean_abs_pct"),
                     "p95_abs_pct": fit.error.get("in_sample_p95_abs_pct"),
                     "steps": int(fit.error.get("steps", 0)), "summary": summary_line(fit)}
              for kind, fit in cost.fits.items()}
    machine = {**describe_machine(), "step_logs": [str(path)], "host_load": host}
    profile = StepProfile("serving (calibration ramp)", cost, header["engine"], header["model"], machine,
                          samples=[sample_row(s, t) for s, t in zip(shapes, seconds)],
                          acceptance=acceptance_of(header.get("spec_decode")))
    return profile, errors


class CalibratedPredictor:
    """A ``limit.Predictor`` for the server started by ``command``, logging its steps to
    ``step_log`` (module doc), for the search ``plan``; ``parse_serve`` reads the command's
    engine settings. ``pids``: the server's processes (ours, for the host check; filled
    when it starts); ``ramp_start``: the ramp's first rate in req/s (default: half the
    search's start load); ``profile_out``: where the fitted profile is saved (for
    ``--simulate`` what-ifs afterwards)."""

    def __init__(self, step_log: str | pathlib.Path, command: str, plan: SearchPlan, parse_serve: ServeParser,
                 pids: Sequence[int] = (), ramp_start: float | None = None,
                 profile_out: str | pathlib.Path = "profile-calibrated.json") -> None:
        self.step_log, self.command, self.pids, self.parse_serve = step_log, command, pids, parse_serve
        self.load, self.dataset, self.base = plan.load, plan.dataset, plan.base
        # Simulated holds cost seconds: step down until one holds (a real search's few
        # holds can all fail near a metastable limit, which would leave no prediction).
        space = plan.space
        self.space = replace(space, repeats=1, max_holds=max(space.max_holds, SIMULATED_MAX_HOLDS))
        self.thresholds = plan.thresholds
        self.ramp_start, self.profile_out = ramp_start, profile_out
        self.outputs: list[tuple[RequestSpec, int]] = []
        self.ramped = False
        self.host: dict[str, Any] | None = None

    async def predict(self, session: Session, slo: SLO) -> Prediction:
        """Ramp the server to saturation (``bench.ramp``), fit its steps, simulate the
        search for ``slo``. Another search's prediction (the next ``--slo-tiers`` tier) does
        not ramp again: it simulates with every step logged so far."""
        t0 = time.perf_counter()
        if self.ramped:
            return await self._simulate(t0, slo, {"ramp": "the first prediction's"})
        self.ramped = True
        monitor = HostMonitor(self.pids).start()
        start = self.ramp_start or _ramp_rate(session, self.space)
        ramp = await run_ramp(session, start, seed=self.base.seed)
        load = monitor.stop()
        self.host = load.to_json() if load else None
        self.outputs = list(ramp.outputs)
        return await self._simulate(t0, slo, {"ramp": ramp.to_json()})

    async def refine(self, session: Session, slo: SLO) -> Prediction:
        """Fit again with every step logged so far (the search's first point ran near the
        limit: steady steps of the shapes that decide it), simulate again."""
        return await self._simulate(time.perf_counter(), slo, {})

    async def _simulate(self, t0: float, slo: SLO, details: dict[str, Any]) -> Prediction:
        profile, errors = fit_step_log(self.step_log, self.host)
        save_profile(self.profile_out, profile)
        warnings = profile_warnings(profile)
        notes = [note for note, _ in warnings]
        blocking = any(block for _, block in warnings)
        if profile.acceptance is None and parse_serve_command(self.command, self.parse_serve)[0].speculative_config:
            notes.append("the server verified no drafts during the ramp: no acceptance rates to simulate "
                         "its speculative decoding with")
            return Prediction(None, None, False, notes, time.perf_counter() - t0, {**details, "host": self.host})
        quiet = io.StringIO()  # the notes say what the profile's warnings would
        with contextlib.redirect_stderr(quiet):
            setup = sim_setup(str(self.profile_out), self.command, self.parse_serve)
            setup.calibrate_outputs(self.outputs)
            sim_session = await open_sim_session(self.load, self.dataset, setup)
            res = await find_limit(_connect(sim_session), self.base, slo, self.space, self.thresholds,
                                   log=quiet)
        found, first_fail = res.limits[0], res.failed_above[0]
        limit = None if found is None else _load(self.space, found)
        above = None if first_fail is None else _load(self.space, first_fail)
        if limit is None:
            notes.append("the simulation found no load that meets the SLO")
            blocking = True
        details = {**details, "host": self.host, "fit": errors, "outputs_learned": len(setup.output_lengths),
                   "profile": str(self.profile_out),
                   "simulated_points": [{k: p[k] for k in ("x", "passed", "held", "reasons")} for p in res.curve]}
        return Prediction(limit, above, not blocking, notes, time.perf_counter() - t0, details)


def _connect(session: Session) -> Callable[[], Awaitable[Session]]:
    async def connect() -> Session:
        return session
    return connect


def _load(space: SearchSpace, x: float) -> float:
    """A limit as the user sees it (``SearchSpace.x``) back to search units."""
    return 1 / x if space.by_scale else x


def _ramp_rate(session: Session, space: SearchSpace) -> float:
    """Half the search's start load in req/s (a trace's load is 1 / time scale times its
    own mean rate)."""
    if not space.by_scale:
        return max(space.start / 2, 0.05)
    times = [s.trace_time for s in session.specs if s.trace_time is not None]
    span = (max(times) - min(times)) if len(times) > 1 else 0.0
    own = (len(times) - 1) / span if span > 0 else 1.0
    return max(space.start * own / 2, 0.05)
