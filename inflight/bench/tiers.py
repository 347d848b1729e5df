"""SLO tiers: a per-user output speed floor and a TTFT ceiling, as AA-AgentPerf states its
tiers ("max users per SLO tier"), read as aggregate SLOs the sustained verdict judges.

A user's output speed is the tokens it is streamed a second after its first token: one
over the request's TPOT. A floor of ``S`` tok/s met by 95 % of requests is the SLO
``tpot_p95 <= 1 / S``; the ceiling ``T`` on TTFT is ``ttft_p95 <= T``. A tier keeps the
run's other ``--slo`` targets and replaces those two.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Sequence

from inflight.bench.limit import LimitResult
from inflight.bench.summary import SLO, parse_duration


@dataclass(frozen=True)
class SloTier:
    """``speed``: output tokens/s per user, a floor (at p5); ``ttft``: seconds, a ceiling (at p95)."""

    speed: float
    ttft: float

    @property
    def name(self) -> str:
        return f"{self.speed:g} tok/s per user, TTFT <= {self.ttft:g} s"

    def slo(self, base: SLO) -> SLO:
        """``base`` with this tier's TPOT and TTFT p95 targets in place of its own."""
        aggregate = {k: v for k, v in base.aggregate.items() if k[0] not in ("tpot", "ttft")}
        aggregate[("tpot", "p95")] = 1 / self.speed
        aggregate[("ttft", "p95")] = self.ttft
        return SLO(dict(base.per_request), aggregate)

    def to_json(self) -> dict[str, Any]:
        return {"output_speed_per_user": self.speed, "ttft": self.ttft, "name": self.name}


def parse_tiers(text: str) -> tuple[SloTier, ...]:
    """``"10:2s,30:1s"`` -> tiers (output tok/s per user : TTFT ceiling, seconds or with ``ms``).
    ValueError on anything else: an empty item, a value not finite and above 0, or a
    tier named twice."""
    tiers: list[SloTier] = []
    for part in text.split(","):
        if not part.strip() and text.strip():
            raise ValueError(f"--slo-tiers {text!r} has an empty item (e.g. 10:2s,30:1s)")
        if not part.strip():
            continue
        speed, sep, ttft = part.partition(":")
        try:
            tier = SloTier(float(speed), parse_duration(ttft)) if sep else None
        except ValueError:
            tier = None
        if tier is None or not (0 < tier.speed < math.inf and 0 < tier.ttft < math.inf):
            raise ValueError(f"bad SLO tier {part.strip()!r}: expected TOK_PER_S:TTFT, both finite and > 0, "
                             f"e.g. 10:2s (10 tok/s per user, TTFT <= 2 s)")
        if tier in tiers:
            raise ValueError(f"--slo-tiers names {part.strip()!r} twice")
        tiers.append(tier)
    if not tiers:
        raise ValueError("--slo-tiers names no tier (e.g. 10:2s,30:1s)")
    return tuple(tiers)


def tier_table(tiers: Sequence[SloTier], values: Sequence[str | None], results: Sequence[LimitResult],
               ) -> list[dict[str, Any]]:
    """One row per (knob value, tier), in ``results``' order (each value's tiers in turn):
    the users held, the lowest count that failed above it, and what the users saw at the
    limit (the passing point there: per-user output speed p5 and p50, TTFT p95)."""
    rows = []
    for i, res in enumerate(results):
        tier, value = tiers[i % len(tiers)], values[i // len(tiers)]
        at = res.best_point or {}
        users = (at.get("summary") or {}).get("users") or {}
        speed = users.get("output_speed_per_user") or {}
        rows.append({"value": value, "tier": tier.to_json(), "users": res.limits[0], "failed_at": res.failed_above[0],
                     "held": res.held, "bounded": res.bounded, "speed_p5": speed.get("p5"),
                     "speed_p50": speed.get("p50"), "ttft_p95": ((at.get("summary") or {}).get("ttft") or {}).get("p95")})
    return rows


def tier_lines(rows: Sequence[dict[str, Any]]) -> str:
    """``tier_table``'s rows as a Markdown table: "N users sustained, M not" per tier."""
    def num(v: float | None, fmt: str = ".0f") -> str:
        return "-" if v is None else format(v, fmt)
    out = ["| server | tier | users sustained | failed at | per-user tok/s p5 / p50 at the limit | TTFT p95 (s) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        sustained = num(r["users"]) + ("" if r["held"] else " (not held)") + ("" if r["bounded"] else " (or more)")
        out.append(f"| {r['value'] or 'server'} | {r['tier']['name']} | {sustained} | {num(r['failed_at'])} | "
                   f"{num(r['speed_p5'], '.1f')} / {num(r['speed_p50'], '.1f')} | {num(r['ttft_p95'], '.2f')} |")
    return "\n".join(out)
