"""When each request of a point is sent, and in which phase: the point's schedule.

``plan_point`` turns a session's request mix and an ``ArrivalConfig`` into slots (request,
offset in seconds, phase) and the measurement window. See ``runner.run_point`` for how
the phases are run and ``sustain`` for how the window is judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inflight.bench import arrivals
from inflight.bench.datasets import RequestSpec
from inflight.bench.sustain import Window

if TYPE_CHECKING:
    from inflight.bench.runner import ArrivalConfig, Session


def offsets_for(session: Session, arrival: ArrivalConfig, n: int | None = None) -> list[float]:
    """Send offsets (s) of the first ``n`` (default: all) requests of the session's mix."""
    specs = session.specs if n is None else session.specs[:n]
    return arrivals.make_offsets(len(specs), arrival.process, arrival.rate, arrival.burstiness,
                                 arrival.seed, [s.trace_time for s in specs], arrival.time_scale)


@dataclass
class Slot:
    spec: RequestSpec
    offset: float  # s after the point's start
    phase: str  # warmup | sample | cooldown


async def plan_point(session: Session, arrival: ArrivalConfig) -> tuple[list[Slot], Window | None]:
    """The point's schedule. Without ``duration``: every request of the mix, all counted.

    With it: arrivals for ``warmup`` seconds (uncounted), then the window of at least
    ``duration`` seconds and at least ``min_requests`` arrivals (its arrivals are the
    sample; for a rate, exactly rate x window of them: ``arrivals.window_offsets``), then
    cool-down arrivals for up to ``drain_timeout`` seconds. The mix is extended as the
    schedule needs. ValueError when the rate is infinite or a trace is too short.
    """
    if arrival.duration is None:
        n = session.dataset.num_prompts
        return [Slot(sp, o, "sample") for sp, o in zip(session.specs[:n], offsets_for(session, arrival, n))], None
    if arrival.process != "trace" and math.isinf(arrival.rate):
        raise ValueError("a measurement window (--duration) needs a finite --request-rate")
    warm, drain = arrival.phases()
    need = max(1, arrival.min_requests)
    if arrival.process != "trace":
        offs, end = arrivals.window_offsets(arrival.rate, arrival.process, arrival.burstiness, arrival.seed, warm,
                                            arrival.duration, drain, need)
        await session.ensure_specs(len(offs))
        return _slots(session, offs, Window(warm, end, end + drain))
    n = len(session.specs) or need  # the trace's own times: extend until they cover the window
    while True:
        have = await session.ensure_specs(n)
        offs = offsets_for(session, arrival, have)
        in_window = [o for o in offs if o >= warm]
        if len(in_window) >= need:
            end = max(warm + arrival.duration, in_window[need - 1] + 1e-9)
            if offs[-1] >= end + drain:
                break
        if have < n:  # the trace ran out
            if len(in_window) >= need and offs[-1] >= warm + arrival.duration:
                break  # the window fits; the cool-down is shorter than asked
            raise ValueError(f"the trace has {have} rows from --trace-skip on: too few for a "
                             f"{warm:g} s warm-up and a {arrival.duration:g} s window of >= {need} "
                             f"requests at this time scale")
        n *= 2
    return _slots(session, offs, Window(warm, end, end + drain))


def _slots(session: Session, offsets: list[float], window: Window) -> tuple[list[Slot], Window]:
    slots = [Slot(sp, o, "warmup" if o < window.start else "sample" if o < window.end else "cooldown")
             for sp, o in zip(session.specs, offsets) if o < window.deadline]
    return slots, window
