"""A calibration ramp: load that rises until the server saturates, for its step log.

``bench capacity --calibrate`` fits a step-time profile to the server's own steps and asks
the simulator for the operating limit. A profile must cover the step shapes the search
will meet, up to saturation (full batches, prompt chunks beside many decodes); a profile
of light load extrapolates and misses (docs/simulator.md). So the ramp sends the session's
request mix with Poisson arrivals whose rate doubles every ``segment_s`` seconds from
``start_rate`` until the in-flight count grows by more than ``saturated_growth`` of a
segment's arrivals within one segment (the server no longer keeps up), runs one more
segment at that rate, and stops sending. It then lets the requests in flight finish for up
to ``drain_s`` seconds (the batch decodes down from its largest size: decode-only steps of
every size, which loaded steps rarely are) and cancels the rest (the server aborts them).
Nothing here is a verdict; the ramp's records only say where it stopped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inflight.bench.client import RequestRecord
from inflight.bench.datasets import RequestSpec
from inflight.bench.looks import mark_cancelled
from inflight.bench.queue_trend import in_flight_at
from inflight.bench.server_routes import send_request, wait_idle
from inflight.bench.session import Session


@dataclass
class RampResult:
    """What the ramp sent: rates per segment (req/s), the rate it saturated at (None if it
    never did), requests sent and completed, and its wall time (s)."""

    rates: list[float]
    saturated_at: float | None
    sent: int
    completed: int
    seconds: float
    growth: list[float] = field(default_factory=list)  # in-flight growth per segment
    # (spec, output tokens the server generated) of each completed request: where this
    # server's outputs end (its EOS, not the dataset's max_tokens)
    outputs: list[tuple[RequestSpec, int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"rates": self.rates, "saturated_at": self.saturated_at, "sent": self.sent,
                "completed": self.completed, "seconds": round(self.seconds, 1), "growth": self.growth}


def ramp_offsets(rate: float, segment_s: float, seed: int) -> np.ndarray:
    """Poisson arrival offsets (s) within one segment at ``rate``."""
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * segment_s)
    return np.sort(rng.uniform(0.0, segment_s, size=n))


async def run_ramp(session: Session, start_rate: float, segment_s: float = 15.0, max_segments: int = 8,
                   saturated_growth: float = 0.2, seed: int = 0, drain_s: float = 20.0) -> RampResult:
    """Run the ramp (module doc) against the session's server; returns what it did.

    Raises:
        ValueError: ``start_rate`` or ``segment_s`` not positive.
    """
    if not (start_rate > 0 and segment_s > 0):
        raise ValueError("a ramp needs a positive start rate and segment length")
    ramp = _Ramp(session)
    rates: list[float] = []
    growth: list[float] = []
    saturated_at: float | None = None
    rate, begin = start_rate, 0.0
    try:
        for k in range(max_segments):
            rates.append(rate)
            offsets = begin + ramp_offsets(rate, segment_s, seed + k)
            await ramp.send(offsets)
            growth.append(await ramp.growth_over(begin, begin + segment_s))
            begin += segment_s
            if saturated_at is not None:
                break  # the segment after saturation ran: enough
            if growth[-1] > saturated_growth * max(len(offsets), 1):
                saturated_at = rate
                continue  # one more segment at this rate: steady saturated steps
            rate *= 2
        await ramp.drain(drain_s)
    finally:
        await ramp.cancel_rest()
    await wait_idle(session)
    return RampResult(rates, saturated_at, len(ramp.records), sum(1 for r in ramp.records if r.success),
                      ramp.clock(), growth, ramp.outputs())


class _Ramp:
    """The requests a ramp sent, as they go: each one's spec, record and task."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.tasks: list[asyncio.Task[RequestRecord]] = []
        self.sent: list[RequestSpec] = []

    def clock(self) -> float:
        """Seconds since the ramp started."""
        return time.perf_counter() - self._t0

    async def send(self, offsets: np.ndarray) -> None:
        """Send the session's next specs at ``offsets`` (s on ``clock``), each as its own task."""
        await self.session.ensure_specs(len(self.sent) + len(offsets))
        for off in offsets:
            delay = off - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            spec = self.session.specs[len(self.sent) % len(self.session.specs)]
            self.sent.append(spec)
            record = RequestRecord(len(self.records), float(off), warmup=True, phase="calibration")
            self.records.append(record)
            self.tasks.append(asyncio.create_task(send_request(self.session, spec, record, self.clock)))

    async def growth_over(self, begin: float, end: float) -> float:
        """Wait until ``end`` (s); the in-flight count's growth since ``begin``."""
        if end > self.clock():
            await asyncio.sleep(end - self.clock())
        now = self.clock()
        ended = [r if t.done() else _open(r, now) for r, t in zip(self.records, self.tasks)]
        q = in_flight_at(ended, np.array([begin, now]))
        return float(q[1] - q[0])

    async def drain(self, seconds: float) -> None:
        """No more arrivals; wait up to ``seconds`` for the requests in flight. The queued
        prompts are prefilled, then the batch decodes down from its largest size, so the
        log covers decode-only steps of every batch size (under load nearly every step
        also carries a prompt chunk)."""
        pending = [t for t in self.tasks if not t.done()]
        if pending and seconds > 0:
            await asyncio.wait(pending, timeout=seconds)

    async def cancel_rest(self) -> None:
        """Cancel what is still running (the server aborts it) and mark it cancelled."""
        now = self.clock()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for t, r in zip(self.tasks, self.records):
            if t.cancelled():
                mark_cancelled(r, now)

    def outputs(self) -> list[tuple[RequestSpec, int]]:
        """(spec, output tokens) of each request that completed with some output."""
        return [(spec, r.output_tokens) for spec, r in zip(self.sent, self.records) if r.success and r.output_tokens]


def _open(record: RequestRecord, now: float) -> RequestRecord:
    """A running request as in flight at ``now`` (its end not yet known)."""
    r = RequestRecord(record.index, record.scheduled_time)
    r.end_time = now + 1e9
    return r
