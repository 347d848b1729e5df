"""The operating limit of one server configuration: capacity searches over sustained points.

``find_limit`` runs ``--repeats`` searches (``capacity.search``), each point a windowed
``run_point`` judged by ``sustain.judge``, and returns a :class:`LimitResult`: the limit per
repeat, the bracket above it, every point with its evidence and a compact timeline (the
in-flight count and the server's gauges over time, for the report's plots).

Points can come from a cache (``PointCache``: ``bench tune``'s saved state), so a killed
run replays what it measured and continues. The server and the session are opened only
when a point is not cached (``connect``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Protocol, TextIO


from inflight.bench import capacity as cap
from inflight.bench.limit_doc import best_point, crossings, lost_because, shed_note
from inflight.bench.session import ArrivalConfig, PointResult, Session, run_point
from inflight.bench.summary import SLO
from inflight.bench.sustain import Thresholds, evidence_lines


@dataclass
class SearchSpace:
    """What a search varies: the request rate, (trace replay) 1 / time scale, or
    (``users``) the number of concurrent users, a whole number."""

    by_scale: bool
    start: float
    lo: float
    hi: float
    tolerance: float = 0.1
    max_points: int = 12
    repeats: int = 1
    hold_duration: float | None = None  # s: hold each search's limit this long before reporting it
    max_holds: int = 3
    max_extensions: int = 2  # an undecided search point's window grows this many times at most
    hold_looks: int = 3  # a hold is judged at each third of its window; a conclusive failure ends it
    users: bool = False

    def x(self, load: float | None) -> float | None:
        """The load as the user set it: a rate, a time scale, or users."""
        return None if load is None else (1 / load if self.by_scale else load)

    def describe(self, load: float) -> str:
        if self.users:
            return f"users={load:.0f}"
        return f"time_scale={1 / load:.4g}" if self.by_scale else f"rate={load:.4g}"

    @property
    def unit(self) -> str:
        return "users" if self.users else "time scale" if self.by_scale else "req/s"

    @property
    def name(self) -> str:
        """The search's name in a result: rate, time_scale or users."""
        return "users" if self.users else "time_scale" if self.by_scale else "rate"

    @property
    def grid(self) -> float | None:
        """Loads are whole users; rates and time scales are continuous."""
        return 1.0 if self.users else None

    def arrival(self, base: ArrivalConfig, load: float, repeat: int, held: bool = False) -> ArrivalConfig:
        """The point's arrivals. A search point's window may be extended ``max_extensions``
        times while undecided. ``held``: a window ``hold_duration`` long, judged at each of
        ``hold_looks`` equal parts (it ends early only on a conclusive failure), warm-up and
        drain as the search's."""
        extra: dict[str, Any] = {"max_extensions": self.max_extensions}
        if held:
            warm, drain = base.phases()
            assert self.hold_duration is not None
            part = self.hold_duration / max(1, self.hold_looks)
            extra = {"duration": part, "warmup_duration": warm, "drain_timeout": drain,
                     "max_extensions": max(1, self.hold_looks) - 1, "extend_on_pass": True}
            if base.duration and base.min_requests:
                # The sample grows with the window: a hold of 5 windows counts >= 5x the requests.
                extra["min_requests"] = math.ceil(base.min_requests * part / base.duration)
        if self.users:
            extra["users"] = int(round(load))
        elif self.by_scale:
            extra["time_scale"] = 1 / load
        else:
            extra["rate"] = load
        return replace(base, seed=base.seed + repeat, **extra)


@dataclass
class Prediction:
    """The operating limit the simulator predicts from a profile fitted to this server's
    own steps (``bench capacity --calibrate``; loads in search units: a rate or 1 / time
    scale). ``usable`` is False when the fit or the host cannot be trusted: the search then
    starts where it was told, and ``notes`` say why."""

    limit: float | None
    failed_above: float | None
    usable: bool
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"limit": self.limit, "failed_above": self.failed_above, "usable": self.usable,
                "notes": self.notes, "seconds": self.seconds, **self.details}


class Predictor(Protocol):
    """Predicts a configuration's operating limit before its real search
    (``sim.calibrate.CalibratedPredictor``): ``predict`` once (it may load the server to
    learn it), ``refine`` after the search's first point, with what the server did there;
    both for the search's own ``slo`` (each ``--slo-tiers`` tier has its own)."""

    async def predict(self, session: Session, slo: SLO) -> Prediction: ...
    async def refine(self, session: Session, slo: SLO) -> Prediction: ...


@dataclass
class LimitResult:
    """One configuration's operating limit over its repeats (loads as ``SearchSpace.x``)."""

    label: str | None
    limits: list[float | None]  # per repeat
    failed_above: list[float | None]  # per repeat: the lowest failing load above the limit
    bounded: bool
    curve: list[dict[str, Any]] = field(default_factory=list)  # every point, with repeat, x and held
    fixed: dict[str, Any] = field(default_factory=dict)
    command: str | None = None
    held: bool = False  # limits are loads that held for SearchSpace.hold_duration
    prediction: Prediction | None = None
    targets: dict[str, float] = field(default_factory=dict)  # SLO key -> target (s), for the crossings

    @property
    def spread(self) -> dict[str, Any]:
        return cap.spread(self.limits)

    @property
    def best_point(self) -> dict[str, Any] | None:
        """The point that set the highest limit (see :func:`limit_doc.best_point`)."""
        return best_point(self.to_json())

    def lost_because(self) -> list[str]:
        """Why loads above the limit failed (see :func:`limit_doc.lost_because`)."""
        return lost_because(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {"value": self.label, "command": self.command, "limits": self.limits,
                "failed_above": self.failed_above, "spread": self.spread, "bounded": self.bounded,
                "held": self.held, "fixed": self.fixed, "curve": self.curve,
                "crossings": crossings(self.curve, self.targets),
                "prediction": None if self.prediction is None else self.prediction.to_json()}


class PointCache(Protocol):
    """Saved points of one configuration, by repeat, load and kind (``bench tune``'s state)."""

    fixed: dict[str, Any] | None  # the session's fixed conditions, saved with the first point

    def get(self, repeat: int, load: float, held: bool = False) -> dict[str, Any] | None: ...
    def put(self, repeat: int, load: float, point: dict[str, Any], fixed: dict[str, Any],
            held: bool = False) -> None: ...


Connect = Callable[[], Awaitable[Session]]

# Points measured for one SLO and judged again for another (``--slo-tiers``), by (repeat,
# load, held): the records do not depend on the targets, only how long the point ran.
SharedPoints = dict[tuple[int, float, bool], PointResult]


async def find_limit(connect: Connect, base: ArrivalConfig, slo: SLO, space: SearchSpace,
                     thresholds: Thresholds, label: str | None = None, cache: PointCache | None = None,
                     hold: bool = True, log: TextIO | None = None, predictor: Predictor | None = None,
                     shared: SharedPoints | None = None) -> LimitResult:
    """Search ``space.repeats`` times for the highest sustained load, each search's limit
    then held for ``space.hold_duration`` s (unless ``hold`` is False or it is unset; see
    ``capacity``). ``connect`` returns the session (starting the server where needed); it is
    called only when a point is measured, not replayed from ``cache``. ``predictor``: first
    predict the limit (``Prediction``); where usable, each search starts there and steps by
    ``1 + tolerance`` (verify around it) instead of from ``space.start`` by doubling, and
    its second point goes where the prediction refined by the first point says
    (``capacity.search``'s ``advise``). ``shared``: points other searches measured, judged
    again for ``slo`` where they suffice (``PointResult.rejudged``), and this search's added.
    """
    run = _LimitRun(connect, base, slo, space, thresholds, cache, log or sys.stderr, predictor)
    run.shared = shared
    start, step = await run.start()
    holding = hold and bool(space.hold_duration)
    limits: list[float | None] = []
    above: list[float | None] = []
    curve: list[dict[str, Any]] = []
    bounded = True
    for rep in range(space.repeats):
        res = await cap.search(run.measure(rep, held=False), start, space.lo, space.hi, space.tolerance,
                               space.max_points, step, run.advise if rep == 0 else None, space.grid)
        limit, first_fail = res.limit, res.failed_above
        bounded &= res.bounded
        curve += run.curve_points(res.points, rep, held=False)
        if holding:
            held = await cap.hold(res, run.measure(rep, held=True), space.tolerance, space.lo, space.max_holds,
                                  space.grid)
            curve += run.curve_points(held.holds, rep, held=True)
            limit = held.limit
            fails = [x for x in (first_fail, held.failed_above) if x is not None]
            first_fail = min(fails) if fails else None
        limits.append(space.x(limit))
        above.append(space.x(first_fail))
    fixed = run.fixed
    if not fixed and cache is not None:
        fixed = cache.fixed or {}
    if run.prediction is not None and run.refined:
        run.prediction.details["refined"] = [r.to_json() for r in run.refined]
    return LimitResult(label, limits, above, bounded, curve, fixed, held=holding, prediction=run.prediction,
                       targets={f"{m}_{st}": t for (m, st), t in slo.aggregate.items()})


class _LimitRun:
    """What the searches of one ``find_limit`` share: the session (opened at the first
    point measured), its fixed conditions, the cache, and the prediction with its
    refinements."""

    def __init__(self, connect: Connect, base: ArrivalConfig, slo: SLO, space: SearchSpace,
                 thresholds: Thresholds, cache: PointCache | None, log: TextIO, predictor: Predictor | None):
        self.connect, self.base, self.slo, self.space = connect, base, slo, space
        self.thresholds, self.cache, self.log, self.predictor = thresholds, cache, log, predictor
        self.session: Session | None = None
        self.fixed: dict[str, Any] = {}
        self.prediction: Prediction | None = None
        self.refined: list[Prediction] = []
        self.shared: SharedPoints | None = None

    async def connected(self) -> Session:
        if self.session is None:
            self.session = await self.connect()
        return self.session

    async def start(self) -> tuple[float, float]:
        """Where each search starts and its first step's factor: ``space.start`` by doubling,
        or the usable prediction by ``1 + tolerance``."""
        space = self.space
        start, step = min(max(space.start, space.lo), space.hi), 2.0
        if self.predictor is None:
            return start, step
        self.prediction = await self.predictor.predict(await self.connected(), self.slo)
        _print_prediction(self.log, space, self.prediction)
        if self.prediction.usable and self.prediction.limit is not None:
            start, step = min(max(self.prediction.limit, space.lo), space.hi), 1 + space.tolerance
            note = long_window_note(space, self.base, start)
            if note:
                print(f"  {note}", file=self.log)
        return start, step

    async def advise(self) -> float | None:
        """The prediction refined with the first point's steps (``capacity.search``'s advice)."""
        pred = self.prediction
        if self.predictor is None or pred is None or not pred.usable or self.session is None:
            return None
        again = await self.predictor.refine(self.session, self.slo)
        self.refined.append(again)
        _print_prediction(self.log, self.space, again, refined=True)
        return again.limit if again.usable else None

    def measure(self, rep: int, held: bool) -> cap.Measure:
        """The measure of repeat ``rep``'s search points (``held``: its holds)."""
        async def measure(load: float) -> cap.PointOutcome:
            return await self._point(rep, held, load)
        return measure

    async def _point(self, rep: int, held: bool, load: float) -> cap.PointOutcome:
        """One point: replayed from the cache, else measured (and cached)."""
        hit = self.cache.get(rep, load, held) if self.cache is not None else None
        if hit is not None:
            outcome = cap.PointOutcome.from_json(hit)
            _print_point(self.log, self.space, load, outcome, cached=True, held=held)
            return outcome
        session = await self.connected()
        earlier = None if self.shared is None else self.shared.get((rep, load, held))
        verdict = None if earlier is None else earlier.rejudged(self.slo, self.thresholds)
        if earlier is not None and verdict is not None:
            point = earlier
        else:
            point = await run_point(session, self.space.arrival(self.base, load, rep, held), self.slo,
                                    self.thresholds)
            verdict = point.verdict(self.slo, self.thresholds)
            if self.shared is not None:
                self.shared[(rep, load, held)] = point
        self.fixed = session.fixed()  # after the point: the mix may have grown for it
        outcome = cap.PointOutcome(load, verdict.passed, verdict.reasons, point.summary, verdict.evidence,
                                   point.timeline())
        if self.cache is not None:
            self.cache.put(rep, load, outcome.to_json(), self.fixed, held)
        _print_point(self.log, self.space, load, outcome, held=held)
        return outcome

    def curve_points(self, points: list[cap.PointOutcome], rep: int, held: bool) -> list[dict[str, Any]]:
        """``points`` as the result's curve keeps them: with repeat, load as set, and kind."""
        return [{**p.to_json(), "repeat": rep, "x": self.space.x(p.load), "held": held} for p in points]


def long_window_note(space: SearchSpace, base: ArrivalConfig, load: float) -> str | None:
    """Say up front when points near ``load`` (req/s) take much longer than ``--duration``:
    a window lasts until ``min_requests`` arrivals (the fewest that bound the p95s), so at
    a low limit the run's time is set by the rate, not the flag. None when it is not so."""
    if space.by_scale or space.users or not base.duration or not base.min_requests or load <= 0:
        return None
    window = base.min_requests / load
    if window <= 1.5 * base.duration:
        return None
    return (f"at {load:.4g} req/s a window of {base.min_requests} requests lasts about {window:.0f} s "
            f"(--duration {base.duration:g} s): each point, and each extension, takes that long")


def _print_prediction(log: TextIO, space: SearchSpace, p: Prediction, refined: bool = False) -> None:
    unit = space.unit
    if p.limit is None:
        head = "no load met the SLO in the simulation"
    else:
        above = "" if p.failed_above is None else f" (fails at {space.x(p.failed_above):.4g})"
        head = f"{space.x(p.limit):.4g} {unit}{above}"
    if refined:
        use = "the next point goes there if it is past one step" if p.usable else "not used"
        print(f"  refined with the first point's steps: {head}, in {p.seconds:.0f} s; {use}", file=log)
    else:
        use = "verifying around it" if p.usable else "NOT USED: searching as without --calibrate"
        print(f"  predicted operating limit: {head}, in {p.seconds:.0f} s; {use}", file=log)
    for note in p.notes:
        print(f"      {note}", file=log)
    log.flush()


def _print_point(log: TextIO, space: SearchSpace, load: float, p: cap.PointOutcome, cached: bool = False,
                 held: bool = False) -> None:
    verdict = "pass" if p.passed else "FAIL: " + "; ".join(p.reasons)
    what = f"hold {space.hold_duration:g} s at " if held else ""
    print(f"  {what}{space.describe(load)}: {verdict}{' (saved point)' if cached else ''}", file=log)
    print(f"      {p95_line(p.summary)}", file=log)
    if p.evidence:
        for line in evidence_lines(p.evidence):
            print(f"      {line}", file=log)
        looks = p.evidence.get("looks") or []
        if len(looks) > 1:
            steps = [f"{lk['seconds']:.0f} s {lk['state']}"
                     + (f" ({', '.join(lk['undecided'])})" if lk.get("undecided") else "") for lk in looks]
            print(f"      looks: {' -> '.join(steps)}", file=log)
    log.flush()


def p95_line(summary: dict[str, Any]) -> str:
    """The point's measured p95s (completed requests) and throughput, printed on every point,
    pass or fail."""
    def ms(metric: str) -> str:
        v = (summary.get(metric) or {}).get("p95")
        return "-" if v is None else f"{v * 1000:.1f} ms"
    tput = summary.get("output_throughput")
    return (f"measured p95: TTFT {ms('ttft')}, ITL {ms('itl')}, TPOT {ms('tpot')}, E2E {ms('e2e')}; "
            f"{summary.get('completed', 0)} completed, "
            f"{'-' if tput is None else f'{tput:.1f}'} output tok/s")


def limit_line(res: LimitResult, by_scale: bool, unit: str | None = None, name: str | None = None) -> str:
    """One printable line: the limit, its spread over repeats, the bracket above it
    (``unit``: the search's, where not req/s or time scale; ``name``: what the result is
    of, default ``value=<label>``)."""
    unit = unit or ("time scale" if by_scale else "req/s")
    head = f"{name}: " if name else f"value={res.label}: " if res.label is not None else ""
    sp = res.spread
    shed = shed_note(res.curve)
    why = f"; {shed}" if shed else ""
    if not sp["found"]:
        if res.held and any(not p["held"] and p["passed"] for p in res.curve):
            return f"{head}no load held: every hold failed (see the points above){why}"
        return f"{head}no load met the SLO (lowest tried failed){why}"
    bound = "" if res.bounded else " (a lower bound: the highest load tried still passed)"
    above = [a for a in res.failed_above if a is not None]
    bracket = ""
    if above:
        # For a time scale, "above" the load is a smaller scale.
        edge = max(above) if by_scale else min(above)
        bracket = f"; failed at {edge:.4g}"
    held = " held" if res.held else " (searched, not held)"
    line = (f"{head}operating limit{held} {sp['mean']:.4g} {unit} (std {sp['std']:.3g}, min {sp['min']:.4g}, "
            f"max {sp['max']:.4g} over {sp['found']}/{sp['repeats']} repeats{bracket}){bound}")
    cross = crossings(res.curve, res.targets)
    parts = [f"{k} at {c['x']:.4g} {unit}" if c.get("x") is not None else f"{k} {c['where']}"
             for k, c in cross.items()]
    if parts:
        line += "; targets crossed: " + ", ".join(parts)
    if res.prediction is not None and res.prediction.limit is not None:
        line += (f"; predicted {space_x(res.prediction.limit, by_scale):.4g}"
                 f"{'' if res.prediction.usable else ' (not used)'}")
    return line + why


def space_x(load: float, by_scale: bool) -> float:
    """A search load as the user sees it (``SearchSpace.x``)."""
    return 1 / load if by_scale else load
