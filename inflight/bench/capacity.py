"""Capacity search: the highest load at which the SLOs hold and nothing fails.

Load is a positive number where larger is harder: the request rate (requests/s), or, for
trace replay, ``1 / time_scale`` (so the answer is the smallest time scale that passes).

Search (bracket, then bisect): measure the start load; double it while points pass (or
halve it while they fail) until a pass and a fail bracket the limit; then bisect the bracket
at its geometric mean until ``hi / lo <= 1 + tolerance``. The limit is the highest passing
load measured. Latency grows steeply near saturation, so the geometric mean treats a
bracket [1, 100] and [10, 1000] alike.

A point passes when (``evaluate_point``):

- at least one request completed and none failed;
- every aggregate SLO (``--slo ttft_p95=...,itl_p95=...``) holds;
- where the server counts preemptions, the counter grew by at most
  ``preemption_threshold`` per completed request. The default 1.0 fails loads at which
  requests are, on average, evicted and recomputed more than once: the KV cache is
  thrashing, which wastes the work continuous batching exists to save.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from inflight.bench.stats import SLO, check_aggregate

DEFAULT_PREEMPTION_THRESHOLD = 1.0  # preemptions per completed request


@dataclass
class PointOutcome:
    load: float
    passed: bool
    reasons: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"load": self.load, "passed": self.passed, "reasons": self.reasons, "summary": self.summary}


def evaluate_point(load: float, summary: dict, slo: SLO,
                   preemption_threshold: float = DEFAULT_PREEMPTION_THRESHOLD) -> PointOutcome:
    """Pass/fail of one measured load; ``summary`` from :func:`inflight.bench.stats.summarize`
    with ``preemptions`` (counter growth over the point, or None if not exposed)."""
    reasons = []
    if summary.get("completed", 0) == 0:
        reasons.append("no request completed")
    if summary.get("failed", 0):
        reasons.append(f"{summary['failed']} requests failed")
    reasons += check_aggregate(summary, slo.aggregate)
    pre = summary.get("preemptions")
    done = summary.get("completed", 0)
    if pre is not None and done and pre / done > preemption_threshold:
        reasons.append(f"{pre / done:.2f} preemptions per request > {preemption_threshold:g}")
    return PointOutcome(load, not reasons, reasons, summary)


@dataclass
class SearchResult:
    limit: float | None  # highest passing load; None when even the lowest load failed
    bounded: bool  # False when the highest load tried still passed (limit is a lower bound)
    points: list[PointOutcome]


Measure = Callable[[float], Awaitable[PointOutcome]]


async def search(measure: Measure, start: float, min_load: float, max_load: float,
                 tolerance: float = 0.1, max_points: int = 16) -> SearchResult:
    """Bracket then bisect the pass/fail boundary of ``measure`` over load (see module doc)."""
    if not (0 < min_load <= start <= max_load):
        raise ValueError("need 0 < min_load <= start <= max_load")
    points: list[PointOutcome] = []

    async def probe(x: float) -> bool:
        p = await measure(x)
        points.append(p)
        return p.passed

    lo: float | None = None
    hi: float | None = None
    x = start
    if await probe(x):
        lo = x
        while len(points) < max_points and lo < max_load:
            x = min(lo * 2, max_load)
            if await probe(x):
                lo = x
            else:
                hi = x
                break
    else:
        hi = x
        while len(points) < max_points and hi > min_load:
            x = max(hi / 2, min_load)
            if await probe(x):
                lo = x
                break
            hi = x
    if lo is None:
        return SearchResult(None, True, points)
    if hi is None:
        return SearchResult(lo, False, points)
    while hi / lo > 1 + tolerance and len(points) < max_points:
        mid = math.sqrt(lo * hi)
        if await probe(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, True, points)


def spread(limits: list[float | None]) -> dict:
    """Mean, standard deviation, min and max of the limits found over repeats."""
    found = [x for x in limits if x is not None]
    if not found:
        return {"repeats": len(limits), "found": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"repeats": len(limits), "found": len(found), "mean": statistics.fmean(found),
            "std": statistics.pstdev(found) if len(found) > 1 else 0.0,
            "min": min(found), "max": max(found)}
