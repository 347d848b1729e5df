"""``--max-loras`` in the scheduler (``core.adapter_cap``): exact schedules over a fake
runner. At most ``max_loras`` adapters run at once, base requests are never held back, and
an adapter refused for the cap is not overtaken by later requests for running adapters."""

from __future__ import annotations

from inflight.config import EngineConfig
from inflight.core.adapter_cap import AdapterCap
from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import SampleResult
from inflight.core.scheduler import Scheduler
from inflight.request import Request
from inflight.sampling_params import SamplingParams


def _req(rid: str, lora_id: int, max_tokens: int = 3) -> Request:
    r = Request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                arrival_time=0.0, lora_name=None if lora_id == 0 else f"a{lora_id}")
    r.lora_id = lora_id
    return r


def _schedule(max_loras: int, requests: list[Request]) -> list[list[str]]:
    """Run the scheduler with every request sampling token 9 until all finish; the ids
    scheduled in each step."""
    sched = Scheduler(EngineConfig(block_size=4), KVCacheManager(64, 4, True),
                      max_model_len=64, clock=lambda: 0.0, max_loras=max_loras)
    for r in requests:
        sched.add_request(r)
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append([s.request.request_id for s in out.scheduled])
        if max_loras:
            assert len({s.request.lora_id for s in out.scheduled} - {0}) <= max_loras
        sched.update(out, [SampleResult(s.request, 9, None) for s in out.scheduled if s.samples],
                     0.0)
    return steps


def test_one_slot_serves_adapters_in_turn_and_base_at_once():
    steps = _schedule(1, [_req("A1", 1), _req("B", 2), _req("A2", 1), _req("base", 0)])
    # B is refused behind A1's adapter, so A2 (A1's adapter, after B) waits too; base joins.
    assert steps[0] == ["A1", "base"]
    assert steps[3] == ["B"]  # A1 finished after 3 tokens: B's adapter takes the slot
    assert steps[6] == ["A2"]
    assert len(steps) == 9


def test_without_a_cap_everything_runs_together():
    steps = _schedule(0, [_req("A1", 1), _req("B", 2), _req("A2", 1), _req("base", 0)])
    assert steps[0] == ["A1", "B", "A2", "base"] and len(steps) == 3


def test_cap_counts_running_adapters():
    running = [_req("x", 1), _req("y", 2), _req("z", 0)]
    cap = AdapterCap(2, running)
    assert cap.admits(_req("a", 2)) and cap.admits(_req("b", 0))
    assert not cap.admits(_req("c", 3))
    assert not cap.admits(_req("d", 1))  # behind the refused one
    assert cap.admits(_req("e", 0))  # base takes no slot
