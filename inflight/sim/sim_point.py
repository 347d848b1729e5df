"""A bench point on the simulator: the point's schedule (``bench.schedule.plan_point``:
warm-up, window, cool-down) replayed through the :class:`~inflight.sim.simulator.Simulator`,
returned as the same ``PointResult`` a measured point has: request records with
streamed-chunk times, the summary, scraped gauges and counter deltas."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from inflight.bench.client import RequestRecord
from inflight.bench.conversations import with_stand_in_answers
from inflight.bench.looks import goes_on, look_summary, mark_cancelled, view_at
from inflight.bench.metrics_scrape import Snapshot
from inflight.bench.datasets import RequestSpec
from inflight.bench.schedule import Slot, plan_point, plan_users
from inflight.bench.session import ArrivalConfig, PointResult, Session
from inflight.bench.summary import SLO, summarize
from inflight.bench.sustain import Thresholds, Window, judge
from inflight.bench.users import ConversationSupply, MixExhausted
from inflight.sim.closed_loop import ClosedLoop
from inflight.sim.simulator import SimOutcome, SimRequest, SimRun

if TYPE_CHECKING:
    from inflight.sim.bench import SimSetup


async def simulate_point(setup: SimSetup, session: Session, arrival: ArrivalConfig, slo: SLO | None = None,
                         thresholds: Thresholds | None = None) -> PointResult:
    """``run_point`` on the simulator: the point's schedule, simulated; the same result.
    Every look a real point could take is simulated, then judged as it stood at each look
    (``looks.view_at``), so an undecided point is extended as a real one would be."""
    t0 = time.perf_counter()
    simulate = _simulate_users if arrival.users else _simulate_schedule
    run, slots, window = await simulate(setup, session, arrival)
    wall = time.perf_counter() - t0
    records = [_record(slot, o, run.end_time) for slot, o in zip(slots, run.outcomes)
               if o.sent or slot.phase != "cooldown"]  # a cool-down request never sent: the sample had ended
    samples, history = run.samples, list[dict[str, Any]]()
    if window is not None:
        records, window, samples, history = _judge_looks(records, window, run.samples, run.end_time, slo,
                                                         thresholds, arrival)
    steps = sum(r["steps"] for r in run.replicas)
    beyond = sum(r["extrapolated_steps"] for r in run.replicas)
    if beyond:
        print(f"warning: {beyond} of {steps} simulated steps were larger than any the profile measured; "
              f"their cost is extrapolated (profile the shapes you simulate: docs/simulator.md)", file=sys.stderr)
    before = Snapshot({k: 0.0 for k in run.counters})
    after = Snapshot(dict(run.counters))
    result = PointResult(arrival, records, summarize(records, slo), samples, before, after, time.time(), window,
                         history)
    result.finish_summary()
    result.summary["simulation"] = {"wall_seconds": wall, "simulated_seconds": run.end_time,
                                    "replicas": run.replicas, "router": {"policy": setup.router, **run.router}}
    return result


async def _simulate_schedule(setup: SimSetup, session: Session, arrival: ArrivalConfig,
                             ) -> tuple[SimRun, list[Slot], Window | None]:
    """An open-loop point: its schedule, simulated."""
    slots, window = await plan_point(session, arrival)
    longest = window.looks()[-1] if window is not None else None
    # A multi-turn mix: follow-ups carry their history, stand-in answers for the real ones.
    sent = with_stand_in_answers([s.spec for s in slots])
    reqs = [SimRequest(i, s.offset, setup.prompt_ids(s.spec, session.endpoint, x), s.spec.output_len,
                       setup.output_len(s.spec), s.spec.ignore_eos,
                       watched=window is not None and s.phase == "sample",
                       not_after_done=s.phase == "cooldown")
            for i, (s, x) in enumerate(zip(slots, sent))]
    run = setup.simulator(session.load, arrival.seed).run(reqs, until=None if longest is None else longest.deadline)
    return run, slots, window


async def _simulate_users(setup: SimSetup, session: Session, arrival: ArrivalConfig,
                          ) -> tuple[SimRun, list[Slot], Window | None]:
    """A closed-loop point (``closed_loop.ClosedLoop``), run again on a longer mix while the
    users run out of conversations; its slots are the requests as sent, phased by the
    resolved window, with who sent them."""
    supply = ConversationSupply(session)
    await supply.reserve(2 * (arrival.users or 1))

    def make(index: int, spec: RequestSpec, sent: RequestSpec, at: float) -> SimRequest:
        return SimRequest(index, at, setup.prompt_ids(spec, session.endpoint, sent), spec.output_len,
                          setup.output_len(spec), spec.ignore_eos)
    while True:
        supply.taken = 0
        loop = ClosedLoop(arrival, supply, plan_users(arrival), arrival.min_requests, make)
        try:
            run = setup.simulator(session.load, arrival.seed).run(loop.start(), users=loop)
            break
        except MixExhausted:
            have = len(supply.complete())
            await supply.reserve(2 * have)
            if len(supply.complete()) == have:
                raise RuntimeError(f"the mix ran out of conversations after {have}") from None
    window = loop.resolved_window()
    longest = window.looks()[-1]
    sent = [(s, o) for s, o in zip(loop.requests, run.outcomes) if o.sent]  # a user thinking at the end sent none
    run.outcomes = [o for _, o in sent]
    slots = [Slot(s.spec, o.send_time, longest.phase(o.send_time), s.user, s.conversation.key, s.turn,
                  len(s.conversation.turns)) for s, o in sent]
    return run, slots, window


def _record(slot: Slot, o: SimOutcome, end: float) -> RequestRecord:
    """The request record of a simulated request (``end``: when the run stopped, s)."""
    r = RequestRecord(o.index, slot.offset, warmup=slot.phase != "sample", phase=slot.phase, user=slot.user,
                      conversation=slot.conversation, turn=slot.turn, turns=slot.turns)
    r.prompt_len, r.output_len = slot.spec.prompt_len, slot.spec.output_len
    r.send_time = o.send_time
    if o.end_time is None:
        r.chunk_times = list(o.token_times)
        mark_cancelled(r, end)
    else:
        r.chunk_times, r.end_time = list(o.token_times), o.end_time
        r.status, r.error = o.status, o.error
        r.success = o.status == 200 and o.finish_reason in ("stop", "length")
        r.finish_reason = o.finish_reason
        r.prompt_tokens, r.output_tokens = o.prompt_tokens, o.output_tokens
        r.output_tokens_from_usage = True
    return r


def _judge_looks(records: list[RequestRecord], window: Window, samples: list[dict[str, Any]], end: float,
                 slo: SLO | None, thresholds: Thresholds | None, arrival: ArrivalConfig,
                 ) -> tuple[list[RequestRecord], Window, list[dict[str, Any]], list[dict[str, Any]]]:
    """The records, window and gauge samples as they stood at the look that decided the
    point (the first not undecided, or the last), and the earlier looks' verdicts."""
    looks = window.looks()
    history: list[dict[str, Any]] = []
    for k, w in enumerate(looks):
        sample = [r for r in records if w.phase(r.scheduled_time) == "sample"]
        ended = [r.end_time for r in sample if not (r.unfinished or r.cancelled)]
        # As a real point: the look is taken when its sample has ended, or at its deadline.
        now = max(ended) if sample and len(ended) == len(sample) else w.deadline
        now = min(now, w.deadline, end)
        done = [not (r.unfinished or r.cancelled) and r.end_time <= now for r in records]
        view = view_at(records, done, None, w, now)
        seen = [s for s in samples if s["t"] <= now]
        if k == len(looks) - 1 or slo is None or not slo.aggregate:
            return view, w, seen, history
        verdict = judge(view, w, slo, None, thresholds, seen, final=False)
        if not goes_on(verdict, arrival):
            return view, w, seen, history
        history.append(look_summary(verdict, w))
    raise AssertionError("unreachable: the last look returns")
