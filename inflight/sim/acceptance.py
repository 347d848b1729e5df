"""Speculative steps in the simulator: how many drafts a verification keeps. Torch-free.

A simulated replica has no text to draft from, so its proposer offers filler drafts
(``virtual_replica.VirtualProposer``) and its runner draws how many of them the target
model would have accepted from an :class:`AcceptanceProfile`: per draft position ``i``
the conditional rate ``p_i = P(draft i accepted | drafts 0..i-1 accepted)``. A
verification of ``n`` drafts then keeps ``1 + A`` tokens, ``A`` the first position whose
draw fails (the target's own token at the first rejected row, or after the last draft,
always comes on top), as the rejection sampler's prefix rule (Leviathan et al., ICML
2023) has it.

Where the rates come from: a server's ``SpecDecodeStats`` (``core.speculation``, the
counters of vLLM's ``vllm:spec_decode_*`` metrics). ``accepted_per_position[i]`` counts
the verifications whose draft ``i`` was accepted, which implies 0..i-1 were, so
``p_0 = accepted_per_position[0] / num_drafts`` and ``p_i = accepted_per_position[i] /
accepted_per_position[i-1]`` (:meth:`AcceptanceProfile.from_counts`). ``inflight serve
--step-log`` writes those counters to the step log and a profile fitted to it
(``inflight profile --from-step-log``, ``bench capacity --calibrate``) carries the rates.

In a profile's JSON (``profile.save_profile``), next to ``"cost"``::

    "speculation": {"acceptance_per_position": [0.72, 0.61, 0.55, 0.5],
                    "draft_s": 0.0,
                    "measured_drafts": 1834}

``acceptance_per_position``: the conditional rates ``p_0, p_1, ...`` in [0, 1]; a
simulation drafting more tokens than listed uses the last rate for the positions past
them. ``draft_s``: seconds a proposing step adds per draft position (a draft model's
sequential forward passes; 0 for ngram lookup, whose cost is a Python loop); not measured
by any tool yet. ``measured_drafts``: the verifications the rates were measured over
(absent when set by hand).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inflight.core.speculation import SpecDecodeStats


@dataclass(frozen=True)
class AcceptanceProfile:
    """How often drafts are accepted, per position, and what proposing costs.

    Attributes:
        per_position: ``p_i = P(draft i accepted | drafts 0..i-1 accepted)``, each in
            [0, 1]; positions past the list use its last rate.
        draft_s: seconds a proposing step adds per draft position (>= 0).
        measured_drafts: verifications the rates were measured over; None when set by hand.

    Raises:
        ValueError: an empty list, a rate outside [0, 1], a negative ``draft_s``.
    """

    per_position: tuple[float, ...]
    draft_s: float = 0.0
    measured_drafts: int | None = None

    def __post_init__(self) -> None:
        if not self.per_position:
            raise ValueError("acceptance_per_position: at least one rate is needed")
        bad = [p for p in self.per_position if not 0.0 <= p <= 1.0]
        if bad:
            raise ValueError(f"acceptance_per_position: rates must be in [0, 1], got {bad[0]!r}")
        if not self.draft_s >= 0.0:
            raise ValueError(f"draft_s: must be >= 0, got {self.draft_s!r}")

    def rate(self, position: int) -> float:
        """``p_position`` (the last listed rate past the list)."""
        return self.per_position[min(position, len(self.per_position) - 1)]

    def draw(self, num_drafts: int, rng: np.random.Generator) -> int:
        """Drafts accepted in one verification of ``num_drafts`` (0..num_drafts): one
        uniform draw per position until one fails. A rate of 1.0 always accepts, 0.0
        never."""
        accepted = 0
        while accepted < num_drafts and rng.random() < self.rate(accepted):
            accepted += 1
        return accepted

    def expected_accepted(self, num_drafts: int) -> float:
        """Mean drafts accepted in a verification of ``num_drafts``:
        ``sum_{n=1..num_drafts} prod_{i<n} p_i``."""
        total, survive = 0.0, 1.0
        for i in range(num_drafts):
            survive *= self.rate(i)
            total += survive
        return total

    @classmethod
    def from_counts(cls, num_drafts: int, accepted_per_position: Sequence[int],
                    draft_s: float = 0.0) -> AcceptanceProfile:
        """Conditional rates from ``SpecDecodeStats``-style counts (module docstring).

        Positions after one no verification reached (a zero count before them) are left
        out: the last measured rate stands for them. A verification that drafted fewer
        than k tokens (near ``max_tokens``) and accepted them all lowers the next
        position's rate a little: the counters do not say how many drafts it had.

        Raises:
            ValueError: no verification counted, or counts that are not non-increasing
                from ``num_drafts`` down.
        """
        if num_drafts <= 0:
            raise ValueError("no verification was counted (num_drafts is 0): no acceptance rates to derive")
        rates: list[float] = []
        before = num_drafts
        for count in accepted_per_position:
            if count > before or count < 0:
                raise ValueError(f"accepted_per_position {list(accepted_per_position)}: each count must be "
                                 f"between 0 and the one before it (num_drafts {num_drafts} first)")
            if before == 0:
                break
            rates.append(count / before)
            before = count
        return cls(tuple(rates) or (0.0,), draft_s, num_drafts)

    @classmethod
    def from_stats(cls, stats: SpecDecodeStats, draft_s: float = 0.0) -> AcceptanceProfile:
        """Rates from a scheduler's ``speculation.stats`` (see :meth:`from_counts`)."""
        return cls.from_counts(stats.num_drafts, stats.accepted_per_position, draft_s)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"acceptance_per_position": list(self.per_position), "draft_s": self.draft_s}
        if self.measured_drafts is not None:
            doc["measured_drafts"] = self.measured_drafts
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AcceptanceProfile:
        """The profile's ``"speculation"`` object back (ValueError on bad values, KeyError
        without ``acceptance_per_position``)."""
        measured = doc.get("measured_drafts")
        return cls(tuple(float(p) for p in doc["acceptance_per_position"]), float(doc.get("draft_s", 0.0)),
                   None if measured is None else int(measured))


def stats_json(stats: SpecDecodeStats) -> dict[str, Any]:
    """The counters as the step log writes them (``{"spec_decode": ...}`` lines)."""
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "accepted_per_position": list(stats.accepted_per_position)}


def add_stats(total: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Two servers' (or step logs') counters summed; positions padded to the longer list."""
    if total is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in more.items()}
    a, b = list(total["accepted_per_position"]), list(more["accepted_per_position"])
    width = max(len(a), len(b))
    a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    return {"num_drafts": total["num_drafts"] + more["num_drafts"],
            "num_draft_tokens": total["num_draft_tokens"] + more["num_draft_tokens"],
            "num_accepted_tokens": total["num_accepted_tokens"] + more["num_accepted_tokens"],
            "accepted_per_position": [x + y for x, y in zip(a, b)]}


def acceptance_of(counters: dict[str, Any] | None) -> AcceptanceProfile | None:
    """The rates of step-log counters (:func:`stats_json`), None when there are none or
    no verification was counted."""
    if not counters or not counters.get("num_drafts"):
        return None
    return AcceptanceProfile.from_counts(int(counters["num_drafts"]),
                                         [int(c) for c in counters["accepted_per_position"]])
