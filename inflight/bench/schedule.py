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
    from inflight.bench.session import ArrivalConfig, Session


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
    # Closed loop: who sent it (``RequestRecord``'s fields of the same names).
    user: int | None = None
    conversation: int | None = None
    turn: int | None = None
    turns: int | None = None


async def plan_point(session: Session, arrival: ArrivalConfig) -> tuple[list[Slot], Window | None]:
    """The point's schedule. Without ``duration``: every request of the mix, all counted.

    With it: arrivals for ``warmup`` seconds (uncounted), then the window of at least
    ``duration`` seconds and at least ``min_requests`` arrivals (its arrivals are the
    sample; for a rate, exactly rate x window of them: ``arrivals.window_offsets``), then
    cool-down arrivals for up to ``drain_timeout`` seconds. With ``max_extensions``, the
    window may grow that many times by its own span (``Window.extensions``: arrivals go on;
    an extension holds as many arrivals as the window). The mix is extended as the schedule
    needs. ValueError when the rate is infinite or a trace is too short.
    """
    if arrival.duration is None:
        n = session.dataset.num_prompts
        return [Slot(sp, o, "sample") for sp, o in zip(session.specs[:n], offsets_for(session, arrival, n))], None
    if arrival.process != "trace" and math.isinf(arrival.rate):
        raise ValueError("a measurement window (--duration) needs a finite --request-rate")
    warm, drain = arrival.phases()
    need = max(1, arrival.min_requests)
    looks = 1 + arrival.max_extensions
    if arrival.process != "trace":
        offs, ends = arrivals.window_offsets(arrival.rate, arrival.process, arrival.burstiness, arrival.seed, warm,
                                             arrival.duration, drain, need, arrival.max_extensions)
        await session.ensure_specs(len(offs))
        return _slots(session, offs, Window(warm, ends[0], ends[0] + drain, tuple(ends[1:])))
    n = len(session.specs) or need  # the trace's own times: extend until they cover the window
    while True:
        have = await session.ensure_specs(n)
        offs = offsets_for(session, arrival, have)
        in_window = [o for o in offs if o >= warm]
        if len(in_window) >= need:
            span = max(arrival.duration, in_window[need - 1] + 1e-9 - warm)
            ends = [warm + k * span for k in range(1, looks + 1)]
            if offs[-1] >= ends[-1] + drain:
                break
        if have < n:  # the trace ran out
            if len(in_window) >= need and offs[-1] >= warm + arrival.duration:
                ends = [e for e in ends if e <= offs[-1]] or ends[:1]  # the extensions that fit
                break  # the window fits; the cool-down is shorter than asked
            raise ValueError(f"the trace has {have} rows from --trace-skip on: too few for a "
                             f"{warm:g} s warm-up and a {arrival.duration:g} s window of >= {need} "
                             f"requests at this time scale")
        n *= 2
    return _slots(session, offs, Window(warm, ends[0], ends[0] + drain, tuple(ends[1:])))


def plan_users(arrival: ArrivalConfig) -> Window:
    """A closed-loop point's window as planned: warm-up (the ramp in it), ``duration``,
    and ``max_extensions`` extensions as long; the users resolve it as they run
    (``users.first_look_end``). ValueError without ``duration``."""
    if arrival.duration is None:
        raise ValueError("users (--users) are measured over a window: they need --duration")
    warm, drain = arrival.phases()
    ends = [warm + k * arrival.duration for k in range(1, arrival.max_extensions + 2)]
    return Window(warm, ends[0], ends[0] + drain, tuple(ends[1:]))


def _slots(session: Session, offsets: list[float], window: Window) -> tuple[list[Slot], Window]:
    """Slots up to the last look's deadline, phased by the longest window: arrivals of an
    extension are sample arrivals until the point is decided (``runner.run_point``)."""
    longest = window.looks()[-1]
    slots = [Slot(sp, o, longest.phase(o)) for sp, o in zip(session.specs, offsets) if o < longest.deadline]
    return slots, window
