"""Overload protection (core/overload.py): the step-time cap on the budget and the shedding
of a standing queue, exact against the step model's arithmetic."""

from __future__ import annotations

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import SampleResult
from inflight.core.overload import SLOW_START_TOKENS, OverloadShedder, capped_step_budget
from inflight.core.scheduler import Scheduler
from inflight.core.step_model import StepTimeModel
from inflight.request import Request
from inflight.sampling_params import SamplingParams
from tests.core.test_queue_policy import _ready_model

P = SamplingParams(max_tokens=64)


def _waiting(arrival: float) -> Request:
    return Request(f"w@{arrival}", [1, 2], P, arrival_time=arrival)


def _decoding(rid: str, t: float = 0.0) -> Request:
    r = Request(rid, [1, 2, 3, 4], P, arrival_time=t)
    r.num_computed_tokens = 4
    r.append_output_token(5, None, now=t)
    return r


def test_step_cap_lowers_the_budget_only_while_requests_decode():
    m = _ready_model(a=0.01, b=0.001)  # a step of n tokens takes 0.01 + 0.001 n s
    running = [_decoding("d")]
    assert capped_step_budget(m, running, 2048, 0.5) == 490  # (0.5 - 0.01) / 0.001
    assert capped_step_budget(m, running, 300, 0.5) == 300
    assert capped_step_budget(m, running, 2048, None) == 2048
    prefilling = Request("p", [1] * 10, P, arrival_time=0.0)
    assert capped_step_budget(m, [prefilling], 2048, 0.5) == 2048  # no decode to protect
    # Before the model can answer, a slow start; from two steps of different sizes, their
    # line (the first steps pay one-time costs, so it errs short).
    fresh = StepTimeModel()
    assert capped_step_budget(fresh, running, 2048, 0.5) == SLOW_START_TOKENS == 512
    fresh.observe(100, 0.3)
    assert capped_step_budget(fresh, running, 2048, 0.5) == 512  # one point: no line yet
    fresh.observe(300, 0.5)  # 0.2 + 0.001 n: (0.5 - 0.2) / 0.001
    assert not fresh.ready and capped_step_budget(fresh, running, 2048, 0.5) == 300
    # Every decode keeps its token, and one prefill token keeps admission moving.
    many = [_decoding(f"d{i}") for i in range(600)]
    assert capped_step_budget(m, many, 2048, 0.5) == 601


def _queue(n: int, arrival: float) -> list[Request]:
    return [_waiting(arrival) for _ in range(n)]


def _overloaded(s: OverloadShedder) -> OverloadShedder:
    """``s`` with a standing queue, overloaded (when it becomes so:
    test_shedder_waits_for_a_standing_growing_queue_and_leaves_when_it_drains)."""
    s.observe(0.1, [_waiting(0.0)], num_shed=0)
    s.active = True
    return s


def test_shedder_waits_for_a_standing_growing_queue_and_leaves_when_it_drains():
    m = _ready_model(a=0.1, b=0.0)  # every step 0.1 s
    s = OverloadShedder(1.0, m, interval=10.0, now=0.0)
    head = Request("head", [1], P, arrival_time=0.0)  # the scheduler's next: never refused
    late = Request("late", [1] * 10, P, arrival_time=0.0)
    s.observe(0.1, _queue(1, 0.0), num_shed=0)
    s.observe(5.0, _queue(2, 0.0), num_shed=0)
    assert not s.active and s.shed([head, late], [], 5.0, 100) == []  # a burst: served
    # Standing for 10 s but no longer than it was: a closed loop's queue, not overload.
    s.observe(10.5, _queue(2, 0.0), num_shed=0)
    assert not s.active
    s.observe(10.6, _queue(4, 0.0), num_shed=0)  # the second half's mean 1 above the first's
    assert s.active
    late = Request("late2", [1] * 10, P, arrival_time=0.0)
    (req, why), = s.shed([head, late], [], 10.6, 100)
    assert req is late and "first token predicted 10.700 s after arrival" in why
    # The queue emptied because of the shedding: still overload.
    s.observe(10.7, [], num_shed=1)
    assert s.active
    s.observe(15.0, [], num_shed=0)
    assert s.active
    # Empty, and nothing shed for a whole interval: the load went away.
    s.observe(20.8, [], num_shed=0)
    assert not s.active


def test_an_idle_spell_is_not_a_standing_queue():
    s = OverloadShedder(1.0, _ready_model(a=0.1, b=0.0), interval=10.0, now=0.0)
    s.observe(1.0, [], num_shed=0)
    # No steps while idle; a burst arrives at t=60 and is still queued at the next step.
    s.observe(60.2, _queue(1, 60.0), num_shed=0)
    assert not s.active
    s.observe(69.9, _queue(2, 60.0), num_shed=0)
    assert not s.active
    s.observe(70.1, _queue(3, 60.0), num_shed=0)  # never emptied since t=60, grown by 2
    assert s.active


def test_shedder_predicts_the_first_token_from_the_work_ahead():
    # 0.2 s a step; budget 100 tokens, 2 running -> 98 prompt tokens a step.
    m = _ready_model(a=0.2, b=0.0)
    s = OverloadShedder(1.0, m, interval=0.0, now=0.0)
    _overloaded(s)
    running = [_decoding("d1"), _decoding("d2")]
    now = 50.0
    waiting = [Request(f"w{i}", [1] * 98, P, arrival_time=now) for i in range(7)]
    shed = s.shed(waiting, running, now, 100)
    # w_i's first token needs (i + 1) steps = 0.2 (i + 1) s: w0..w4 within 1 s, w5, w6 not.
    assert [r.request_id for r, _ in shed] == ["w5", "w6"]
    # Judged once: the kept ones are never refused later, however long they wait.
    assert s.shed(waiting[:5], running, now + 30, 100) == []
    # Time already waited counts: a queue that arrived 0.5 s ago keeps w0..w1 only.
    waiting = [Request(f"w{i}", [1] * 98, P, arrival_time=now - 0.5) for i in range(7)]
    assert [r.request_id for r, _ in s.shed(waiting, running, now, 100)] == ["w2", "w3", "w4", "w5", "w6"]


def _sched(**kw) -> tuple[Scheduler, list[float]]:
    t = [0.0]
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=64, **kw)
    sched = Scheduler(cfg, KVCacheManager(4096, 16), clock=lambda: t[0])
    sched.step_model.__dict__.update(_ready_model(a=0.1, b=0.0).__dict__)
    return sched, t


def _run(sched: Scheduler, t: list[float], arrivals_per_step: int, steps: int,
         prompt_len: int = 32) -> tuple[list[Request], list[Request]]:
    """Arrivals, then one step (0.1 s), ``steps`` times; every request decodes 64 tokens,
    so the running set grows and the budget left for prompts shrinks."""
    added, shed = [], []
    for step in range(steps):
        for i in range(arrivals_per_step):
            r = Request(f"{step}-{i}", [1] * prompt_len, P, arrival_time=t[0])
            sched.add_request(r)
            added.append(r)
        out = sched.schedule(now=t[0])
        shed += out.shed
        t[0] += 0.1
        sched.update(out, [SampleResult(s.request, 7, None) for s in out.scheduled if s.samples],
                     now=t[0])
    return added, shed


def test_a_burst_is_served_whole_and_a_standing_queue_is_shed():
    sched, t = _sched(overload_ttft=1.0)
    # A burst: 40 prompts of 32 tokens at once, 64-token steps -> queued for seconds.
    for i in range(40):
        sched.add_request(Request(f"b{i}", [1] * 32, P, arrival_time=0.0))
    _, shed = _run(sched, t, 0, 60)
    assert shed == []
    # Sustained: 2 arrivals a step forever; the queue never empties, so after 10 s the
    # late ones are refused with a reason, and every admitted one started within 1 s
    # of arriving (prediction and time waited agree here: every step takes 0.1 s).
    sched, t = _sched(overload_ttft=1.0)
    added, shed = _run(sched, t, 2, 300)
    assert shed and all(r.shed_reason and "overloaded" in r.shed_reason for r in shed)
    first_shed = min(r.finished_time for r in shed)
    assert 10.0 < first_shed < 15.0  # the queue stands once the running set has grown
    later = [r for r in added if r.arrival_time > first_shed + 1 and r not in shed
             and r.first_scheduled_time is not None]
    assert later and max(r.first_scheduled_time - r.arrival_time for r in later) <= 1.0 + 1e-9
    # Off (the engine's default): nothing is shed, the queue just grows.
    sched, t = _sched()
    _, shed = _run(sched, t, 2, 300)
    assert shed == [] and sched.num_waiting > 100


def test_serve_protects_by_default_and_the_engine_does_not():
    from inflight.cli import build_parser
    from inflight.config import DEFAULT_MAX_STEP_TIME, DEFAULT_OVERLOAD_TTFT

    serve = EngineConfig.from_cli_args(build_parser().parse_args(["serve"]))
    assert (serve.overload_ttft, serve.max_step_time) == (DEFAULT_OVERLOAD_TTFT, DEFAULT_MAX_STEP_TIME)
    off = EngineConfig.from_cli_args(build_parser().parse_args(
        ["serve", "--overload-ttft", "0", "--max-step-time", "off"]))
    assert (off.overload_ttft, off.max_step_time) == (None, None)
    assert (EngineConfig().overload_ttft, EngineConfig().max_step_time) == (None, None)


def test_shedder_predicts_the_step_admission_builds_and_keeps_the_protected():
    # 0.1 s + 1 ms a token; budget 1000 tokens, 2 running.
    m = _ready_model(a=0.1, b=0.001)
    s = OverloadShedder(0.5, m, interval=0.0, now=0.0)
    _overloaded(s)
    running = [_decoding("d1"), _decoding("d2")]

    def queue(tail: int) -> list[Request]:  # fresh requests: each is judged once
        return ([Request("h", [1], P, arrival_time=50.0), Request("w", [1] * 97, P, arrival_time=50.0)]
                + [Request(f"x{i}", [1] * 300, P, arrival_time=50.0) for i in range(tail)])
    # The head (run next, never refused) and a 97-token prompt build a 100-token step
    # (0.2 s), not a full 1000-token one (1.1 s).
    assert s.shed(queue(0), running, 50.0, 1000) == []
    # Behind them, 900 more tokens fill the step to the budget: 1.1 s for all but the head.
    assert [r.request_id for r, _ in s.shed(queue(3), running, 50.0, 1000)] == ["w", "x0", "x1", "x2"]
    # Protected requests are never refused, and still count as work ahead of the rest.
    kept = s.shed(queue(3), running, 50.0, 1000, protected=lambda r: r.request_id == "w")
    assert [r.request_id for r, _ in kept] == ["x0", "x1", "x2"]


def test_a_shed_request_is_told_when_the_work_ahead_has_drained():
    from inflight.outputs import RequestOutput
    m = _ready_model(a=0.1, b=0.001)  # a full 1000-token step: 1.1 s
    s = OverloadShedder(0.5, m, interval=0.0, now=0.0)
    _overloaded(s)
    running = [_decoding("d1"), _decoding("d2")]
    # Five 998-token prompts, one full step each; the first four protected (a fair
    # policy's tenant behind): they stay as work ahead, and q3 goes after them.
    queue = [Request(f"q{k}", [1] * 998, P, arrival_time=50.0) for k in range(5)]
    shed = [r for r, _ in s.shed(queue, running, 50.0, 1000, protected=lambda r: r.request_id < "q3")]
    assert [r.request_id for r in shed] == ["q3", "q4"]
    # q3 needs 4 steps (4.4 s), q4 too (refused requests are not work ahead): a fresh retry
    # meets the 0.5 s target once 3.9 s of that work has drained.
    assert [round(r.shed_retry_after, 6) for r in shed] == [3.9, 3.9]
    head = Request("h", [1], P, arrival_time=50.0)
    alone = Request("z", [1] * 97, P, arrival_time=49.0)  # waited 1 s, its own step is short
    assert [r for r, _ in s.shed([head, alone], running, 50.0, 1000)] == [alone]
    assert alone.shed_retry_after == 1.0  # never sooner than 1 s
    err = RequestOutput("q4", "", [1], [], finished=True, shed_reason="overloaded",
                        retry_after=shed[-1].shed_retry_after).failure()
    assert err is not None and err.retry_after == shed[-1].shed_retry_after


def test_an_idle_spell_after_shedding_ends_overload():
    # A burst shed, the queue emptied at the next step, then nothing for a minute: the next
    # burst (or one long prompt) arriving at the idle server is admitted, not refused by a
    # standing 503 (a newcomer's finding: each refusal restarted the quiet period).
    m = _ready_model(a=0.1, b=0.0)
    s = OverloadShedder(1.0, m, interval=10.0, now=0.0)
    s.observe(0.1, _queue(1, 0.0), num_shed=0)
    s.observe(2.0, _queue(1, 0.0), num_shed=0)
    s.observe(10.5, _queue(3, 0.0), num_shed=0)
    assert s.active

    def head(t: float) -> Request:
        return Request(f"head@{t}", [1], P, arrival_time=t)
    (req, _), = s.shed([head(0.0), Request("late", [1] * 10, P, arrival_time=0.0)], [], 10.5, 100)
    s.observe(10.6, [], num_shed=1)  # the queue empties right after the shedding
    assert s.active  # nothing has been quiet for 10 s yet
    fresh = Request("fresh", [1] * 10, P, arrival_time=70.0)
    assert s.shed([head(70.0), fresh], [], 70.0, 100) == [] and not s.active
    # but a queue that empties and refills within the interval stays overloaded
    s.observe(71.0, _queue(1, 70.0), num_shed=0)
    s.observe(80.5, _queue(3, 70.0), num_shed=0)
    assert s.active
    s.shed([head(70.0), Request("x", [1] * 10, P, arrival_time=70.0)], [], 80.5, 100)
    s.observe(80.6, [], num_shed=1)
    s.shed([head(85.0), Request("soon", [1] * 10, P, arrival_time=85.0)], [], 85.0, 100)
    assert s.active  # 85 - 80.6 < 10 s of quiet


def test_the_running_halves_equal_the_growth_by_its_definition():
    """The O(1) split of the last interval (``_Halves``) against the means computed from
    every sample, over a random queue at irregular step times."""
    import random

    import pytest

    from inflight.core.overload import _Halves

    rng = random.Random(7)
    halves, samples, now = _Halves(10.0), [], 0.0
    for _ in range(3000):
        now += rng.choice([0.001, 0.02, 0.3, 2.0])
        n = rng.randrange(0, 40)
        halves.add(now, n)
        samples.append((now, n))
        kept = [(t, k) for t, k in samples if t >= now - 10.0]
        old = [k for t, k in kept if t < now - 5.0]
        new = [k for t, k in kept if t >= now - 5.0]
        want = sum(new) / len(new) - sum(old) / len(old) if old and new else None
        if want is None:
            assert halves.growth() is None
        else:
            assert halves.growth() == pytest.approx(want, abs=1e-9)
