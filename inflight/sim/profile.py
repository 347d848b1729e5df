"""Step-time profiles: a cost model and what it was made under, saved as JSON. Torch-free.

A profile maps a step's shape (:class:`~inflight.sim.step_shape.StepShape`) to seconds
through its cost model: **measured** (:class:`~inflight.sim.fitted_cost.FittedCostModel`,
fitted to timed steps by ``inflight profile`` or to a serving step log) or **roofline**
(:class:`~inflight.sim.roofline.RooflineCostModel`, derived from a hardware description and
the model's shapes, for machines not at hand).

Saved as JSON (:func:`save_profile`, :func:`load_profile`) with the fit error, the machine,
the model and the engine settings it ran with; :func:`profile_warnings` says when a profile
should not be trusted. A profile for speculative decoding also carries how often drafts
are accepted (``"speculation"``, :mod:`inflight.sim.acceptance`); a verification's cost is
the cost model's, its rows being decode rows.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from inflight.bench.machine import BUSY_OTHERS_CORES, BUSY_STEAL
from inflight.sim.acceptance import AcceptanceProfile
from inflight.sim.fitted_cost import FittedCostModel
from inflight.sim.step_shape import CostModel, StepShape

PROFILE_KIND = "inflight-step-profile"
PROFILE_VERSION = 1


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
        acceptance: per-position draft acceptance rates for a speculating engine (saved as
            ``"speculation"``); None: the profile cannot simulate speculative decoding.
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
    acceptance: AcceptanceProfile | None = None

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
    if profile.acceptance is not None:
        doc["speculation"] = profile.acceptance.to_json()
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
        spec = doc.get("speculation")
        return StepProfile(doc["source"], cost, doc["engine"], doc["model"], doc["machine"],
                           float(over.get("request_s", 0.002)), float(over.get("delivery_s", 0.0005)),
                           doc.get("samples", []), doc.get("created_at"),
                           _acceptance(path, spec))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: a damaged step profile (missing or bad {e}); make it again "
                         f"with `inflight profile`") from None


def _acceptance(path: str | pathlib.Path, doc: Any) -> AcceptanceProfile | None:
    """A profile's ``"speculation"`` object (None when absent). ValueError naming the file."""
    if doc is None:
        return None
    try:
        return AcceptanceProfile.from_json(doc)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: a bad \"speculation\" object ({e}); expected "
                         f"{{\"acceptance_per_position\": [rates in 0..1], \"draft_s\": seconds}}") from None


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
