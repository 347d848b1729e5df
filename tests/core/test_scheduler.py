"""Scheduler and engine loop over a fake runner: exact schedules, budgets, invariants."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.scheduler import Scheduler
from inflight.engine import Engine
from inflight.request import Request, RequestOptions
from inflight.sampling_params import SamplingParams
from tests.conftest import FakeRunner


def make_engine(runner, num_blocks=64, max_model_len=4096, **cfg):
    config = EngineConfig(block_size=cfg.pop("block_size", 4), **cfg)
    return Engine(config, runner=runner, num_blocks=num_blocks, max_model_len=max_model_len,
                  eos_token_ids=[2])


def run_to_completion(engine, max_steps=10_000):
    """Step until idle; returns {request_id: step number at which it finished}."""
    finished_at = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        assert step <= max_steps, "engine did not drain"
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
        engine.kv_cache.check_integrity()
    return finished_at


def _seed_example(policy):
    runner = FakeRunner()
    engine = make_engine(runner, max_num_seqs=2, batching_policy=policy)
    for rid, steps in (("A", 2), ("B", 4), ("C", 2)):
        engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=steps, ignore_eos=True))
    return run_to_completion(engine), runner


def test_seed_example_continuous_c_takes_a_slot():
    finished_at, runner = _seed_example("continuous")
    assert finished_at == {"A": 2, "B": 4, "C": 4}
    # C joins in step 3, the step right after A finished.
    assert [s.request.request_id for s in runner.steps[2].scheduled] == ["B", "C"]


def test_seed_example_static_c_waits_for_the_whole_batch():
    finished_at, runner = _seed_example("static")
    assert finished_at == {"A": 2, "B": 4, "C": 6}
    assert [s.request.request_id for s in runner.steps[2].scheduled] == ["B"]
    assert [s.request.request_id for s in runner.steps[4].scheduled] == ["C"]


def test_chunked_prefill_mixes_chunks_with_decodes_under_the_budget():
    runner = FakeRunner()
    engine = make_engine(runner, max_num_batched_tokens=8, max_num_seqs=4)
    engine.add_request("short", [3] * 4, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("long", [4] * 19, SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_completion(engine)
    plan = [[(s.request.request_id, s.num_scheduled_tokens, s.samples) for s in out.scheduled]
            for out in runner.steps]
    assert plan[:5] == [
        [("short", 4, True), ("long", 4, False)],   # short's prompt + long's first chunk
        [("short", 1, True), ("long", 7, False)],   # a decode rides along with a chunk
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 1, True)],    # long's last prompt token samples
        [("short", 1, True), ("long", 1, True)],
    ]
    assert all(out.num_batched_tokens <= 8 for out in runner.steps)


def _long_then_short(threshold):
    """A 20-token prompt under an 8-token budget; a 3-token one arrives after step 1."""
    runner = FakeRunner()
    engine = make_engine(runner, max_num_batched_tokens=8, max_num_seqs=4,
                         long_prefill_token_threshold=threshold)
    engine.add_request("long", [4] * 20, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.add_request("short", [3] * 3, SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_completion(engine)
    return [[(s.request.request_id, s.num_scheduled_tokens, s.samples) for s in out.scheduled]
            for out in runner.steps]


def test_long_prefill_token_threshold_leaves_room_for_a_newcomer():
    # No cap: the long prompt's chunks take every step's whole budget until its last one.
    assert _long_then_short(0)[:4] == [
        [("long", 8, False)],
        [("long", 8, False)],
        [("long", 4, True), ("short", 3, True)],
        [("long", 1, True), ("short", 1, True)],
    ]
    # Capped at 5 tokens a step: the newcomer's prompt runs in the very next step.
    assert _long_then_short(5)[:5] == [
        [("long", 5, False)],
        [("long", 5, False), ("short", 3, True)],
        [("long", 5, False), ("short", 1, True)],
        [("long", 5, True), ("short", 1, True)],
        [("long", 1, True)],
    ]


def test_preemption_requeues_newest_and_recomputes():
    runner = FakeRunner()
    # 4 blocks of 4 tokens: two requests of 6 prompt tokens each hold 2 blocks; the first
    # decode past 8 tokens needs a fifth block, so the newest (b) is preempted.
    engine = make_engine(runner, num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    engine.add_request("a", [3] * 6, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("b", [3] * 6, SamplingParams(max_tokens=6, ignore_eos=True))
    finished = run_to_completion(engine)
    assert set(finished) == {"a", "b"}
    preempted = [r.request_id for out in runner.steps for r in out.preempted]
    assert preempted and set(preempted) == {"b"}
    assert engine.scheduler.num_preemptions == len(preempted)
    # After preemption, b recomputes its prompt plus what it had generated, in one chunk.
    first = next(i for i, out in enumerate(runner.steps) if out.preempted)
    recompute = [s for out in runner.steps[first + 1:] for s in out.scheduled
                 if s.request.request_id == "b"][0]
    assert recompute.num_computed_tokens == 0 and recompute.num_scheduled_tokens > 6
    assert engine.kv_cache.num_free_blocks == 4


def test_dynamic_policy_launches_on_full_batch_or_delay():
    config = EngineConfig(max_num_seqs=3, batching_policy="dynamic", max_queue_delay=1.0)
    sched = Scheduler(config, KVCacheManager(64, 16))
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request("a", [1, 2], params, arrival_time=100.0))
    sched.add_request(Request("b", [1, 2], params, arrival_time=100.2))
    assert sched.schedule(now=100.5).is_empty          # 2 of 3 waiting, 0.5 s < delay
    out = sched.schedule(now=101.0)                     # oldest waited 1.0 s: launch
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    for s in out.scheduled:  # what the engine does with the sampled tokens
        s.request.append_output_token(7, None, now=101.0)
    sched.add_request(Request("c", [1, 2], params, arrival_time=101.0))
    out = sched.schedule(now=200.0)                     # a batch runs: c may not join
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]


def test_dynamic_policy_launches_when_max_num_seqs_wait():
    config = EngineConfig(max_num_seqs=2, batching_policy="dynamic", max_queue_delay=10.0)
    sched = Scheduler(config, KVCacheManager(64, 16))
    for rid in "ab":
        sched.add_request(Request(rid, [1, 2], SamplingParams(), arrival_time=0.0))
    assert [s.request.request_id for s in sched.schedule(now=0.1).scheduled] == ["a", "b"]


def test_abort_frees_blocks_and_reports_abort():
    runner = FakeRunner()
    engine = make_engine(runner, num_blocks=16)
    engine.add_request("x", [3] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("y", [3] * 10, SamplingParams(max_tokens=100, ignore_eos=True), stream=True)
    engine.step()
    assert engine.kv_cache.num_free_blocks < 16
    assert engine.abort_request("x") and engine.abort_request("y")
    assert not engine.abort_request("nope")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["x"].outputs[0].finish_reason == "abort"
    assert outs["y"].outputs[0].finish_reason == "abort"
    assert engine.kv_cache.num_free_blocks == 16 and not engine.has_unfinished_requests()


def test_requests_that_can_never_fit_are_rejected_at_once():
    import pytest

    engine = make_engine(FakeRunner(), num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request("big", [3] * 16, SamplingParams())   # pool holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(FakeRunner(), max_model_len=8).add_request("long", [3] * 8, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_sequence_stops_at_pool_capacity_instead_of_thrashing():
    engine = make_engine(FakeRunner(), num_blocks=4)   # 16 tokens in all
    engine.add_request("a", [3] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    outs = [o for _ in range(20) for o in engine.step()]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 6


def test_eos_stop_token_and_min_tokens():
    engine = make_engine(FakeRunner(token_id=2))   # the fake model always says EOS (2)
    engine.add_request("eos", [3, 4], SamplingParams(max_tokens=10))
    engine.add_request("min", [3, 4], SamplingParams(max_tokens=10, min_tokens=3))
    engine.add_request("ign", [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step()})
    assert (outs["eos"].token_ids, outs["eos"].finish_reason) == ([2], "stop")
    assert (outs["min"].token_ids, outs["min"].finish_reason) == ([2, 2, 2], "stop")
    assert (outs["ign"].token_ids, outs["ign"].finish_reason) == ([2] * 4, "length")
    engine = make_engine(FakeRunner(token_id=9))
    engine.add_request("st", [3], SamplingParams(max_tokens=10, stop_token_ids=[9]))
    out = engine.step()[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([9], "stop", 9)


def test_n_fans_out_and_aggregates():
    engine = make_engine(FakeRunner())
    engine.add_request("r", [3, 4], SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(c.token_ids == [7, 7] for c in outs[0].outputs)


@settings(max_examples=60, deadline=None)
@given(
    workload=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["continuous", "static", "dynamic"]),
    scheduling=st.sampled_from(["fcfs", "priority", "slo"]),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 11)), max_size=5),
)
def test_random_workloads_keep_invariants(workload, num_blocks, budget, max_num_seqs, policy,
                                          scheduling, aborts):
    runner = FakeRunner()
    engine = make_engine(runner, num_blocks=num_blocks, max_num_batched_tokens=budget,
                         max_num_seqs=max_num_seqs, batching_policy=policy, max_queue_delay=0.0,
                         scheduling_policy=scheduling, itl_slo=0.01, ttft_slo=5.0)
    ids = []
    for i, (prompt_len, max_tokens) in enumerate(workload):
        if prompt_len >= num_blocks * 4:
            continue
        engine.add_request(str(i), [3 + i % 5] * prompt_len,
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           options=RequestOptions(priority=(i * 7) % 3))
        ids.append(str(i))
    ended = {}
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        for at, which in aborts:
            if at == step and ids:
                engine.abort_request(ids[which % len(ids)])
        outs = engine.step()
        sched = runner.steps[-1] if runner.steps else None
        if sched is not None:
            assert sched.num_batched_tokens <= budget
            assert len(sched.scheduled) <= max_num_seqs
        assert engine.scheduler.num_running <= max_num_seqs
        engine.kv_cache.check_integrity()
        for o in outs:
            assert o.finished and o.request_id not in ended
            ended[o.request_id] = o.outputs[0].finish_reason
    assert not engine.has_unfinished_requests()
    assert set(ended) == set(ids)            # every request ends, and says how
    assert engine.kv_cache.num_free_blocks == num_blocks


def test_max_tokens_0_ends_with_its_prefill_and_keeps_no_token():
    runner = FakeRunner()
    engine = make_engine(runner, max_num_batched_tokens=4, max_num_seqs=4)
    engine.add_request("score", list(range(10, 20)), SamplingParams(max_tokens=0))
    engine.add_request("gen", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    outputs = {}
    finished_at = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            outputs[out.request_id] = out
            if out.finished:
                finished_at[out.request_id] = step
    # 10 prompt tokens in chunks of 4 (4, 4, 2): finished at the step of its last chunk.
    assert finished_at["score"] == 3
    score = outputs["score"]
    assert score.outputs[0].token_ids == [] and score.outputs[0].finish_reason == "length"
    assert score.metrics.first_token_time is not None  # the prompt is done: TTFT stands
    assert engine.get_stats().generation_tokens == 2  # gen's two; score sampled none
    assert engine.get_stats().prompt_tokens == 10 + 3
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # none leaked
