"""When each request is sent: offsets in seconds from the start of the run.

Processes (as vLLM's ``benchmark_serving``: the first request goes at t = 0, each later one
after a gap):

- ``poisson``: exponential gaps with mean ``1 / rate``.
- ``gamma``: gamma gaps with shape ``burstiness`` and scale ``1 / (rate * burstiness)``, so
  the mean rate is still ``rate``; burstiness < 1 is burstier than Poisson, > 1 smoother
  (the coefficient of variation of the gaps is ``1 / sqrt(burstiness)``).
- ``constant``: gaps of exactly ``1 / rate``.
- ``trace``: the trace's own arrival times, multiplied by ``time_scale`` (2 = half the
  rate, 0.5 = twice the rate).

``rate = inf`` sends every request at t = 0. Gaps are drawn as mean-1 variates and divided
by the rate, so with one seed every rate sees the same pattern, only compressed: points of
a sweep or a capacity search differ in load and nothing else.

A measurement window (``window_offsets``) holds exactly ``rate x duration`` arrivals: its
gaps are normalized to span the window. For Poisson arrivals this is the process
conditioned on its count (the arrival times of a Poisson process given n arrivals in an
interval are n sorted uniforms: normalized exponential gaps); for gamma arrivals the
burstiness is kept. Without it, one seed's window may offer 10 % less than its label at
every load of a search, and the limit found would be that much too high.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

PROCESSES = ("poisson", "gamma", "constant", "trace")


def unit_gaps(n: int, process: str, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` gaps with mean 1 (dimensionless) for ``process`` in poisson/gamma/constant."""
    if process == "constant":
        return np.ones(n)
    if process == "poisson":
        burstiness = 1.0
    elif process != "gamma":
        raise ValueError(f"unknown arrival process {process!r}")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n)


def rate_offsets(n: int, rate: float, process: str = "poisson", burstiness: float = 1.0,
                 seed: int = 0) -> list[float]:
    """Send offsets (s) of ``n`` requests at mean ``rate`` (requests/s); the first at 0."""
    if n <= 0:
        return []
    if rate <= 0:
        raise ValueError("request rate must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    gaps = unit_gaps(n - 1, process, burstiness, seed) / rate
    offsets: list[float] = np.cumsum(gaps).tolist()
    return [0.0] + offsets


def trace_offsets(trace_times: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """Send offsets (s) replaying trace arrival times (s), relative to the first, scaled."""
    if time_scale <= 0:
        raise ValueError("time scale must be > 0")
    if not trace_times:
        return []
    t0 = trace_times[0]
    return [(t - t0) * time_scale for t in trace_times]


def make_offsets(n: int, process: str, rate: float = math.inf, burstiness: float = 1.0,
                 seed: int = 0, trace_times: Sequence[float | None] | None = None,
                 time_scale: float = 1.0) -> list[float]:
    """Offsets for the configured process; ``trace`` needs ``trace_times`` (from the dataset)."""
    if process == "trace":
        times = [t for t in (trace_times or [])[:n] if t is not None]
        if not trace_times or len(times) < len(trace_times[:n]):
            raise ValueError("--arrival trace needs a trace dataset (--dataset trace)")
        return trace_offsets(times, time_scale)
    return rate_offsets(n, rate, process, burstiness, seed)


def window_offsets(rate: float, process: str, burstiness: float, seed: int, warmup: float, duration: float,
                   drain: float, min_requests: int = 1, extensions: int = 0) -> tuple[list[float], list[float]]:
    """Offsets (s) of a windowed point and the ends of its windows: arrivals at ``rate``
    during ``warmup`` s, then exactly ``n = max(round(rate x duration), min_requests)`` in the
    window [warmup, end) (stretched beyond ``duration`` when ``min_requests`` needs it), then
    ``extensions`` more segments of the same span, each with exactly ``n`` arrivals (so a
    window extended k times holds exactly (k + 1) n), then ``drain`` s more at ``rate``.
    Returns the offsets and the ``1 + extensions`` window ends. ValueError for a non-finite
    rate or the trace process."""
    if process == "trace" or not math.isfinite(rate) or rate <= 0:
        raise ValueError("window_offsets needs poisson, gamma or constant arrivals at a finite rate")
    n = max(int(round(rate * duration)), min_requests, 1)
    span = max(duration, n / rate)
    before = np.cumsum(unit_gaps(int(rate * warmup * 2) + 8, process, burstiness, seed)) / rate
    offsets = sorted(warmup - t for t in before if t <= warmup)
    ends = []
    for k in range(extensions + 1):
        g = unit_gaps(n + 1, process, burstiness, seed + 1_000_003 * (1 + 2 * k))
        begin = warmup + k * span
        offsets += (begin + span * np.cumsum(g)[:-1] / g.sum()).tolist()
        ends.append(begin + span)
    after = np.cumsum(unit_gaps(int(rate * drain * 2) + 8, process, burstiness, seed + 2_000_006)) / rate
    offsets += [ends[-1] + t for t in after if t < drain]
    return [max(0.0, t) for t in offsets], ends
