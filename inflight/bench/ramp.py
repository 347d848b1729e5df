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

import numpy as np

from inflight.bench.client import RequestRecord
from inflight.bench.datasets import RequestSpec
from inflight.bench.session import Session, _send, mark_cancelled, wait_idle
from inflight.bench.sustain import in_flight_at


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

    def to_json(self) -> dict:
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
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    rates: list[float] = []
    growth: list[float] = []
    saturated_at: float | None = None
    rate, begin = start_rate, 0.0
    spec_i = 0
    sent: list[RequestSpec] = []
    try:
        for k in range(max_segments):
            rates.append(rate)
            offsets = begin + ramp_offsets(rate, segment_s, seed + k)
            await session.ensure_specs(spec_i + len(offsets))
            for off in offsets:
                delay = off - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                spec = session.specs[spec_i % len(session.specs)]
                spec_i += 1
                sent.append(spec)
                record = RequestRecord(len(records), float(off), warmup=True, phase="calibration")
                records.append(record)
                tasks.append(asyncio.create_task(_send(session, spec, record, clock)))
            end = begin + segment_s
            if end > clock():
                await asyncio.sleep(end - clock())
            now = clock()
            ended = [r if t.done() else _open(r, now) for r, t in zip(records, tasks)]
            q = in_flight_at(ended, np.array([begin, now]))
            growth.append(float(q[1] - q[0]))
            begin = end
            if saturated_at is not None:
                break  # the segment after saturation ran: enough
            if q[1] - q[0] > saturated_growth * max(len(offsets), 1):
                saturated_at = rate
                continue  # one more segment at this rate: steady saturated steps
            rate *= 2
        # Drain: no more arrivals; the queued prompts are prefilled, then the batch decodes
        # down from its largest size, so the log covers decode-only steps of every batch
        # size (under load nearly every step also carries a prompt chunk).
        pending = [t for t in tasks if not t.done()]
        if pending and drain_s > 0:
            await asyncio.wait(pending, timeout=drain_s)
    finally:
        now = clock()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t, r in zip(tasks, records):
            if t.cancelled():
                mark_cancelled(r, now)
    await wait_idle(session)
    outputs = [(spec, r.output_tokens) for spec, r in zip(sent, records) if r.success and r.output_tokens]
    return RampResult(rates, saturated_at, len(records), sum(1 for r in records if r.success),
                      clock(), growth, outputs)


def _open(record: RequestRecord, now: float) -> RequestRecord:
    """A running request as in flight at ``now`` (its end not yet known)."""
    r = RequestRecord(record.index, record.scheduled_time)
    r.end_time = now + 1e9
    return r
