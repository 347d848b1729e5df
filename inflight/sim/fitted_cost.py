"""Measured step-time models: features of a step's shape and their non-negative fit. Torch-free.

``inflight profile`` times real ``Engine.step`` calls over a grid of shapes and fits,
separately for pure-decode and mixed steps, a non-negative least-squares model on the
shape's features (:class:`FittedCostModel`). The features follow Vidur's split of a step
(Agrawal et al., MLSys 2024): a fixed cost per step (weights read once, Python), a
piecewise-linear cost in tokens (the linear layers: memory-bound while the batch is small,
compute-bound after; hinges at ``knots``), a cost per row and per sampled row (the
vocabulary projection), and the attention terms (KV tokens read by decode rows, query-key
pairs of prefill chunks). Non-negative coefficients keep it monotone and the token curve
convex, the roofline's shape.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from inflight.sim.step_shape import StepShape


# Knots of the piecewise-linear cost: decode steps in rows (batch size), mixed steps in
# tokens. Costs are interpolated linearly between knots (tent basis), so a step time that
# is not convex in the batch (this CPU's one-call decode path for 1-2 rows) is followed.
KNOTS = {"decode": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), "mixed": (1, 64, 256, 512, 1024, 2048, 4096, 8192)}


def _tents(x: float, knots: Sequence[int]) -> list[float]:
    """Linear-interpolation weights of ``x`` on ``knots`` (past the ends: extrapolated
    from the last two knots, so the cost keeps growing)."""
    w = [0.0] * len(knots)
    if x <= knots[0]:
        w[0] = 1.0
        return w
    for i in range(1, len(knots)):
        if x <= knots[i] or i == len(knots) - 1:
            f = (x - knots[i - 1]) / (knots[i] - knots[i - 1])
            w[i - 1], w[i] = 1.0 - f, f
            return w
    return w


def features(shape: StepShape, knots: Sequence[int], kind: str = "mixed") -> list[float]:
    """The regression features of ``shape``, in :func:`feature_names` order: the
    piecewise-linear basis over rows (decode) or tokens (mixed), then rows, samples and the
    attention terms."""
    x = shape.rows if kind == "decode" else shape.tokens
    extra = [] if kind == "decode" else [float(shape.rows), float(shape.samples)]
    return _tents(float(x), knots) + extra + [shape.decode_context / 1e3, shape.prefill_pairs / 1e6]


def feature_names(knots: Sequence[int], kind: str = "mixed") -> list[str]:
    axis = "rows" if kind == "decode" else "tokens"
    extra = [] if kind == "decode" else ["rows", "samples"]
    return [f"{axis}={k}" for k in knots] + extra + ["decode_context_k", "prefill_pairs_m"]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, ``argmin ||a x - b||`` with ``x >= 0``.

    Lawson and Hanson's active-set method (Solving Least Squares Problems, 1974, ch. 23),
    as ``scipy.optimize.nnls``. ``a``: [m, n] float64, ``b``: [m]; returns x: [n].
    """
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                break
            # Step back to the boundary: the first passive coordinate to hit zero leaves.
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
        w = a.T @ (b - a @ x)
    return x


@dataclass
class Fit:
    """One step kind's fitted coefficients (seconds per feature unit), fit error, and the
    measured / predicted ratios of its steps (the noise a simulation may replay)."""

    kind: str
    knots: list[int]
    coef: list[float]
    error: dict[str, float] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)
    ratio_at: list[float] = field(default_factory=list)  # each ratio's predicted seconds

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(self.coef, features(shape, self.knots, self.kind)))

    def draw_ratio(self, predicted: float, rng: np.random.Generator) -> float:
        """A measured ratio of a step of about this predicted duration: one of the
        ``NOISE_NEIGHBOURS`` steps nearest in rank of predicted seconds. A few
        milliseconds of jitter is 40 % of an 8 ms decode step and 1 % of a 300 ms prefill:
        drawn from every step alike, small steps' jitter would scale up the long ones'
        (a simulated p95 ITL of 590 ms against 300 measured, issue 30). Profiles saved
        without ``ratio_at`` draw from every step."""
        if not self.ratios:
            return 1.0
        if len(self.ratio_at) != len(self.ratios):
            return self.ratios[int(rng.integers(len(self.ratios)))]
        at, ratios = self._by_predicted
        k = min(NOISE_NEIGHBOURS, len(at))
        lo = min(max(0, bisect.bisect_left(at, predicted) - k // 2), len(at) - k)
        return ratios[lo + int(rng.integers(k))]

    @functools.cached_property
    def _by_predicted(self) -> tuple[list[float], list[float]]:
        """(predicted seconds, ratio) of every measured step, sorted by predicted seconds:
        once per profile, not per simulated step (a fit is not changed after it is made)."""
        order = sorted(range(len(self.ratio_at)), key=self.ratio_at.__getitem__)
        return [self.ratio_at[i] for i in order], [self.ratios[i] for i in order]


NOISE_NEIGHBOURS = 50


def _relative_errors(pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    rel = np.abs(pred - y) / y
    return {"mean_abs_pct": float(100 * rel.mean()), "median_abs_pct": float(100 * np.median(rel)),
            "p95_abs_pct": float(100 * np.percentile(rel, 95)), "max_abs_pct": float(100 * rel.max()),
            "bias_pct": float(100 * ((pred - y) / y).mean())}


def fit_kind(kind: str, shapes: Sequence[StepShape], seconds: Sequence[float], knots: Sequence[int],
             folds: int = 5) -> Fit:
    """Fit one step kind by NNLS on relative error (rows weighted by 1 / seconds, so short
    decode steps count as much as long prefills). Knots with no step near them are dropped.

    Steps the machine slowed by more than 3x the median error are left out of a second fit
    (a busy core is not the model); the error is reported over every step, in-sample and by
    ``folds``-fold cross-validation. Raises ValueError with fewer steps than features.
    """
    axis = [s.rows if kind == "decode" else s.tokens for s in shapes]
    lo, hi = min(axis), max(axis)
    # Only knots the steps reach: past the last one the cost is extrapolated from the last
    # two (an unreached knot would get no weight and bend the curve down to zero).
    knots = [k for k in knots if lo <= k <= hi]
    if len(knots) < 2:
        knots = [lo, hi] if hi > lo else [lo, lo + 1]
    x = np.array([features(s, knots, kind) for s in shapes], dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(y) < x.shape[1]:
        raise ValueError(f"{len(y)} {kind} steps cannot fit {x.shape[1]} features")
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # conditioning; undone below

    def solve(idx: np.ndarray) -> np.ndarray:
        coef: np.ndarray = nnls(x[idx] / scale / y[idx, None], np.ones(len(idx))) / scale
        rel = np.abs(x[idx] @ coef - y[idx]) / y[idx]
        keep = idx[rel <= 3 * np.median(rel) + 0.05]
        if len(keep) >= x.shape[1] and len(keep) < len(idx):
            coef = nnls(x[keep] / scale / y[keep, None], np.ones(len(keep))) / scale
        return coef

    coef = solve(np.arange(len(y)))
    pred = x @ coef
    error = {f"in_sample_{k}": v for k, v in _relative_errors(pred, y).items()}
    if folds > 1 and len(y) - math.ceil(len(y) / folds) >= x.shape[1]:
        order = np.random.default_rng(0).permutation(len(y))
        cv = np.empty_like(y)
        for f in range(folds):
            test = order[f::folds]
            cv[test] = x[test] @ solve(np.setdiff1d(order, test))
        error.update({f"cv_{k}": v for k, v in _relative_errors(cv, y).items()})
    error["steps"] = float(len(y))
    ratios = [round(float(r), 4) for r in (y / np.maximum(pred, 1e-9))]
    return Fit(kind, list(knots), [float(c) for c in coef], error, ratios,
               [float(f"{p:.4g}") for p in np.maximum(pred, 1e-9)])


@dataclass
class FittedCostModel:
    """A measured profile's model: one :class:`Fit` per step kind (``decode``, ``mixed``).

    ``sample(shape, rng)`` multiplies the prediction by the ratio of a measured step of
    about the same predicted duration, drawn at random (``Fit.draw_ratio``): the simulated
    steps then vary as the measured ones did, so tail latencies are not those of a
    perfectly steady machine."""

    fits: dict[str, Fit]

    def _fit(self, shape: StepShape) -> Fit:
        return self.fits.get(shape.kind) or next(iter(self.fits.values()))

    def predict(self, shape: StepShape) -> float:
        return max(self._fit(shape).predict(shape), 0.0)

    def in_range(self, shape: StepShape) -> bool:
        """Whether ``shape`` is within the measured sizes (rows for decode steps, tokens for
        mixed ones); past them the cost is extrapolated from the last two knots."""
        fit = self.fits.get(shape.kind)
        if fit is None:
            return False
        return (shape.rows if fit.kind == "decode" else shape.tokens) <= fit.knots[-1]

    def sample(self, shape: StepShape, rng: np.random.Generator) -> float:
        fit = self._fit(shape)
        base = max(fit.predict(shape), 0.0)
        return base * fit.draw_ratio(base, rng)

    def to_json(self) -> dict[str, Any]:
        return {k: asdict(v) for k, v in self.fits.items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "FittedCostModel":
        return cls({k: Fit(v.get("kind", k), list(v["knots"]), list(v["coef"]), dict(v.get("error", {})),
                           list(v.get("ratios", [])), list(v.get("ratio_at", []))) for k, v in d.items()})


def fit_cost_model(shapes: Sequence[StepShape], seconds: Sequence[float]) -> FittedCostModel:
    """Fit decode and mixed steps separately (:func:`fit_kind`). ValueError without steps."""
    fits = {}
    for kind, knots in KNOTS.items():
        idx = [i for i, s in enumerate(shapes) if s.kind == kind]
        if idx:
            fits[kind] = fit_kind(kind, [shapes[i] for i in idx], [seconds[i] for i in idx], knots)
    if not fits:
        raise ValueError("no steps to fit")
    return FittedCostModel(fits)


def summary_line(fit: Fit) -> str:
    """One line on ``fit``'s error: steps, in-sample mean and p95 |error|, and the
    cross-validated ones when there are."""
    e = fit.error
    cv = e.get("cv_mean_abs_pct")
    cv_s = "" if cv is None or math.isnan(cv) else f", cross-validated {cv:.1f}% (p95 {e['cv_p95_abs_pct']:.1f}%)"
    return (f"{int(e.get('steps', 0))} steps: mean |error| {e['in_sample_mean_abs_pct']:.1f}% "
            f"(p95 {e['in_sample_p95_abs_pct']:.1f}%){cv_s}")

