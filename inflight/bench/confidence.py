"""Confidence intervals for the statistics an SLO is written on (p95 TTFT, p99 ITL, ...).

A p95 from 30 requests is one draw of a noisy estimate: with 30 values its 95 % interval
reaches the sample maximum, and a load can "pass" on luck. So an SLO is checked on the
upper end of the statistic's interval, and a sample too small to bound it cannot pass.

- Per-request metrics (TTFT, TPOT, E2E: one value per request) use the distribution-free
  order-statistic interval for a quantile (Hahn & Meeker, *Statistical Intervals*, 1991,
  sec. 5.2): with ``B ~ Binomial(n, q)``, the interval ``[x_(l), x_(u)]`` covers the
  q-quantile with probability ``P(l <= B < u)``. ``l`` and ``u`` are chosen equal-tailed.
  When ``u > n`` the sample cannot bound the quantile from above: for q = 0.95 at 95 %
  confidence that takes ``n >= 72`` (``min_sample_size``).
- Pooled metrics (ITL: every gap of every request) are not independent values: the gaps of
  one request share its batch. Their interval is a cluster bootstrap over requests
  (Davison & Hinkley, *Bootstrap Methods*, 1997, sec. 3.8): resample whole requests, pool
  their gaps, take the statistic; the percentile interval of ``resamples`` replicates.
- Means use the normal approximation, ``mean +/- z * sd / sqrt(n)``.

Values may be ``inf``: a request the point ended before it finished has an unbounded TTFT
or E2E (it is censored, not dropped), and the order statistics carry it as the largest.

**Requests close in time are not independent.** They share queue states: a burst of long
prompts gives every request behind it a long TTFT, so exceedances of a p95 come in clumps
and a window holds fewer independent draws than requests. Given values in arrival order
(``ordered=True``), both methods account for it with an effective sample size: the
variance inflation of the tail indicator series (value at or above the estimate; for pooled
metrics each request's share of gaps at or above it), ``n_eff = n / tau`` with
``tau = 1 + 2 sum rho_k`` summed by Geyer's initial positive sequence (Geyer, "Practical
Markov chain Monte Carlo", Statistical Science 7, 1992, sec. 3.3), less what an
independent series of that length reads by chance (``effective_sample_size``), never
below 1 (the intervals never narrow below the independent case). The lower end's order-statistic rank
is that of a sample of ``n_eff`` mapped onto the ``n`` values; the bootstrap's lower end
resamples blocks of ``ceil(tau)`` consecutive requests (circular block bootstrap, Politis &
Romano 1992). So a burst that one window caught reads as undecided (and the point is
extended), not as conclusive evidence of failure (issue 30: a load held at 2-4 req/s failed
1.79 req/s "conclusively" on one clump).

Only the lower end, the evidence that a load fails, is deflated; the upper end, the
evidence that it passes, is the independent one. Near a server's limit queueing delays are
correlated by nature (a busy period spans many requests): a deflated upper end would leave
most such points undecided, extend them, and fail them at the last look, the
understatement issue 30 removes. Passing on a lucky window is what the hold
(``capacity.hold``, five times as long) checks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

# Values of one metric: a sequence, or an array of floats (np.asarray takes either).
Values = Sequence[float] | np.ndarray
STAT_QUANTILES = {"p50": 0.50, "median": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
DEFAULT_CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 400
TAU_NOISE = 8.0  # an independent series' autocorrelation time reads up to 1 + 8 / sqrt(n)


@dataclass(frozen=True)
class Interval:
    """A statistic's estimate and its two-sided confidence interval (same unit as the data).

    ``hi`` is ``inf`` when the sample is too small to bound the statistic (``n < n_min``) or
    when censored values reach the interval's upper order statistic.
    """

    stat: str
    estimate: float
    lo: float
    hi: float
    n: int  # sample size: requests (per-request metrics and pooled ones alike)
    n_min: int  # smallest n for which hi can be finite
    confidence: float
    method: str  # order-statistic | cluster-bootstrap | normal | sample-max
    n_eff: float | None = None  # independent draws the interval credits (None: not estimated)

    @property
    def bounded(self) -> bool:
        return self.n >= self.n_min and math.isfinite(self.hi)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _log_binom_pmf(n: int, q: float) -> np.ndarray:
    k = np.arange(n + 1)
    lg = math.lgamma(n + 1) - np.array([math.lgamma(i + 1) + math.lgamma(n - i + 1) for i in k])
    with np.errstate(divide="ignore"):
        log_pmf: np.ndarray = lg + k * math.log(q) + (n - k) * math.log1p(-q)
    return log_pmf


def binom_cdf(n: int, q: float) -> np.ndarray:
    """``P(B <= k)`` for ``k = 0..n``, ``B ~ Binomial(n, q)``, ``0 < q < 1``."""
    cdf: np.ndarray = np.minimum(np.cumsum(np.exp(_log_binom_pmf(n, q))), 1.0)
    return cdf


def min_sample_size(q: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Smallest n whose order-statistic interval for the q-quantile has a finite upper end:
    ``1 - q**n >= 1 - alpha / 2``. 72 for q = 0.95, 368 for q = 0.99 (95 % confidence)."""
    alpha = 1.0 - confidence
    return max(1, math.ceil(math.log(alpha / 2) / math.log(q)))


def n_min_for(stat: str, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Requests a statistic needs before its interval can have a finite upper end."""
    if stat in STAT_QUANTILES:
        return min_sample_size(STAT_QUANTILES[stat], confidence)
    return 2 if stat == "mean" else 1


def autocorrelation_time(series: Values) -> float:
    """Integrated autocorrelation time ``tau = 1 + 2 sum_k rho_k`` of a series (any values;
    here 0/1 tail indicators or shares in arrival order), estimated with Geyer's initial
    positive sequence: pairs ``rho_2m + rho_2m+1`` summed while positive, made monotone.
    ``n / tau`` is the series' effective sample size. Returns at least 1 (a negatively
    correlated series is not credited with more than its length); 1 for a constant series
    or fewer than 8 values."""
    y = np.asarray(series, dtype=float)
    n = int(y.size)
    if n < 8:
        return 1.0
    d = y - y.mean()
    var = float(d @ d) / n
    if var <= 0:
        return 1.0
    size = 1 << (2 * n - 1).bit_length()  # zero-padded FFT: linear, not circular, lags
    f = np.fft.rfft(d, size)
    rho = np.fft.irfft(f * np.conj(f), size)[:n] / (n * var)
    tau, prev = -1.0, math.inf
    for m in range(n // 2):
        pair = float(rho[2 * m] + rho[2 * m + 1])
        if pair <= 0:
            break
        prev = min(prev, pair)
        tau += 2 * prev
    return max(1.0, tau)


def effective_sample_size(series: Values) -> float:
    """``n / tau`` for a series in arrival order, with ``tau`` (``autocorrelation_time``)
    less its noise: for independent series of n = 72..1000 values (0/1 tails at 5-20 %) the
    estimate's 95th percentile is ``1 + (5.4..8) / sqrt(n)`` (measured), so the excess over
    ``TAU_NOISE / sqrt(n)`` is what counts. An independent window keeps its n (a window just
    over ``n_min`` is not pushed under it by noise); a clumped one (tau 3-20) keeps nearly
    all of its deflation."""
    n = len(series)
    if n == 0:
        return 0.0
    tau = max(1.0, autocorrelation_time(series) - TAU_NOISE / math.sqrt(n))
    return n / tau


def order_ranks(n: int, q: float, confidence: float = DEFAULT_CONFIDENCE) -> tuple[int, int]:
    """1-based ranks ``(l, u)`` of the equal-tailed interval ``[x_(l), x_(u)]``; ``l = 0``
    means unbounded below and ``u = n + 1`` unbounded above."""
    alpha = 1.0 - confidence
    cdf = binom_cdf(n, q)  # cdf[k] = P(B <= k)
    # l: the largest rank with P(B < l) <= alpha / 2; u: the smallest with P(B < u) >= 1 - alpha / 2.
    below = np.nonzero(cdf <= alpha / 2)[0]
    lo = int(below[-1]) + 1 if below.size else 0
    above = np.nonzero(cdf >= 1 - alpha / 2)[0]
    hi = int(above[0]) + 1 if above.size else n + 1
    return lo, min(hi, n + 1)


def sample_quantile(values: Values, q: float) -> float:
    """numpy's default (linear) quantile, with ``inf`` values sorted last: a position at or
    beyond the first ``inf`` is ``inf``. ``nan`` for no values."""
    a = np.sort(np.asarray(values, dtype=float))
    if a.size == 0:
        return math.nan
    pos = q * (a.size - 1)
    i = int(math.floor(pos))
    frac = pos - i
    if frac == 0 or i + 1 >= a.size:
        return float(a[i])
    if math.isinf(a[i + 1]):
        return math.inf
    return float(a[i] + frac * (a[i + 1] - a[i]))


def effective_ranks(n: int, n_eff: float, q: float,
                    confidence: float = DEFAULT_CONFIDENCE) -> tuple[int, int]:
    """The ranks ``(l, u)`` of ``order_ranks`` for a sample of ``n`` values that carry
    ``n_eff <= n`` independent draws: the equal-tailed ranks of ``m = floor(n_eff)`` draws,
    each mapped onto the n values by its plotting position ``r / (m + 1)``, outward (lower
    rank down, upper up). ``m == n`` gives ``order_ranks(n, ...)`` exactly; ``u = n + 1``
    (unbounded above) when ``m`` draws cannot bound the quantile."""
    m = max(1, min(n, int(math.floor(n_eff + 1e-9))))
    lo_m, hi_m = order_ranks(m, q, confidence)
    if m == n:
        return lo_m, hi_m
    lo = int(math.floor(lo_m * (n + 1) / (m + 1)))
    hi = n + 1 if hi_m > m else min(n, int(math.ceil(hi_m * (n + 1) / (m + 1))))
    return lo, hi


def quantile_interval(values: Values, q: float, confidence: float = DEFAULT_CONFIDENCE,
                      stat: str | None = None, ordered: bool = False) -> Interval:
    """Order-statistic interval of the q-quantile of one value per request. ``ordered``:
    the values are in arrival order, and their tail's autocorrelation deflates the sample
    to its effective size (module doc); else they are taken as independent."""
    raw = np.asarray(values, dtype=float)
    a = np.sort(raw)
    n = int(a.size)
    n_min = min_sample_size(q, confidence)
    name = stat or f"p{q * 100:g}"
    if n == 0:
        return Interval(name, math.nan, math.nan, math.inf, 0, n_min, confidence, "order-statistic")
    estimate = sample_quantile(a, q)
    n_eff = effective_sample_size((raw >= estimate).astype(float)) if ordered else float(n)
    lo_rank = effective_ranks(n, n_eff, q, confidence)[0]
    hi_rank = order_ranks(n, q, confidence)[1]  # the pass side stays independent (module doc)
    lo = float(a[lo_rank - 1]) if lo_rank >= 1 else -math.inf
    hi = float(a[hi_rank - 1]) if hi_rank <= n else math.inf
    return Interval(name, estimate, lo, hi, n, n_min, confidence, "order-statistic",
                    n_eff if ordered else None)


def pooled_quantile_interval(groups: Sequence[Sequence[float]], q: float,
                             confidence: float = DEFAULT_CONFIDENCE, stat: str | None = None,
                             resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                             ordered: bool = False) -> Interval:
    """Cluster-bootstrap interval of the q-quantile of values pooled over groups (requests).

    Needs as many groups as the order-statistic interval needs values (``n_min``): a
    bootstrap over fewer requests underestimates how far the tail can reach. ``ordered``:
    the groups are in arrival order; blocks of ``ceil(tau)`` consecutive groups are
    resampled (circularly) and the upper end needs ``n_eff >= n_min`` (module doc).
    """
    arrays = [np.asarray(g, dtype=float) for g in groups if len(g)]
    n = len(arrays)
    n_min = min_sample_size(q, confidence)
    name = stat or f"p{q * 100:g}"
    if n == 0:
        return Interval(name, math.nan, math.nan, math.inf, 0, n_min, confidence, "cluster-bootstrap")
    estimate = sample_quantile(np.concatenate(arrays), q)
    n_eff = effective_sample_size([float(np.mean(g >= estimate)) for g in arrays]) if ordered else float(n)
    block = max(1, min(n, int(math.ceil(n / n_eff - 1e-9))))
    alpha = 1.0 - confidence
    reps = _block_bootstrap(arrays, q, 1, resamples, seed)
    hi = sample_quantile(reps, 1 - alpha / 2) if n >= n_min else math.inf
    if block > 1:  # the fail side counts blocks of dependent requests (module doc)
        reps = _block_bootstrap(arrays, q, block, resamples, seed)
    lo = sample_quantile(reps, alpha / 2)
    return Interval(name, estimate, lo, hi, n, n_min, confidence, "cluster-bootstrap",
                    n_eff if ordered else None)


def _block_bootstrap(arrays: list[np.ndarray], q: float, block: int, resamples: int, seed: int) -> np.ndarray:
    """``resamples`` q-quantiles of the pooled values of n groups drawn as circular blocks
    of ``block`` consecutive groups (block 1: the cluster bootstrap)."""
    n = len(arrays)
    rng = np.random.default_rng(seed)
    reps = np.empty(resamples)
    for b in range(resamples):
        starts = rng.integers(n, size=-(-n // block))
        pick = ((starts[:, None] + np.arange(block)[None, :]) % n).ravel()[:n]
        reps[b] = sample_quantile(np.concatenate([arrays[i] for i in pick]), q)
    return reps


def mean_interval(values: Values, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    """Normal-approximation interval of the mean (needs n >= 2; ``inf`` values make it ``inf``)."""
    a = np.asarray(values, dtype=float)
    n = int(a.size)
    if n < 2:
        est = float(a.mean()) if n else math.nan
        return Interval("mean", est, -math.inf, math.inf, n, 2, confidence, "normal")
    if not np.isfinite(a).all():
        return Interval("mean", math.inf, math.inf, math.inf, n, 2, confidence, "normal")
    z = _z(confidence)
    half = z * float(a.std(ddof=1)) / math.sqrt(n)
    m = float(a.mean())
    return Interval("mean", m, m - half, m + half, n, 2, confidence, "normal")


def _z(confidence: float) -> float:
    # Two-sided normal quantile by bisection on erf: no scipy for one number.
    target = 0.5 + confidence / 2
    lo, hi = 0.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def stat_interval(stat: str, per_request: Sequence[float] | None = None,
                  groups: Sequence[Sequence[float]] | None = None,
                  confidence: float = DEFAULT_CONFIDENCE, ordered: bool = False) -> Interval:
    """The interval of ``stat`` (mean, median/p50, p90, p95, p99, max) over one value per
    request (``per_request``) or over values pooled by request (``groups``); ``ordered``:
    in arrival order, so quantiles account for their autocorrelation (module doc).

    ``max`` has no interval that a sample can bound; it is the sample maximum itself.
    Raises ValueError for an unknown statistic.
    """
    if per_request is not None and groups is None:
        return _per_request_interval(stat, list(per_request), confidence, ordered)
    if groups is not None and per_request is None:
        return _pooled_interval(stat, groups, confidence, ordered)
    raise ValueError("give per_request or groups")


def _per_request_interval(stat: str, values: list[float], confidence: float, ordered: bool) -> Interval:
    if stat == "max":
        m = max(values) if values else math.nan
        return Interval("max", m, m, m if values else math.inf, len(values), 1, confidence, "sample-max")
    if stat == "mean":
        return mean_interval(values, confidence)
    return quantile_interval(values, _quantile(stat), confidence, stat, ordered=ordered)


def _pooled_interval(stat: str, groups: Sequence[Sequence[float]], confidence: float, ordered: bool) -> Interval:
    pooled = [v for g in groups for v in g]
    if stat == "max":
        m = max(pooled) if pooled else math.nan
        n = sum(1 for g in groups if len(g))
        return Interval("max", m, m, m if pooled else math.inf, n, 1, confidence, "sample-max")
    if stat == "mean":
        return mean_interval(pooled, confidence)
    return pooled_quantile_interval(groups, _quantile(stat), confidence, stat, ordered=ordered)


def _quantile(stat: str) -> float:
    """The quantile a statistic's name stands for (p95: 0.95). Raises ValueError for
    another name."""
    if stat not in STAT_QUANTILES:
        raise ValueError(f"unknown statistic {stat!r}")
    return STAT_QUANTILES[stat]
