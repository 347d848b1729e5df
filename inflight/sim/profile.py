"""Step-time profiles: how long one engine step of a given shape takes. Torch-free.

A step is described by its shape (:class:`StepShape`, read off the scheduler's plan), and a
profile maps a shape to seconds. Two kinds:

- **measured** (:class:`FittedCostModel`): ``inflight profile`` times real ``Engine.step``
  calls over a grid of shapes and fits, separately for pure-decode and mixed steps, a
  non-negative least-squares model on the shape's features. The features follow Vidur's
  split of a step (Agrawal et al., MLSys 2024): a fixed cost per step (weights read once,
  Python), a piecewise-linear cost in tokens (the linear layers: memory-bound while the
  batch is small, compute-bound after; hinges at ``knots``), a cost per row and per sampled
  row (the vocabulary projection), and the attention terms (KV tokens read by decode rows,
  query-key pairs of prefill chunks). Non-negative coefficients keep it monotone and the
  token curve convex, the roofline's shape.
- **roofline** (:class:`RooflineCostModel`, in :mod:`inflight.sim.roofline`): derived from a
  hardware description and the model's shapes, for machines not at hand.

Saved as JSON (:func:`save_profile`, :func:`load_profile`) with the fit error, the machine,
the model and the engine settings it ran with.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from inflight.bench.machine import BUSY_OTHERS_CORES, BUSY_STEAL

PROFILE_KIND = "inflight-step-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class StepShape:
    """The work of one step. Counts in tokens or rows.

    Attributes:
        tokens: tokens computed (the step's ``num_batched_tokens``).
        rows: requests scheduled.
        samples: rows that sample a token (their last position goes through the LM head).
        prefill_tokens: tokens of rows that compute more than one token (prompt chunks).
        decode_context: KV tokens attended by one-token rows (sum of their context lengths).
        prefill_pairs: query-key pairs of the multi-token rows: a chunk of ``n`` tokens
            after ``s`` computed ones attends ``n * s + n * (n + 1) / 2``.
    """

    tokens: int
    rows: int
    samples: int
    prefill_tokens: int = 0
    decode_context: int = 0
    prefill_pairs: int = 0

    @property
    def kind(self) -> str:
        """``decode`` (every row computes one token) or ``mixed``."""
        return "decode" if self.prefill_tokens == 0 else "mixed"

    @classmethod
    def of(cls, scheduled: Sequence[Any]) -> "StepShape":
        """The shape of a plan's ``ScheduledRequest`` rows (``SchedulerOutput.scheduled``)."""
        tokens = samples = prefill = ctx = pairs = 0
        for s in scheduled:
            n, start = len(s.token_ids), s.num_computed_tokens
            tokens += n
            samples += bool(s.samples)
            if n == 1:
                ctx += start + 1
            else:
                prefill += n
                pairs += n * start + n * (n + 1) // 2
        return cls(tokens, len(scheduled), samples, prefill, ctx, pairs)


class CostModel(Protocol):
    """Seconds for a step of a given shape."""

    def predict(self, shape: StepShape) -> float: ...


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


@dataclass
class StepProfile:
    """A step-time profile and what it was made under.

    Attributes:
        source: ``measured`` or ``roofline``.
        cost: the cost model (``predict(StepShape) -> seconds``).
        engine: engine settings it holds for (dtype, ``num_kv_blocks``, ``block_size``,
            ``max_model_len``, ``eos_token_ids``, ``kv_block_bytes``, ...).
        model: the model's shapes (:class:`inflight.sim.roofline.ModelShape` fields).
        machine: where it was measured, or the hardware description it was derived from.
        request_overhead_s: seconds from a request's arrival to the engine queue (HTTP,
            template, tokenizer); added before a simulated request is queued.
        delivery_s: seconds from a step's end to the client reading its tokens.
        samples: the measured steps ``[StepShape fields..., seconds]`` (measured only).
    """

    source: str
    cost: CostModel
    engine: dict[str, Any]
    model: dict[str, Any]
    machine: dict[str, Any]
    request_overhead_s: float = 0.002
    delivery_s: float = 0.0005
    samples: list[list[float]] = field(default_factory=list)
    created_at: str | None = None

    def predict(self, shape: StepShape) -> float:
        return self.cost.predict(shape)

    def describe(self) -> str:
        where = self.machine.get("name") or self.machine.get("cpu") or "?"
        return f"{self.source} profile ({where}, {self.engine.get('dtype', '?')})"


def save_profile(path: str | pathlib.Path, profile: StepProfile) -> None:
    from inflight.sim.roofline import RooflineCostModel

    if isinstance(profile.cost, FittedCostModel):
        cost = {"kind": "fitted", "fits": profile.cost.to_json()}
    elif isinstance(profile.cost, RooflineCostModel):
        cost = {"kind": "roofline", **profile.cost.to_json()}
    else:
        raise TypeError(f"cannot save a {type(profile.cost).__name__}")
    doc = {"kind": PROFILE_KIND, "version": PROFILE_VERSION, "source": profile.source,
           "created_at": profile.created_at, "machine": profile.machine, "model": profile.model,
           "engine": profile.engine, "overheads": {"request_s": profile.request_overhead_s,
                                                   "delivery_s": profile.delivery_s},
           "cost": cost, "samples": profile.samples}
    pathlib.Path(path).write_text(json.dumps(doc, indent=1))


def load_profile(path: str | pathlib.Path) -> StepProfile:
    """Read a profile saved by :func:`save_profile`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a step profile, or an unknown version or cost kind.
    """
    from inflight.sim.roofline import RooflineCostModel

    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
        raise ValueError(f"{path}: not a JSON step profile ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != PROFILE_KIND:
        raise ValueError(f"{path}: not an inflight step profile (make one with `inflight profile`)")
    if doc.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: profile version {doc.get('version')}, this inflight reads {PROFILE_VERSION}")
    try:
        cost_doc = doc["cost"]
        cost: CostModel
        if cost_doc["kind"] == "fitted":
            cost = FittedCostModel.from_json(cost_doc["fits"])
        elif cost_doc["kind"] == "roofline":
            cost = RooflineCostModel.from_json(cost_doc)
        else:
            raise ValueError(f"{path}: unknown cost model {cost_doc['kind']!r}")
        over = doc.get("overheads", {})
        return StepProfile(doc["source"], cost, doc["engine"], doc["model"], doc["machine"],
                           float(over.get("request_s", 0.002)), float(over.get("delivery_s", 0.0005)),
                           doc.get("samples", []), doc.get("created_at"))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: a damaged step profile (missing or bad {e}); make it again "
                         f"with `inflight profile`") from None


def shape_from_row(row: Sequence[float]) -> tuple[StepShape, float]:
    """A saved sample row ``[tokens, rows, samples, prefill_tokens, decode_context,
    prefill_pairs, seconds]`` back as ``(shape, seconds)``."""
    *dims, seconds = row
    return StepShape(*(int(v) for v in dims)), float(seconds)


def sample_row(shape: StepShape, seconds: float) -> list[float]:
    return [shape.tokens, shape.rows, shape.samples, shape.prefill_tokens, shape.decode_context,
            shape.prefill_pairs, round(seconds, 7)]


MAX_FIT_ERROR_PCT = 25.0  # mean |error| over a fit's steps; the busy-host fits seen were 37 %
MIN_FIT_STEPS = 200


def profile_warnings(profile: "StepProfile") -> list[tuple[str, bool]]:
    """Why a measured or serving profile may mislead, each with whether it should stop a
    prediction from being used (``True``): a fit whose mean error over its steps exceeds
    ``MAX_FIT_ERROR_PCT`` or too few steps (blocking), other processes busy on the host
    while it was measured (blocking: they take the cores in ways a later run will not see),
    or the hypervisor taking more than 10 % of the time (said, not blocking: the run that
    uses the prediction shares that host). From ``machine["host_load"]``
    (``bench.machine.HostLoad``). Empty for a derived (roofline) profile or a sound one."""
    notes: list[tuple[str, bool]] = []
    cost = profile.cost
    if isinstance(cost, FittedCostModel):
        steps = 0
        for kind, fit in cost.fits.items():
            mean = fit.error.get("in_sample_mean_abs_pct")
            steps += int(fit.error.get("steps", 0))
            if mean is not None and mean > MAX_FIT_ERROR_PCT:
                notes.append((f"the {kind} fit's mean error is {mean:.0f}% (> {MAX_FIT_ERROR_PCT:.0f}%): step "
                              f"times vary more than a profile can say (a busy host?)", True))
        if steps < MIN_FIT_STEPS:
            notes.append((f"only {steps} steps were fitted (< {MIN_FIT_STEPS})", True))
    host = profile.machine.get("host_load") or {}
    if host.get("others_cores", 0.0) > BUSY_OTHERS_CORES:
        notes.append((f"other processes kept {host['others_cores']:.2f} cores busy while it was measured", True))
    if host.get("steal", 0.0) > BUSY_STEAL:
        notes.append((f"the hypervisor took {host['steal']:.0%} of the CPU while it was measured: this host's "
                      f"speed at that time", False))
    return notes




def summary_line(fit: Fit) -> str:
    e = fit.error
    cv = e.get("cv_mean_abs_pct")
    cv_s = "" if cv is None or math.isnan(cv) else f", cross-validated {cv:.1f}% (p95 {e['cv_p95_abs_pct']:.1f}%)"
    return (f"{int(e.get('steps', 0))} steps: mean |error| {e['in_sample_mean_abs_pct']:.1f}% "
            f"(p95 {e['in_sample_p95_abs_pct']:.1f}%){cv_s}")


@dataclass
class ConstantCostModel:
    """Every step takes ``seconds`` (for tests against analytic results: a deterministic
    server, one schedule step per time unit)."""

    seconds: float

    def predict(self, shape: StepShape) -> float:
        return self.seconds
