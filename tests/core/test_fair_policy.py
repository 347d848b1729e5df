"""The ``fair`` policy: Virtual Token Counter admission between tenants (Sheng et al., OSDI
2024), counted exactly."""

from __future__ import annotations

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import SampleResult
from inflight.core.queue_policy import FairPolicy
from inflight.core.scheduler import Scheduler
from inflight.request import Request
from inflight.sampling_params import SamplingParams

P = SamplingParams(max_tokens=4)


def _req(rid: str, tenant: str, n: int = 10, t: float = 0.0, priority: int = 0) -> Request:
    return Request(rid, [1] * n, P, arrival_time=t, tenant=tenant, priority=priority)


def test_order_merges_tenants_by_counter_as_admission_would_move_them():
    f = FairPolicy(aging_s=0)
    f.counters.update({"a": 0.0, "b": 25.0})
    waiting = [_req(f"a{i}", "a") for i in range(4)] + [_req(f"b{i}", "b") for i in range(2)]
    # a: 0 -> 10 -> 20 -> 30 ...; b: 25 -> 35. Ties go to the earlier head arrival.
    assert [r.request_id for r in f.waiting_order(waiting, now=0.0)] == \
        ["a0", "a1", "a2", "b0", "a3", "b1"]


def test_within_a_tenant_priority_then_arrival():
    f = FairPolicy(aging_s=0)
    waiting = [_req("x", "a", t=0.0, priority=5), _req("y", "a", t=1.0, priority=0),
               _req("z", "a", t=2.0, priority=0)]
    assert [r.request_id for r in f.waiting_order(waiting, now=3.0)] == ["y", "z", "x"]


def test_counters_charge_prompt_tokens_and_twice_the_output():
    f = FairPolicy(aging_s=0)
    r = _req("r", "a", n=10)
    f.charge(r, 10, 1)  # the prefill step samples the first token
    f.charge(r, 0, 1)   # a decode
    assert f.counters["a"] == 10 + 2 + 2


def test_a_returning_tenant_is_lifted_to_the_least_active_counter():
    f = FairPolicy(aging_s=0)
    f.counters.update({"a": 500.0, "b": 300.0, "idle": 5.0})
    waiting, running = [_req("a1", "a")], [_req("b1", "b")]
    f.on_arrival(_req("i1", "idle"), waiting, running)
    assert f.counters["idle"] == 300.0  # no credit banked while idle
    f.counters["rich"] = 900.0
    f.on_arrival(_req("r1", "rich"), waiting, running)
    assert f.counters["rich"] == 900.0  # never lowered


def _serve(policy: str, steps: int) -> dict[str, float]:
    """A heavy tenant queues 30 requests at t=0, a light one sends one every 0.5 s; 4
    running at most, each generating 4 tokens, 0.1 s a step. Returns each light request's
    wait from arrival to admission."""
    t = [0.0]
    sched = Scheduler(EngineConfig(scheduling_policy=policy, max_num_seqs=4,
                                   max_num_batched_tokens=256, priority_aging_s=0),
                      KVCacheManager(1024, 16), clock=lambda: t[0])
    for i in range(30):
        sched.add_request(_req(f"heavy{i}", "heavy", t=0.0))
    light = []
    for step in range(steps):
        if step % 5 == 0 and len(light) < 4:
            light.append(_req(f"light{len(light)}", "light", t=t[0]))
            sched.add_request(light[-1])
        out = sched.schedule(now=t[0])
        t[0] += 0.1
        sched.update(out, [SampleResult(s.request, 7, None) for s in out.scheduled if s.samples],
                     now=t[0])
    return {r.request_id: float("inf") if r.first_scheduled_time is None
            else r.first_scheduled_time - r.arrival_time for r in light}


def test_fair_admits_the_light_tenant_ahead_of_the_heavy_backlog():
    fcfs, fair = _serve("fcfs", 40), _serve("fair", 40)
    # fcfs: behind the 30 heavy requests (4 at a time, 4 steps each: 3 s to clear).
    assert min(fcfs.values()) > 1.5
    # fair: the light tenant's counter is the least, so each starts at once or at the
    # next free slot (within the 4 steps a running request lasts).
    assert len(fair) == 4 and max(fair.values()) <= 0.4 + 1e-9


def test_preemption_takes_the_tenant_with_the_largest_counter():
    f = FairPolicy(aging_s=0)
    f.counters.update({"a": 10.0, "b": 99.0})
    running = [_req("b-old", "b"), _req("a1", "a"), _req("b-new", "b"), _req("a2", "a")]
    assert running[f.preemption_victim(running)].request_id == "b-new"


def test_tenants_ahead_are_more_than_a_step_of_tokens_above_the_least_active():
    f = FairPolicy(aging_s=0, even_tokens=100)
    f.counters.update({"light": 50.0, "mid": 140.0, "heavy": 500.0, "gone": 9999.0})
    running = [_req("h", "heavy"), _req("m", "mid")]
    # light (waiting) sets the bar at 150: mid is within a step of it, heavy is not; a
    # tenant with nothing running or waiting is not active, whatever its counter.
    assert f.tenants_ahead(running, [_req("l", "light")]) == {"heavy"}
    assert f.tenants_ahead(running, []) == {"heavy"}  # bar 240 from mid
    assert f.tenants_ahead([_req("h", "heavy")], [_req("h2", "heavy")]) == frozenset()
    f.counters["heavy"] = 240.0
    assert f.tenants_ahead(running, []) == frozenset()  # even: no step is split


def _fair_sched(**kw) -> tuple[Scheduler, list[float]]:
    t = [0.0]
    cfg = EngineConfig(scheduling_policy="fair", max_num_batched_tokens=64, max_num_seqs=16,
                       priority_aging_s=0, **kw)
    return Scheduler(cfg, KVCacheManager(1024, 16), clock=lambda: t[0]), t


def _step(sched: Scheduler, t: list[float]) -> list[str]:
    out = sched.schedule(now=t[0])
    t[0] += 0.1
    sched.update(out, [SampleResult(s.request, 7, None) for s in out.scheduled if s.samples], now=t[0])
    return sorted(s.request.request_id for s in out.scheduled)


def test_a_tenant_behind_gets_its_first_token_from_a_step_without_the_tenants_ahead():
    sched, t = _fair_sched()
    long = SamplingParams(max_tokens=50)
    for rid, tenant in (("h0", "heavy"), ("h1", "heavy"), ("l0", "light")):
        sched.add_request(Request(rid, [1] * 10, long, arrival_time=0.0, tenant=tenant))
    assert _step(sched, t) == ["h0", "h1", "l0"]  # even counters: one step for all
    sched.policy.counters["heavy"] += 1000  # heavy has had far more than its share
    sched.add_request(Request("h2", [1] * 30, long, arrival_time=t[0], tenant="heavy"))
    sched.add_request(Request("l1", [1] * 20, long, arrival_time=t[0], tenant="light"))
    # The light prompt waits for its first step: heavy's decodes and its prompt sit out.
    assert _step(sched, t) == ["l0", "l1"]
    assert sched.num_running == 4 and [r.request_id for r in sched.waiting] == ["h2"]
    # Another light arrival at once: heavy's rows and h2 were left out last step, so they
    # come back now (never left out twice running), beside it.
    sched.add_request(Request("l2", [1] * 20, long, arrival_time=t[0], tenant="light"))
    assert _step(sched, t) == ["h0", "h1", "h2", "l0", "l1", "l2"]
    # A third at once: now heavy's rows were served last step, so they sit out again.
    sched.add_request(Request("l3", [1] * 20, long, arrival_time=t[0], tenant="light"))
    assert _step(sched, t) == ["l0", "l1", "l2", "l3"]
    assert _step(sched, t) == ["h0", "h1", "h2", "l0", "l1", "l2", "l3"]  # nothing waits


def test_tenants_within_a_step_of_tokens_never_split_a_step():
    sched, t = _fair_sched()  # a step: 64 tokens
    long = SamplingParams(max_tokens=50)
    for i in range(3):
        sched.add_request(Request(f"a{i}", [1] * 10, long, arrival_time=0.0, tenant="a"))
    _step(sched, t)
    sched.add_request(Request("b0", [1] * 10, long, arrival_time=t[0], tenant="b"))
    assert sched.policy.counters["b"] == sched.policy.counters["a"] == 36  # lifted: 3 x (10 + 2)
    sched.policy.counters["a"] += 60  # ahead, but by less than a step's 64 tokens: even
    assert _step(sched, t) == ["a0", "a1", "a2", "b0"]
    sched.add_request(Request("b1", [1] * 10, long, arrival_time=t[0], tenant="b"))
    sched.policy.counters["a"] += 200  # now a whole step ahead: b1's step leaves a out
    assert _step(sched, t) == ["b0", "b1"]


def test_overload_sheds_the_tenants_ahead_and_keeps_the_one_behind():
    from tests.core.test_queue_policy import _ready_model
    sched, t = _fair_sched(overload_ttft=0.5)
    sched.step_model.__dict__.update(_ready_model(a=0.3, b=0.0).__dict__)  # 0.3 s a step
    long = SamplingParams(max_tokens=50)
    for rid, tenant in (("h0", "heavy"), ("l0", "light")):
        sched.add_request(Request(rid, [1] * 10, long, arrival_time=0.0, tenant=tenant))
    _step(sched, t)
    sched.policy.counters["heavy"] += 1000
    t[0] = 5.0
    # A standing queue that shed a request 0.1 s ago (test_overload covers when): without
    # the recent shed, the idle spell since t=0 would end overload first.
    sched.overload.active, sched.overload.last_shed = True, 4.5
    for rid, tenant in (("h1", "heavy"), ("l1", "light")):
        sched.add_request(Request(rid, [1] * 10, long, arrival_time=4.6, tenant=tenant))
    # Both waited 0.4 s and need a 0.3 s step: 0.7 s > 0.5 s. Only heavy's is refused.
    out = sched.schedule(now=t[0])
    assert [r.request_id for r in out.shed] == ["h1"]
    assert "l1" in {s.request.request_id for s in out.scheduled}
