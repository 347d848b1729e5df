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
   too small to bound the statistic fails at the last look, saying how many requests it
   needs; at an earlier one it is undecided, since the next look's window holds more (a
   hold's first third may be shorter than a p95's sample, the whole hold never is). The
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
import textwrap
from dataclasses import dataclass, field
from typing import Any, Sequence

from inflight.bench.client import RequestRecord
from inflight.bench.censoring import slo_intervals
from inflight.bench.confidence import DEFAULT_CONFIDENCE, n_min_for
from inflight.bench.queue_trend import gauge_growth, queue_growth, server_queue_slope
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
    evidence: dict[str, Any] = field(default_factory=dict)
    state: str = ""

    def __post_init__(self) -> None:
        if not self.state:
            self.state = PASS if self.passed else FAIL

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "state": self.state, "reasons": self.reasons,
                "evidence": self.evidence}


# ---------------------------------------------------------------- the verdict

def judge(records: Sequence[RequestRecord], window: Window, slo: SLO, preemptions: float | None = None,
          thresholds: Thresholds | None = None, server_samples: Sequence[dict[str, Any]] = (),
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
    rate = _throughput(point, sample, window, th)
    queue = _queue(point, sample, window, th, server_samples)
    intervals = slo_intervals(sample, slo, window.deadline, th.confidence)
    for iv in intervals.values():
        iv["state"] = _interval_state(iv)
    if not final and all(iv["state"] == PASS for iv in intervals.values()):
        # Throughput and queue forecast that latency will break; while it has not, a
        # longer window tells a lasting trend from a passing slowdown (module doc).
        rate.state = UNDECIDED if rate.state == FAIL else rate.state
        queue.state = UNDECIDED if queue.state == FAIL else queue.state

    found = _Findings()
    if not sample:
        found.fail("sample", "no request arrived in the window")
    found.forecast("throughput", rate.state, rate.reason(th), final)
    found.forecast("queue", queue.state, queue.reason(), final)
    for key, iv in intervals.items():
        found.statistic(key, iv, th.confidence, final)
    failed = [r for r in point if not r.success and not r.unfinished and not r.cancelled]
    if failed:
        # Bounded (an error can carry a whole HTML page) at a word, so the reason stays readable.
        first = textwrap.shorten(failed[0].error or "unknown error", 300, placeholder=" ...")
        found.fail("failures", f"{len(failed)} requests failed (first: {first})")
    finished = sum(1 for r in point if r.success)
    per_req = preemptions / finished if preemptions is not None and finished else None
    if per_req is not None and per_req > th.preemption_threshold:
        found.fail("preemption", f"{per_req:.2f} preemptions per request > {th.preemption_threshold:g}")

    evidence = {
        "window": {"start": window.start, "end": window.end, "seconds": window.seconds, "deadline": window.deadline},
        **rate.to_json(),
        "queue": queue.to_json(),
        "server_waiting_slope": server_queue_slope(server_samples, queue.mid, window.end),
        "slo": intervals, "unfinished": sum(1 for r in sample if r.unfinished), "failed": len(failed),
        "cancelled_cooldown": sum(1 for r in point if r.cancelled),
        "preemptions": preemptions, "preemptions_per_request": per_req,
        "thresholds": th.__dict__.copy(), "causes": found.causes, "undecided": found.undecided,
        "final": final,
    }
    return found.verdict(evidence)


@dataclass
class _Throughput:
    """Rule 1 (module doc): completions in the window keep up with its arrivals."""

    arrivals: int  # the sample: arrivals in the window
    done: int  # requests of the point completed within the window
    offered: float  # req/s
    completed: float  # req/s
    allowed: float  # shortfall (requests) that passes
    in_flight_sd: float  # the in-flight count's deviation about its trend over the window
    state: str

    @property
    def shortfall(self) -> int:
        return self.arrivals - self.done

    def reason(self, th: Thresholds) -> str:
        return (f"throughput {self.completed:.3g} req/s < {th.rate_tolerance:g} x offered {self.offered:.3g} req/s "
                f"({self.shortfall} more arrived than completed; noise allows {self.allowed:.1f})")

    def to_json(self) -> dict[str, Any]:
        return {"sample": self.arrivals, "offered_rate": self.offered, "completed_rate": self.completed,
                "completed_in_window": self.done,
                "rate_ratio": self.completed / self.offered if self.offered else None,
                "shortfall": self.shortfall, "shortfall_allowed": self.allowed, "in_flight_sd": self.in_flight_sd,
                "throughput_state": self.state}


def _throughput(point: list[RequestRecord], sample: list[RequestRecord], window: Window,
                th: Thresholds) -> _Throughput:
    secs = window.seconds
    arrivals = len(sample)
    done = sum(1 for r in point if r.success and window.start <= r.end_time < window.end)
    whole = queue_growth(point, window.start, window.end)
    base_allowed = (1 - th.rate_tolerance) * arrivals
    noise = math.sqrt(2) * whole["resid_sd"]
    # One request short is no trend in a count: small samples would fail on it alone.
    allowed = max(base_allowed + th.noise_z * noise, 1.0)
    state = _state(arrivals - done, allowed, max(base_allowed + th.fail_z * noise, 1.0))
    return _Throughput(arrivals, done, arrivals / secs if secs > 0 else math.inf,
                       done / secs if secs > 0 else 0.0, allowed, whole["resid_sd"], state)


@dataclass
class _Queue:
    """Rule 2 (module doc): the queue does not grow over the window's second half."""

    growth: dict[str, float]  # queue_trend.trend's, over [mid, end]
    source: str  # whose count: the server's gauges or the client's in-flight
    arrivals: int  # sample arrivals in the second half
    tolerance: float  # growth (requests) that passes
    state: str
    mid: float  # s: where the second half starts

    def reason(self) -> str:
        return (f"queue growing: {self.growth['growth']:+.1f} requests over the window's second half "
                f"({self.growth['slope']:.3g} req/s; tolerance {self.tolerance:.1f})")

    def to_json(self) -> dict[str, Any]:
        return {**self.growth, "tolerance": self.tolerance, "arrivals": self.arrivals, "source": self.source,
                "state": self.state}


def _queue(point: list[RequestRecord], sample: list[RequestRecord], window: Window, th: Thresholds,
           server_samples: Sequence[dict[str, Any]]) -> _Queue:
    mid = (window.start + window.end) / 2
    half, source = gauge_growth(server_samples, mid, window.end), "server gauges (waiting + running)"
    if half is None:
        half, source = queue_growth(point, mid, window.end), "client in-flight"
    arrivals = sum(1 for r in sample if r.scheduled_time >= mid)
    base = th.queue_tolerance * arrivals
    tolerance = max(base + th.noise_z * half["growth_se"], 1.0)  # +1 is no trend in a count
    state = _state(half["growth"], tolerance, max(base + th.fail_z * half["growth_se"], 1.0))
    return _Queue(half, source, arrivals, tolerance, state, mid)


def _interval_state(iv: dict[str, Any]) -> str:
    """Rule 3 (module doc) for one SLO statistic: pass within the target; fail when its
    whole interval lies above the target; else undecided (a straddle, or a sample too small
    to bound it, which ``_Findings.statistic`` fails at the last look)."""
    if iv["passed"]:
        return PASS
    return FAIL if iv["lo"] > iv["target"] else UNDECIDED


@dataclass
class _Findings:
    """The verdict's reasons (why it failed), each failure's cause, and the criteria left
    undecided, in the order the rules were checked."""

    reasons: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)

    def fail(self, cause: str, reason: str) -> None:
        self.causes.append(cause)
        self.reasons.append(reason)

    def forecast(self, key: str, state: str, text: str, final: bool) -> None:
        """Throughput or queue: a failure, or an undecided state that fails at the last look."""
        if state == FAIL or (state == UNDECIDED and final):
            self.fail(key, text + (" (not conclusive on its own)" if state == UNDECIDED else ""))
        elif state == UNDECIDED:
            self.undecided.append(key)

    def statistic(self, key: str, iv: dict[str, Any], confidence: float, final: bool) -> None:
        """An SLO statistic's interval (with its ``state``): an undecided one (a straddle, or
        a sample too small to bound it so far) fails only at the last look, a small sample
        as the sample's fault."""
        if iv["state"] == PASS:
            return
        if iv["state"] == UNDECIDED and not final:
            self.undecided.append(key)
        elif iv["state"] == UNDECIDED and iv["n"] < iv["n_min"]:
            self.fail("sample", f"{key}: {iv['n']} requests cannot bound it (needs >= {iv['n_min']} at "
                                f"{confidence:.0%} confidence)")
        else:
            self.fail(key, f"{key} {_ms(iv['estimate'])} (upper {_ms(iv['hi'])}) > {_ms(iv['target'])}"
                           + (" (not conclusive on its own)" if iv["state"] == UNDECIDED else ""))

    def verdict(self, evidence: dict[str, Any]) -> Verdict:
        if self.reasons:
            return Verdict(False, self.reasons, evidence, FAIL)
        if self.undecided:
            return Verdict(False, [f"undecided: {', '.join(self.undecided)} within noise of the target "
                                   "or not yet bounded by the sample"],
                           evidence, UNDECIDED)
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


def evidence_lines(ev: dict[str, Any]) -> list[str]:
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
