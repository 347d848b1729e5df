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
