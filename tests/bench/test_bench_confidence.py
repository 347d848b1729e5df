"""Confidence intervals of SLO statistics: exact ranks, sample sizes, and coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inflight.bench import confidence as ci


def exact_cdf(n: int, q: float, k: int) -> float:
    return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k + 1))


@pytest.mark.parametrize("n,q", [(20, 0.5), (100, 0.95), (300, 0.99), (72, 0.95), (500, 0.9)])
def test_order_ranks_are_the_equal_tailed_binomial_ranks(n, q):
    lo, hi = ci.order_ranks(n, q, 0.95)
    # The defining inequalities, checked with an independent binomial sum.
    if lo >= 1:
        assert exact_cdf(n, q, lo - 1) <= 0.025 < exact_cdf(n, q, lo)
    if hi <= n:
        assert exact_cdf(n, q, hi - 1) >= 0.975 > exact_cdf(n, q, hi - 2)
        assert exact_cdf(n, q, hi - 1) - (exact_cdf(n, q, lo - 1) if lo >= 1 else 0) >= 0.95


def test_min_sample_size():
    assert ci.min_sample_size(0.95) == 72  # ceil(ln 0.025 / ln 0.95) = ceil(71.9)
    assert ci.min_sample_size(0.99) == 368
    assert ci.min_sample_size(0.5) == 6
    assert ci.order_ranks(71, 0.95)[1] == 72  # one short: unbounded above
    assert ci.order_ranks(72, 0.95)[1] == 72  # the sample maximum bounds it
    iv = ci.quantile_interval(np.arange(71.0), 0.95)
    assert math.isinf(iv.hi) and not iv.bounded and iv.n_min == 72
    iv = ci.quantile_interval(np.arange(72.0), 0.95)
    assert iv.hi == 71.0 and iv.bounded


def test_quantile_interval_values_and_censoring():
    vals = np.arange(1.0, 201.0)  # 1..200
    iv = ci.quantile_interval(vals, 0.95)
    lo, hi = ci.order_ranks(200, 0.95)
    assert (iv.lo, iv.hi) == (float(lo), float(hi))  # the value of rank r is r
    assert iv.estimate == pytest.approx(np.percentile(vals, 95))
    # Censored (inf) values rank last: 5 of 200 leave the p95 finite, 20 make it inf.
    five = np.concatenate([vals[:195], [math.inf] * 5])
    assert math.isfinite(ci.quantile_interval(five, 0.95).estimate)
    twenty = np.concatenate([vals[:180], [math.inf] * 20])
    iv = ci.quantile_interval(twenty, 0.95)
    assert math.isinf(iv.estimate) and math.isinf(iv.hi)


def test_order_statistic_interval_covers_the_true_quantile():
    rng = np.random.default_rng(1)
    true = -math.log(0.05)  # p95 of Exp(1)
    trials, covered = 2000, 0
    for _ in range(trials):
        iv = ci.quantile_interval(rng.exponential(size=150), 0.95)
        covered += iv.lo <= true <= iv.hi
    # Distribution-free coverage >= 95 %; 3 standard errors of 2000 trials below it.
    assert covered / trials >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / trials)


def test_cluster_bootstrap_covers_a_pooled_quantile_with_correlated_groups():
    rng = np.random.default_rng(2)
    # Each request has its own slowness (shared by its gaps): gaps are not independent.
    def sample(n):
        return [rng.exponential(scale=rng.uniform(0.5, 1.5), size=20) for _ in range(n)]
    big = np.concatenate(sample(20000))
    true = float(np.percentile(big, 95))
    trials, covered = 120, 0
    for _ in range(trials):
        groups = sample(100)
        iv = ci.pooled_quantile_interval(groups, 0.95, resamples=200, seed=int(rng.integers(1 << 30)))
        covered += iv.lo <= true <= iv.hi
    assert covered / trials >= 0.85
    assert ci.pooled_quantile_interval(sample(50), 0.95).hi == math.inf  # 50 requests < 72


def test_stat_interval_dispatch():
    vals = list(np.linspace(0.1, 1.0, 100))
    assert ci.stat_interval("p95", per_request=vals).method == "order-statistic"
    assert ci.stat_interval("p95", groups=[[v] for v in vals]).method == "cluster-bootstrap"
    m = ci.stat_interval("mean", per_request=vals)
    assert m.estimate == pytest.approx(0.55) and m.lo < 0.55 < m.hi
    half = 1.959964 * np.std(vals, ddof=1) / 10
    assert m.hi - m.estimate == pytest.approx(half, rel=1e-5)
    mx = ci.stat_interval("max", per_request=vals)
    assert mx.estimate == mx.hi == 1.0
    with pytest.raises(ValueError):
        ci.stat_interval("p42", per_request=vals)
    assert ci.n_min_for("p99") == 368 and ci.n_min_for("mean") == 2 and ci.n_min_for("max") == 1


def markov_tail(rng, n: int, p: float, r: float) -> np.ndarray:
    """0/1 series: each value repeats the last with probability r, else is a fresh
    Bernoulli(p): lag-k autocorrelation r**k, so tau = (1 + r) / (1 - r)."""
    x = np.empty(n)
    x[0] = rng.random() < p
    keep, fresh = rng.random(n) < r, rng.random(n) < p
    for i in range(1, n):
        x[i] = x[i - 1] if keep[i] else fresh[i]
    return x


@pytest.mark.parametrize("r", [0.0, 0.5, 0.8])
def test_autocorrelation_time_matches_a_markov_chains(r):
    rng = np.random.default_rng(3)
    tau = (1 + r) / (1 - r)
    est = [ci.autocorrelation_time(markov_tail(rng, 20000, 0.05, r)) for _ in range(4)]
    assert np.median(est) == pytest.approx(tau, rel=0.15)
    assert ci.autocorrelation_time(np.ones(50)) == 1.0 and ci.autocorrelation_time([1.0, 0.0]) == 1.0


def test_effective_sample_size_keeps_independent_windows_and_deflates_clumped_ones():
    rng = np.random.default_rng(4)
    # A window just over n_min must not drop under it by chance: 72..80 independent values.
    kept = [ci.effective_sample_size((rng.random(80) < 0.05).astype(float)) == 80 for _ in range(400)]
    assert np.mean(kept) >= 0.9
    # tau = 9: 5,000 values carry about 5000 / (9 - 8 / sqrt(5000)) = 562 draws.
    n_eff = np.median([ci.effective_sample_size(markov_tail(rng, 5000, 0.05, 0.8)) for _ in range(4)])
    assert n_eff == pytest.approx(5000 / (9 - 8 / math.sqrt(5000)), rel=0.2)


def test_effective_ranks_map_a_smaller_sample_onto_the_values():
    assert ci.effective_ranks(300, 300, 0.95) == ci.order_ranks(300, 0.95)
    lo_m, hi_m = ci.order_ranks(100, 0.95)
    assert ci.effective_ranks(400, 100.7, 0.95) == (math.floor(lo_m * 401 / 101), math.ceil(hi_m * 401 / 101))
    assert ci.effective_ranks(400, 50, 0.95)[1] == 401  # 50 draws cannot bound a p95 from above
    assert ci.effective_ranks(400, 50, 0.95)[0] < ci.effective_ranks(400, 100, 0.95)[0]


def test_clumped_tails_are_not_conclusive_evidence_of_failure():
    """Queueing delays are autocorrelated (lognormal of an AR(1), lag-1 0.9): a window's
    lower end rises above the true p95, a sustainable load's false conclusive failure, far
    more often than its nominal 2.5 % when requests are taken as independent (issue 30)."""
    rng = np.random.default_rng(5)
    true = math.exp(1.6448536)  # p95 of exp(N(0, 1))
    r, n, trials = 0.9, 300, 300
    plain = ordered = 0
    for _ in range(trials):
        z = np.empty(n)
        z[0] = rng.normal()
        e = rng.normal(size=n) * math.sqrt(1 - r * r)
        for i in range(1, n):
            z[i] = r * z[i - 1] + e[i]
        v = np.exp(z)
        plain += ci.quantile_interval(v, 0.95).lo > true
        iv = ci.quantile_interval(v, 0.95, ordered=True)
        ordered += iv.lo > true
        assert iv.hi == ci.quantile_interval(v, 0.95).hi  # the pass side is unchanged
    assert plain / trials > 0.12
    assert ordered / trials <= 0.06


def test_block_bootstrap_lower_end_for_clumped_requests():
    """Requests in arrival order whose gaps share a slowly moving state: the lower end
    from blocks of requests lies below the cluster bootstrap's; independent requests'
    lower ends agree (block 1)."""
    rng = np.random.default_rng(6)
    level = np.repeat(rng.exponential(size=20), 15)  # 300 requests in 20 clumps of 15
    groups = [rng.exponential(scale=s, size=10) for s in level]
    plain = ci.pooled_quantile_interval(groups, 0.95)
    ordered = ci.pooled_quantile_interval(groups, 0.95, ordered=True)
    assert ordered.n_eff < 100 and ordered.lo < plain.lo and ordered.hi == plain.hi
    indep = [rng.exponential(size=10) for _ in range(300)]
    a, b = ci.pooled_quantile_interval(indep, 0.95), ci.pooled_quantile_interval(indep, 0.95, ordered=True)
    assert b.n_eff == 300 and (a.lo, a.hi) == (b.lo, b.hi)
