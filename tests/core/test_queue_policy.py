"""Scheduling policies: priority with aging, SLO deadlines and budgets, load shedding."""

from __future__ import annotations

import pytest

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.scheduler import Scheduler
from inflight.core.step_model import StepTimeModel
from inflight.request import Request, RequestStatus
from inflight.sampling_params import SamplingParams
from tests.conftest import FakeRunner
from tests.core.test_scheduler import make_engine

P = SamplingParams(max_tokens=8)


def _ids(out):
    return [s.request.request_id for s in out.scheduled]


def test_priority_admits_lower_first_then_ties_by_arrival():
    sched = Scheduler(EngineConfig(scheduling_policy="priority", max_num_seqs=2,
                                   priority_aging_s=0), KVCacheManager(64, 4))
    for rid, prio, t in (("a", 5, 0.0), ("b", 1, 1.0), ("c", 1, 0.5), ("d", 3, 0.2)):
        sched.add_request(Request(rid, [1, 2, 3], P, arrival_time=t, priority=prio))
    assert _ids(sched.schedule(now=2.0)) == ["c", "b"]


def test_priority_preempts_the_lowest_priority_first():
    # 3 blocks of 4 tokens: three 4-token prompts fill the pool; growing needs a block.
    sched = Scheduler(EngineConfig(scheduling_policy="priority", max_num_seqs=3,
                                   priority_aging_s=0), KVCacheManager(3, 4))
    for rid, prio in (("lo", 9), ("hi", 0), ("mid", 5)):
        sched.add_request(Request(rid, [1, 2, 3, 4], P, arrival_time=0.0, priority=prio))
    out = sched.schedule(now=0.0)
    assert sorted(_ids(out)) == ["hi", "lo", "mid"]
    assert [r.request_id for r in sched.running] == ["hi", "mid", "lo"]
    for s in out.scheduled:
        s.request.append_output_token(7, None, now=0.0)
    out = sched.schedule(now=0.1)
    assert [r.request_id for r in out.preempted] == ["lo", "mid"]
    assert _ids(out) == ["hi"]


def test_priority_aging_prevents_starvation():
    sched = Scheduler(EngineConfig(scheduling_policy="priority", max_num_seqs=1,
                                   priority_aging_s=1.0), KVCacheManager(64, 4))
    sched.add_request(Request("old-low", [1, 2], P, arrival_time=0.0, priority=3))
    sched.add_request(Request("new-high", [1, 2], P, arrival_time=2.5, priority=0))
    # At t=2.5 the old request has aged two levels (3 -> 1): still behind priority 0 ...
    assert _ids(sched.schedule(now=2.5)) == ["new-high"]
    sched.finish_request(sched.running[0], RequestStatus.FINISHED_STOPPED)
    sched.add_request(Request("newer-high", [1, 2], P, arrival_time=4.0, priority=0))
    # ... at t=4 it has aged four levels (3 -> -1) and goes before a fresh priority 0.
    assert _ids(sched.schedule(now=4.0)) == ["old-low"]


def _ready_model(a=0.01, b=0.001):
    m = StepTimeModel()
    for n in (1, 10, 50, 100, 200, 400, 800, 1600):
        m.observe(n, a + b * n)
    return m


def test_step_time_model_fits_a_line():
    m = _ready_model()
    assert m.ready
    a, b = m.coefficients()
    assert a == pytest.approx(0.01, abs=1e-9) and b == pytest.approx(0.001, abs=1e-12)
    assert m.max_tokens_within(0.05) == 40
    assert StepTimeModel().max_tokens_within(0.05) is None


def test_slo_orders_by_deadline_and_caps_the_budget_for_itl():
    sched = Scheduler(EngineConfig(scheduling_policy="slo", ttft_slo=10.0, itl_slo=0.05,
                                   max_num_batched_tokens=512), KVCacheManager(256, 4))
    sched.step_model.__dict__.update(_ready_model().__dict__)
    sched.add_request(Request("late", [1] * 8, P, arrival_time=0.0))            # due t=10
    sched.add_request(Request("urgent", [2] * 8, P, arrival_time=1.0, ttft_slo=2.0))  # due t=3
    out = sched.schedule(now=1.0)
    assert _ids(out) == ["urgent", "late"]
    for s in out.scheduled:
        s.request.append_output_token(7, None, now=1.0)
    sched.add_request(Request("long", [3] * 300, P, arrival_time=1.0))
    out = sched.schedule(now=1.1)
    # ITL target 50 ms at 10 ms + 1 ms/token: 40 tokens a step, 2 of them decodes.
    assert out.num_batched_tokens == 40
    assert [(s.request.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("urgent", 1), ("late", 1), ("long", 38)]


def test_slo_sheds_what_cannot_meet_its_ttft_target():
    engine = make_engine(FakeRunner(), num_blocks=1024, scheduling_policy="slo", ttft_slo=0.5)
    engine.scheduler.step_model.__dict__.update(_ready_model(a=0.01, b=0.001).__dict__)
    import time
    now = time.monotonic()
    # 2000 tokens take ~2 s to prefill: hopeless against a 0.5 s target.
    engine.add_request("hopeless", [3] * 2000, SamplingParams(max_tokens=2), arrival_time=now)
    engine.add_request("fine", [3] * 10, SamplingParams(max_tokens=2), arrival_time=now)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["hopeless"].outputs[0].finish_reason == "abort"
    assert "TTFT deadline" in outs["hopeless"].shed_reason
    assert "fine" not in outs or outs["fine"].shed_reason is None
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 3


def test_slo_shedding_counts_the_prefill_queued_ahead():
    # Each 300-token prompt fits the 1.5 s target alone (0.31 s), but in deadline order the
    # 4th and 5th would wait for 900 tokens ahead: 512-token steps of 0.522 s each.
    sched = Scheduler(EngineConfig(scheduling_policy="slo", ttft_slo=1.5, max_num_batched_tokens=512),
                      KVCacheManager(1024, 4))
    sched.step_model.__dict__.update(_ready_model(a=0.01, b=0.001).__dict__)
    for i in range(5):
        sched.add_request(Request(f"r{i}", [3 + i] * 300, P, arrival_time=1.0 + i * 1e-3))
    out = sched.schedule(now=1.0 + 5e-3)
    assert [r.request_id for r in out.shed] == ["r3", "r4"]
    assert all("TTFT deadline" in r.shed_reason for r in out.shed)
    assert [(s.request.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("r0", 300), ("r1", 212)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)  # r1 mid-prefill, r2 queued


def test_max_queue_time_sheds_requests_that_waited_too_long():
    engine = make_engine(FakeRunner(), max_num_seqs=1, max_queue_time=5.0)
    engine.add_request("runs", [3] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    import time
    engine.add_request("stale", [3] * 4, SamplingParams(max_tokens=2), arrival_time=time.monotonic() - 6)
    engine.add_request("fresh", [3] * 4, SamplingParams(max_tokens=2))
    outs = {o.request_id: o for o in engine.step()}
    assert "max_queue_time" in outs["stale"].shed_reason
    assert outs["stale"].outputs[0].finish_reason == "abort"
    assert "fresh" not in outs and engine.scheduler.num_waiting == 1
