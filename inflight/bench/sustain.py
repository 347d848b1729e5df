"""Is a load sustained? The verdict of one measured point, with its evidence.

A point is an open-loop arrival process run in three phases (see ``runner.run_point``):
warm-up arrivals (sent, not counted), the **window** (its arrivals are the sample), and
cool-down arrivals that keep the load on until every sample request has ended or the
point's deadline passes. A load passes only when all of these hold:

1. **Throughput keeps up.** Requests completed during the window (any phase) per second
   >= ``rate_tolerance`` (0.95) x arrivals per second in the window, up to the window's
   own noise. Arrivals minus completions over a window is exactly the growth of the
   in-flight count over it, ``Q(end) - Q(start)``; for a stationary queue that difference
   has standard deviation ``sqrt(2) sd(Q)``, and a burst of arrivals in the window's last
   seconds alone can make it 5 % of a minute's arrivals. So the shortfall may exceed the 5 %
   by ``noise_z`` (2) x ``sqrt(2)`` x the in-flight count's standard deviation about its
   fitted trend (a growing queue's trend is not in that deviation), and by one request.
2. **The queue does not grow.** The least-squares slope of the in-flight count (requests
   scheduled by the arrival process and not yet ended, client side, so it works against
   any server) over the window's second half, times that half's length, is at most
   ``queue_tolerance`` (0.05) x that half's arrivals, plus ``noise_z`` (2) standard errors
   of that growth. The standard error comes from the fit's residuals, with the sample
   count deflated by their lag-1 autocorrelation (n_eff = n (1 - r) / (1 + r)), because
   the count moves slowly: a stationary queue's slope over 30 s is noisy, a growing queue's
   trend is not in the residuals.
3. **Each SLO statistic holds with confidence.** The upper end of its two-sided interval
   (``confidence``, 0.95; :mod:`inflight.bench.confidence`) is within the target. A sample
   too small to bound the statistic fails, saying how many requests it needs. The
   interval's lower end counts the window's requests as the independent draws they are:
   slow requests that came in one clump (a burst of long prompts) are about one draw (an
   effective sample size), so one burst leaves the point undecided and extended rather
   than failed conclusively.
   Sample requests still unfinished when the point ended count as censored: TTFT (if no
   token came), TPOT and E2E are ``inf``, and the open gap since their last token is an ITL.
4. **Nothing failed**, and preemptions per completed request stay within
   ``preemption_threshold`` (1.0: more means the KV cache thrashes).

**Fail only on evidence (sequential testing).** Each of 1-3 is one of three states. It
*passes* by the rules above; it *fails* only when the evidence is conclusive: throughput's
shortfall or the queue's growth more than ``fail_z`` (4) standard errors past its tolerance,
or an SLO statistic's whole interval above its target; in between it is *undecided* (a
p95's interval straddling its target, a growth or shortfall within a few standard errors
of its tolerance). Throughput and queue are forecasts: they fail a load whose latency
still meets the targets because it would not for long. A window cannot tell a lasting
trend from a slowdown that passes (a neighbour, the host taking CPU: the count's standard
error assumes a stationary queue, and a transient trend is not in its residuals), so
while every SLO statistic passes, their failure is undecided too until the last look. A point with an undecided criterion and nothing failed is extended
(``runner.run_point``: the window grows by one ``duration`` at a time, arrivals never
stop, up to ``max_extensions`` times) and judged again over the longer window; at the last
look an undecided criterion fails, as every straddle did with one look, and the verdict
says so: the limit may err low by an interval's width there, never high. Error rates, per
look and criterion, for a normal statistic: a sustainable load fails conclusively with
P(Z > 4) = 3e-5 (was P(Z > 2) = 2.3 % with one look, which is how a load the server held
for 5 minutes failed a 60 s window on queue noise alone, issue 30), and at the last look,
after ``max_extensions`` longer windows that shrink the noise against the tolerance, with
at most 2.3 %. An unsustainable load passes a look with the same probability as before (the
pass rule is unchanged); the hold (``capacity.hold``) is the check on that side.

Every verdict carries its evidence, pass or fail, as JSON and as printable lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from inflight.bench.client import RequestRecord
from inflight.bench.confidence import DEFAULT_CONFIDENCE, n_min_for, stat_interval
from inflight.bench.summary import SLO

DEFAULT_PREEMPTION_THRESHOLD = 1.0  # preemptions per completed request
DEFAULT_RATE_TOLERANCE = 0.95  # completed / offered, at least
DEFAULT_QUEUE_TOLERANCE = 0.05  # growth over the second half / arrivals in it, at most
DEFAULT_NOISE_Z = 2.0
DEFAULT_FAIL_Z = 4.0


@dataclass(frozen=True)
class Window:
    """The measurement window, seconds since the point's start: arrivals in [start, end).
    ``extensions``: the ends of the longer windows a point judged undecided may grow to
    (see the module doc), each with the same drain time after it."""

    start: float
    end: float
    deadline: float  # when the point stopped waiting for unfinished sample requests
    extensions: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def looks(self) -> list["Window"]:
        """This window, then each extension's (no further extensions of their own)."""
        drain = self.deadline - self.end
        return [Window(self.start, self.end, self.deadline)] + [
            Window(self.start, e, e + drain) for e in self.extensions]

    @property
    def last_end(self) -> float:
        return self.extensions[-1] if self.extensions else self.end

    def phase(self, t: float) -> str:
        """The phase of an arrival at ``t`` for this window: warmup, sample or cooldown."""
        return "warmup" if t < self.start else "sample" if t < self.end else "cooldown"


@dataclass
class Thresholds:
    """What a sustained load must show (see the module doc)."""

    confidence: float = DEFAULT_CONFIDENCE
    rate_tolerance: float = DEFAULT_RATE_TOLERANCE
    queue_tolerance: float = DEFAULT_QUEUE_TOLERANCE
    noise_z: float = DEFAULT_NOISE_Z
    fail_z: float = DEFAULT_FAIL_Z  # standard errors past a tolerance that fail at once
    preemption_threshold: float = DEFAULT_PREEMPTION_THRESHOLD


PASS, FAIL, UNDECIDED = "pass", "fail", "undecided"


@dataclass
class Verdict:
    """A point's verdict. ``state`` is ``pass``, ``fail`` or ``undecided`` (only from a
    look that is not the last: ``judge(final=False)``); ``passed`` is ``state == "pass"``."""

    passed: bool
    reasons: list[str] = field(default_factory=list)  # why it failed; empty on pass
    evidence: dict = field(default_factory=dict)
    state: str = ""

    def __post_init__(self) -> None:
        if not self.state:
            self.state = PASS if self.passed else FAIL

    def to_json(self) -> dict:
        return {"passed": self.passed, "state": self.state, "reasons": self.reasons,
                "evidence": self.evidence}


# ---------------------------------------------------------------- in-flight counts

def in_flight_at(records: Sequence[RequestRecord], times: np.ndarray) -> np.ndarray:
    """Requests scheduled (arrived) and not yet ended at each of ``times`` (s).

    Counted from ``scheduled_time``, not ``send_time``: a request held back by a client-side
    concurrency cap is already waiting, as it would be in any queue.
    """
    starts = np.sort(np.asarray([r.scheduled_time for r in records], dtype=float))
    ends = np.sort(np.asarray([r.end_time for r in records], dtype=float))
    return (np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")).astype(float)


def queue_growth(records: Sequence[RequestRecord], t0: float, t1: float, step: float | None = None) -> dict:
    """Least-squares slope (requests/s) of the in-flight count sampled on [t0, t1], the
    growth it implies over the span (requests), that growth's standard error (requests,
    autocorrelation-corrected, see the module doc), the count's standard deviation about
    the fitted line and its mean."""
    span = max(t1 - t0, 1e-9)
    step = step or min(0.1, span / 200)
    ts = np.arange(t0, t1 + 1e-12, step)
    return trend(ts, in_flight_at(records, ts) if ts.size else np.zeros(0), t0, t1)


def gauge_growth(samples: Sequence[dict], t0: float, t1: float, min_samples: int = 10) -> dict | None:
    """:func:`trend` of the server's own queue, waiting + running requests as scraped
    (``vllm:num_requests_waiting`` / ``running``, ``llamacpp:requests_deferred`` /
    ``processing``, inflight's), over [t0, t1]; None with fewer than ``min_samples``."""
    pts = [(s["t"], s["waiting"] + s["running"]) for s in samples
           if s.get("waiting") is not None and s.get("running") is not None and t0 <= s["t"] <= t1]
    if len(pts) < min_samples:
        return None
    ts, q = np.asarray(pts, dtype=float).T
    return trend(ts, q, t0, t1)


def trend(ts: np.ndarray, q: np.ndarray, t0: float, t1: float) -> dict:
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


def server_queue_slope(samples: Sequence[dict], t0: float, t1: float, key: str = "waiting") -> float | None:
    """Slope (requests/s) of a scraped server gauge over [t0, t1]; None if too few samples."""
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None and t0 <= s["t"] <= t1]
    if len(pts) < 3:
        return None
    t, v = np.asarray(pts, dtype=float).T
    return float(np.polyfit(t, v, 1)[0])


# ---------------------------------------------------------------- censored latencies

def censored_metrics(r: RequestRecord, deadline: float) -> dict:
    """One request's TTFT, TPOT, E2E (s) and ITL gaps, with an unfinished request censored:
    ``inf`` where it never got there, its open gap up to ``deadline`` as a last gap."""
    chunks = r.chunk_times
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    if r.success:
        ttft = chunks[0] - r.send_time if chunks else None
        e2e = chunks[-1] - r.send_time if chunks else None
        n = r.output_tokens or 0
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
        return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "itls": gaps}
    # Unfinished: whatever it did not reach is beyond every finite target.
    ttft = chunks[0] - r.send_time if chunks else math.inf
    open_gap = deadline - (chunks[-1] if chunks else r.send_time)
    return {"ttft": ttft, "tpot": math.inf, "e2e": math.inf,
            "itls": gaps + ([max(0.0, open_gap)] if chunks else [])}


def slo_intervals(sample: Sequence[RequestRecord], slo: SLO, deadline: float,
                  confidence: float = DEFAULT_CONFIDENCE) -> dict[str, dict]:
    """Each aggregate SLO's interval over the finished and unfinished sample requests
    (failed ones excluded: a failure fails the point on its own), in arrival order so that
    a clump of slow requests counts as the fewer independent draws it is."""
    kept = sorted((r for r in sample if r.success or r.unfinished), key=lambda r: r.scheduled_time)
    measured = [censored_metrics(r, deadline) for r in kept]
    out = {}
    for (metric, stat), target in slo.aggregate.items():
        if metric == "itl":
            iv = stat_interval(stat, groups=[m["itls"] for m in measured], confidence=confidence,
                               ordered=True)
        else:
            iv = stat_interval(stat, per_request=[m[metric] for m in measured if m[metric] is not None],
                               confidence=confidence, ordered=True)
        out[f"{metric}_{stat}"] = {**iv.to_json(), "target": target,
                                   "passed": iv.bounded and iv.hi <= target}
    return out


# ---------------------------------------------------------------- the verdict

def judge(records: Sequence[RequestRecord], window: Window, slo: SLO, preemptions: float | None = None,
          thresholds: Thresholds | None = None, server_samples: Sequence[dict] = (),
          final: bool = True) -> Verdict:
    """The verdict on one windowed point. ``records``: every request of the point, each with
    ``phase`` (warmup, sample, cooldown); ``preemptions``: the server counter's growth over
    the point (None where not exposed); ``server_samples``: scraped gauges (optional; their
    waiting + running requests are the queue's evidence where there are enough of them).
    ``final``: False for a look that may be extended: an inconclusive point is then
    ``undecided``; True (the last look) fails it, as a single look always did."""
    th = thresholds or Thresholds()
    point = [r for r in records if r.phase in ("warmup", "sample", "cooldown")]
    sample = [r for r in point if r.phase == "sample"]
    secs = window.seconds
    arrivals = len(sample)
    done_in_window = sum(1 for r in point if r.success and window.start <= r.end_time < window.end)
    offered = arrivals / secs if secs > 0 else math.inf
    completed = done_in_window / secs if secs > 0 else 0.0
    shortfall = arrivals - done_in_window
    whole = queue_growth(point, window.start, window.end)
    base_allowed = (1 - th.rate_tolerance) * arrivals
    rate_noise = math.sqrt(2) * whole["resid_sd"]
    # One request short is no trend in a count: small samples would fail on it alone.
    rate_allowed = max(base_allowed + th.noise_z * rate_noise, 1.0)
    rate_state = _state(shortfall, rate_allowed, max(base_allowed + th.fail_z * rate_noise, 1.0))

    mid = (window.start + window.end) / 2
    half, source = gauge_growth(server_samples, mid, window.end), "server gauges (waiting + running)"
    if half is None:
        half, source = queue_growth(point, mid, window.end), "client in-flight"
    half_arrivals = sum(1 for r in sample if r.scheduled_time >= mid)
    queue_base = th.queue_tolerance * half_arrivals
    queue_tol = max(queue_base + th.noise_z * half["growth_se"], 1.0)  # +1 is no trend in a count
    queue_state = _state(half["growth"], queue_tol, max(queue_base + th.fail_z * half["growth_se"], 1.0))

    failed = [r for r in point if not r.success and not r.unfinished and not r.cancelled]
    unfinished = sum(1 for r in sample if r.unfinished)
    finished_all = sum(1 for r in point if r.success)
    per_req = preemptions / finished_all if preemptions is not None and finished_all else None
    intervals = slo_intervals(sample, slo, window.deadline, th.confidence)

    for iv in intervals.values():
        iv["state"] = (PASS if iv["passed"] else FAIL if iv["n"] < iv["n_min"] or iv["lo"] > iv["target"]
                       else UNDECIDED)
    latency_met = all(iv["state"] == PASS for iv in intervals.values())
    if not final and latency_met:
        # Throughput and queue forecast that latency will break; while it has not, a
        # longer window tells a lasting trend from a passing slowdown (module doc).
        rate_state = UNDECIDED if rate_state == FAIL else rate_state
        queue_state = UNDECIDED if queue_state == FAIL else queue_state

    reasons, causes, undecided = [], [], []
    if arrivals == 0:
        reasons.append("no request arrived in the window")
        causes.append("sample")
    rate_text = (f"throughput {completed:.3g} req/s < {th.rate_tolerance:g} x offered {offered:.3g} req/s "
                 f"({shortfall} more arrived than completed; noise allows {rate_allowed:.1f})")
    queue_text = (f"queue growing: {half['growth']:+.1f} requests over the window's second half "
                  f"({half['slope']:.3g} req/s; tolerance {queue_tol:.1f})")
    for key, state, text in (("throughput", rate_state, rate_text), ("queue", queue_state, queue_text)):
        if state == FAIL or (state == UNDECIDED and final):
            causes.append(key)
            reasons.append(text + (" (not conclusive on its own)" if state == UNDECIDED else ""))
        elif state == UNDECIDED:
            undecided.append(key)
    for key, iv in intervals.items():
        if iv["state"] == PASS:
            continue
        if iv["state"] == UNDECIDED and not final:
            undecided.append(key)
            continue
        causes.append("sample" if iv["n"] < iv["n_min"] else key)
        if iv["n"] < iv["n_min"]:
            reasons.append(f"{key}: {iv['n']} requests cannot bound it (needs >= {iv['n_min']} at "
                           f"{th.confidence:.0%} confidence)")
        else:
            reasons.append(f"{key} {_ms(iv['estimate'])} (upper {_ms(iv['hi'])}) > {_ms(iv['target'])}"
                           + (" (not conclusive on its own)" if iv["state"] == UNDECIDED else ""))
    if failed:
        causes.append("failures")
        first = (failed[0].error or "unknown error")[:120]
        reasons.append(f"{len(failed)} requests failed (first: {first})")
    if per_req is not None and per_req > th.preemption_threshold:
        causes.append("preemption")
        reasons.append(f"{per_req:.2f} preemptions per request > {th.preemption_threshold:g}")

    evidence = {
        "window": {"start": window.start, "end": window.end, "seconds": secs, "deadline": window.deadline},
        "sample": arrivals, "offered_rate": offered, "completed_rate": completed,
        "completed_in_window": done_in_window, "rate_ratio": completed / offered if offered else None,
        "shortfall": shortfall, "shortfall_allowed": rate_allowed, "in_flight_sd": whole["resid_sd"],
        "throughput_state": rate_state,
        "queue": {**half, "tolerance": queue_tol, "arrivals": half_arrivals, "source": source,
                  "state": queue_state},
        "server_waiting_slope": server_queue_slope(server_samples, mid, window.end),
        "slo": intervals, "unfinished": unfinished, "failed": len(failed),
        "cancelled_cooldown": sum(1 for r in point if r.cancelled),
        "preemptions": preemptions, "preemptions_per_request": per_req,
        "thresholds": th.__dict__.copy(), "causes": causes, "undecided": undecided,
        "final": final,
    }
    if reasons:
        return Verdict(False, reasons, evidence, FAIL)
    if undecided:
        return Verdict(False, [f"undecided: {', '.join(undecided)} within noise of the target"], evidence,
                       UNDECIDED)
    return Verdict(True, [], evidence, PASS)


def _state(value: float, pass_at_most: float, fail_above: float) -> str:
    """pass (value <= pass_at_most), fail (value > fail_above) or undecided between."""
    if value <= pass_at_most:
        return PASS
    return FAIL if value > fail_above else UNDECIDED


def _ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def evidence_lines(ev: dict) -> list[str]:
    """The evidence as a few readable lines (what a verdict printed on pass and on fail)."""
    out = [f"offered {ev['offered_rate']:.3g} req/s, completed {ev['completed_rate']:.3g} req/s in the "
           f"{ev['window']['seconds']:.3g} s window ({ev['sample']} requests, {ev['shortfall']} short, "
           f"{ev['shortfall_allowed']:.1f} allowed); queue {ev['queue']['growth']:+.1f} over the second half "
           f"(tolerance {ev['queue']['tolerance']:.1f})"]
    parts = []
    for key, iv in ev["slo"].items():
        ci = f"[{_ms(iv['lo'])}, {_ms(iv['hi'])}]"
        n_eff = iv.get("n_eff")
        # Say when clumping, not the request count, set the interval's width.
        clumped = f" ({n_eff:.0f} of {iv['n']} independent)" if n_eff and n_eff < 0.8 * iv["n"] else ""
        parts.append(f"{key} {_ms(iv['estimate'])} {ci}{clumped} vs {_ms(iv['target'])}")
    if parts:
        out.append(f"{ev['thresholds']['confidence']:.0%} CI: " + "; ".join(parts))
    tail = [f"unfinished {ev['unfinished']}", f"failed {ev['failed']}"]
    if ev["preemptions_per_request"] is not None:
        tail.append(f"preemptions {ev['preemptions']:.0f} ({ev['preemptions_per_request']:.2f}/request)")
    out.append(", ".join(tail))
    return out


def strictest_n_min(slo: SLO, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """The sample size the SLO's statistics need to be bounded (1 without quantiles)."""
    return max([n_min_for(stat, confidence) for (_, stat) in slo.aggregate], default=1)
