"""The in-flight count of a point and its trend: the queue's evidence for ``sustain.judge``.

The count is client side (requests scheduled by the arrival process and not yet ended), so
it works against any server; where the server's own gauges were scraped often enough, their
waiting + running requests are the same evidence from the other end.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from inflight.bench.client import RequestRecord


def in_flight_at(records: Sequence[RequestRecord], times: np.ndarray) -> np.ndarray:
    """Requests scheduled (arrived) and not yet ended at each of ``times`` (s).

    Counted from ``scheduled_time``, not ``send_time``: a request held back by a client-side
    concurrency cap is already waiting, as it would be in any queue.
    """
    starts = np.sort(np.asarray([r.scheduled_time for r in records], dtype=float))
    ends = np.sort(np.asarray([r.end_time for r in records], dtype=float))
    return (np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")).astype(float)


def queue_growth(records: Sequence[RequestRecord], t0: float, t1: float,
                 step: float | None = None) -> dict[str, float]:
    """Least-squares slope (requests/s) of the in-flight count sampled on [t0, t1], the
    growth it implies over the span (requests), that growth's standard error (requests,
    autocorrelation-corrected, see ``sustain``), the count's standard deviation about
    the fitted line and its mean."""
    span = max(t1 - t0, 1e-9)
    step = step or min(0.1, span / 200)
    ts = np.arange(t0, t1 + 1e-12, step)
    return trend(ts, in_flight_at(records, ts) if ts.size else np.zeros(0), t0, t1)


def gauge_growth(samples: Sequence[dict[str, Any]], t0: float, t1: float,
                 min_samples: int = 10) -> dict[str, float] | None:
    """:func:`trend` of the server's own queue, waiting + running requests as scraped
    (``vllm:num_requests_waiting`` / ``running``, ``llamacpp:requests_deferred`` /
    ``processing``, inflight's), over [t0, t1]; None with fewer than ``min_samples``."""
    pts = [(s["t"], s["waiting"] + s["running"]) for s in samples
           if s.get("waiting") is not None and s.get("running") is not None and t0 <= s["t"] <= t1]
    if len(pts) < min_samples:
        return None
    ts, q = np.asarray(pts, dtype=float).T
    return trend(ts, q, t0, t1)


def trend(ts: np.ndarray, q: np.ndarray, t0: float, t1: float) -> dict[str, float]:
    """The least-squares trend of a count ``q`` sampled at times ``ts`` (s) over [t0, t1]:
    slope (1/s), growth over the span, its autocorrelation-corrected standard error, the
    residuals' standard deviation and the mean (see :func:`queue_growth`)."""
    span = max(t1 - t0, 1e-9)
    if ts.size < 3:
        return {"slope": 0.0, "growth": 0.0, "growth_se": 0.0, "resid_sd": 0.0, "mean_in_flight": 0.0,
                "t0": t0, "t1": t1}
    slope, icept = np.polyfit(ts, q, 1)
    resid = q - (slope * ts + icept)
    r1 = 0.0
    if resid.std() > 0:
        r1 = float(np.clip(np.corrcoef(resid[:-1], resid[1:])[0, 1], 0.0, 0.999))
    n_eff = max(3.0, ts.size * (1 - r1) / (1 + r1))
    sxx = float(((ts - ts.mean()) ** 2).sum()) * n_eff / ts.size
    se = math.sqrt(float((resid ** 2).sum()) / max(1.0, ts.size - 2) / sxx) if sxx > 0 else 0.0
    return {"slope": float(slope), "growth": float(slope) * span, "growth_se": se * span,
            "resid_sd": float(resid.std()), "mean_in_flight": float(q.mean()), "t0": t0, "t1": t1}


def server_queue_slope(samples: Sequence[dict[str, Any]], t0: float, t1: float, key: str = "waiting") -> float | None:
    """Slope (requests/s) of a scraped server gauge over [t0, t1]; None if too few samples."""
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None and t0 <= s["t"] <= t1]
    if len(pts) < 3:
        return None
    t, v = np.asarray(pts, dtype=float).T
    return float(np.polyfit(t, v, 1)[0])
