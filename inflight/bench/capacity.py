"""Capacity search: the highest load the server sustains while the SLOs hold.

Load is a positive number where larger is harder: the request rate (requests/s), or, for
trace replay, ``1 / time_scale`` (so the answer is the smallest time scale that passes).

Search (bracket, then bisect): measure the start load; double it while points pass (or
halve it while they fail), squaring the factor at each further step, until a pass and a
fail bracket the limit; then bisect the bracket at its geometric mean until
``hi / lo <= 1 + tolerance``. Started at a prediction (``bench capacity --calibrate``) the
first step is ``1 + tolerance`` instead of 2, so a good prediction is verified in two points. The limit is the highest passing
load measured; the lowest failing load above it bounds it from above. Latency grows steeply
near saturation, so the geometric mean treats a bracket [1, 100] and [10, 1000] alike.

Each point is a steady-state window, and it passes on the evidence of
:func:`inflight.bench.sustain.judge`: throughput keeps up with the offered rate, the queue
does not grow, every SLO statistic's confidence interval is within its target, nothing
failed, and preemptions stay under the threshold. A burst the server absorbs before its
queue has grown does not pass: the window outlasts it.

A one-minute window cannot tell a queue growing by a few percent of its arrivals from a
slow excursion (near saturation the in-flight count wanders on a time scale of tens of
seconds), and "keeps up" tolerates a 5 % shortfall: a load 5 % above what the server
completes can pass one window and break the SLO a few minutes later. So the search's limit
is then **held** (``hold``): measured again over a window several times longer; if it
fails, the load steps down by ``1 + tolerance`` and is held again, up to ``max_holds``
times. The limit reported is the highest load that held.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable


@dataclass
class PointOutcome:
    load: float
    passed: bool
    reasons: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)  # sustain.judge's, pass or fail
    timeline: dict[str, Any] | None = None  # limit.timeline: in-flight and server gauges over time

    def to_json(self) -> dict[str, Any]:
        return {"load": self.load, "passed": self.passed, "reasons": self.reasons, "summary": self.summary,
                "evidence": self.evidence, "timeline": self.timeline}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PointOutcome":
        return cls(d["load"], d["passed"], d["reasons"], d["summary"], d.get("evidence") or {}, d.get("timeline"))


@dataclass
class SearchResult:
    limit: float | None  # highest passing load; None when even the lowest load failed
    bounded: bool  # False when the highest load tried still passed (limit is a lower bound)
    points: list[PointOutcome]

    @property
    def failed_above(self) -> float | None:
        """The lowest failing load above the limit: the limit lies in [limit, failed_above)."""
        if self.limit is None:
            return None
        above = [p.load for p in self.points if not p.passed and p.load > self.limit]
        return min(above) if above else None

    @property
    def at_limit(self) -> PointOutcome | None:
        """The passing point measured at the limit (its p95s are the recommendation's)."""
        return next((p for p in self.points if p.passed and p.load == self.limit), None)


Measure = Callable[[float], Awaitable[PointOutcome]]


Advise = Callable[[], Awaitable[float | None]]


async def search(measure: Measure, start: float, min_load: float, max_load: float,
                 tolerance: float = 0.1, max_points: int = 16, step: float = 2.0,
                 advise: Advise | None = None, grid: float | None = None) -> SearchResult:
    """Bracket then bisect the pass/fail boundary of ``measure`` over load (see module doc).

    ``step``: the first bracketing step's factor (2: double or halve). Each further step
    squares it, up to 2 (1.1, 1.21, 1.46, 2, 2, ...: a galloping search), so a start near
    the boundary (a prediction) brackets it in two points, and one far off still reaches
    it in a few. ``advise``: asked once, after the first point, for a better guess of the
    boundary (a prediction refined with what that point showed); the second point goes
    there when it lies on the side the first point's verdict points to, at least ``step``
    away. ``grid``: loads are multiples of it (1: a count of users), each step moves by at
    least one, and the bisection ends where the bracket is one apart.
    """
    if not (0 < min_load <= start <= max_load):
        raise ValueError("need 0 < min_load <= start <= max_load")
    if not step > 1:
        raise ValueError("need step > 1")
    run = _Search(measure, min_load, max_load, max_points, step, advise, grid)
    start = run.snap(start)
    lo: float | None
    hi: float | None
    if await run.probe(start):
        lo, hi = await run.up_from(start)
    else:
        lo, hi = await run.down_from(start)
    if lo is None:
        return SearchResult(None, True, run.points)
    if hi is None:
        return SearchResult(lo, False, run.points)
    return SearchResult(await run.bisect(lo, hi, tolerance), True, run.points)


@dataclass
class _Search:
    """One search's points and the rules it moves by (``search``'s arguments)."""

    measure: Measure
    min_load: float
    max_load: float
    max_points: int
    step: float
    advise: Advise | None
    grid: float | None = None
    points: list[PointOutcome] = field(default_factory=list)

    def snap(self, x: float) -> float:
        """``x`` on the grid (the nearest multiple, within the bounds); ``x`` without one."""
        return x if self.grid is None else on_grid(x, self.grid, self.min_load, self.max_load)

    def beyond(self, x: float, last: float, up: bool) -> float:
        """``x`` on the grid, at least one grid step past ``last`` in the search's direction."""
        x = self.snap(x)
        if self.grid is not None and (x <= last if up else x >= last):
            x = last + self.grid if up else last - self.grid
        return x

    async def probe(self, x: float) -> bool:
        """Measure load ``x``; whether it passed."""
        p = await self.measure(x)
        self.points.append(p)
        return p.passed

    async def advised(self, default: float, up: bool) -> float:
        """The second point's load: the advised one where it lies past ``default`` in the
        direction the first verdict points (``up``: it passed), else ``default``."""
        if self.advise is None or len(self.points) != 1:
            return default
        guess = await self.advise()
        if guess is None:
            return default
        if up and guess > default:
            return min(guess, self.max_load)
        if not up and guess < default:
            return max(guess, self.min_load)
        return default

    def gallop(self, factor: float) -> float:
        """The next bracketing factor: squared, up to 2 (or ``step`` where larger)."""
        return min(factor * factor, max(self.step, 2.0))

    async def up_from(self, lo: float) -> tuple[float, float | None]:
        """From a passing load, step up until one fails: (highest pass, the failure or None)."""
        factor = self.step
        while len(self.points) < self.max_points and lo < self.max_load:
            x = self.beyond(await self.advised(min(lo * factor, self.max_load), up=True), lo, up=True)
            factor = self.gallop(factor)
            if not await self.probe(x):
                return lo, x
            lo = x
        return lo, None

    async def down_from(self, hi: float) -> tuple[float | None, float]:
        """From a failing load, step down until one passes: (the pass or None, lowest failure)."""
        factor = self.step
        while len(self.points) < self.max_points and hi > self.min_load:
            x = self.beyond(await self.advised(max(hi / factor, self.min_load), up=False), hi, up=False)
            factor = self.gallop(factor)
            if await self.probe(x):
                return x, hi
            hi = x
        return None, hi

    async def bisect(self, lo: float, hi: float, tolerance: float) -> float:
        """Bisect [lo, hi] at geometric means until ``hi / lo <= 1 + tolerance``; the highest pass."""
        while hi / lo > 1 + tolerance and len(self.points) < self.max_points:
            if self.grid is not None and hi - lo <= self.grid:
                break
            mid = math.sqrt(lo * hi)
            if self.grid is not None:
                mid = min(max(self.snap(mid), lo + self.grid), hi - self.grid)
            if await self.probe(mid):
                lo = mid
            else:
                hi = mid
        return lo


def spread(limits: list[float | None]) -> dict[str, Any]:
    """Mean, standard deviation, min and max of the limits found over repeats."""
    found = [x for x in limits if x is not None]
    if not found:
        return {"repeats": len(limits), "found": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"repeats": len(limits), "found": len(found), "mean": statistics.fmean(found),
            "std": statistics.pstdev(found) if len(found) > 1 else 0.0,
            "min": min(found), "max": max(found)}


@dataclass
class HoldResult:
    limit: float | None  # the highest load that held; None when no hold passed
    holds: list[PointOutcome]  # in the order measured

    @property
    def failed_above(self) -> float | None:
        """The lowest load whose hold failed, above the limit."""
        above = [p.load for p in self.holds if not p.passed and (self.limit is None or p.load > self.limit)]
        return min(above) if above else None


async def hold(search: SearchResult, measure: Measure, tolerance: float, min_load: float,
               max_holds: int = 3, grid: float | None = None) -> HoldResult:
    """Hold ``search.limit`` with ``measure`` (a longer point); step down by ``1 + tolerance``
    (on the ``grid``, at least one step of it) after each failure, at most ``max_holds``
    holds and not below ``min_load``."""
    holds: list[PointOutcome] = []
    load = search.limit
    while load is not None and load >= min_load and len(holds) < max_holds:
        p = await measure(load)
        holds.append(p)
        if p.passed:
            return HoldResult(load, holds)
        down = load / (1 + tolerance)
        load = down if grid is None else min(on_grid(down, grid, grid, load), load - grid)
    return HoldResult(None, holds)


def on_grid(x: float, grid: float, lo: float, hi: float) -> float:
    """The multiple of ``grid`` nearest ``x``, within ``[lo, hi]``."""
    return min(max(round(x / grid) * grid, lo), hi)
