"""The simulator against exact schedules, queueing theory and the real engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inflight.config import EngineConfig
from inflight.engine.engine import Engine
from inflight.sampling_params import SamplingParams
from inflight.sim.simulator import SimRequest, Simulator
from inflight.sim.profile import StepProfile
from inflight.sim.step_shape import ConstantCostModel
from tests.conftest import FakeRunner


def constant_profile(seconds: float = 1.0) -> StepProfile:
    return StepProfile("test", ConstantCostModel(seconds), {}, {}, {}, request_overhead_s=0.0, delivery_s=0.0)


def simulate(config: EngineConfig, requests, *, num_blocks: int = 256, seconds: float = 1.0, **kw):
    sim = Simulator(config, constant_profile(seconds), num_blocks=num_blocks, max_model_len=4096,
                    eos_token_ids=[2], **kw)
    return sim, sim.run(requests)


@pytest.mark.parametrize("policy, c_end", [("continuous", 4.0), ("static", 6.0)])
def test_seed_example_schedule(policy, c_end):
    # DESIGN.md's example: two decode slots; A needs 2 steps, B 4, C 2 (the prefill step
    # makes the first token). Continuous batching starts C in A's freed slot at step 3.
    reqs = [SimRequest(i, 0.0, [5] * 4, n, n) for i, n in enumerate((2, 4, 2))]
    _, run = simulate(EngineConfig(max_num_seqs=2, batching_policy=policy), reqs)
    a, b, c = run.outcomes
    assert a.token_times == [1.0, 2.0]
    assert b.token_times == [1.0, 2.0, 3.0, 4.0]
    assert c.token_times == [c_end - 1, c_end]
    assert c.end_time == c_end and all(o.finish_reason == "length" for o in run.outcomes)


def test_eos_ends_a_request_at_its_dataset_length():
    reqs = [SimRequest(0, 0.0, [5] * 8, max_tokens=50, output_len=3, ignore_eos=False),
            SimRequest(1, 0.0, [5] * 8, max_tokens=5, output_len=3, ignore_eos=True)]
    _, run = simulate(EngineConfig(), reqs)
    assert [(o.output_tokens, o.finish_reason) for o in run.outcomes] == [(3, "stop"), (5, "length")]


def test_md1_mean_wait_matches_pollaczek_khinchine():
    # One slot, one token per request: service is exactly one step D. Poisson arrivals at
    # utilisation rho: M/D/1 mean wait in queue W = rho D / (2 (1 - rho)).
    d, rho, n = 0.01, 0.6, 20000
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(d / rho, n))
    reqs = [SimRequest(i, float(t), [5] * 4, 1, 1) for i, t in enumerate(arrivals)]
    _, run = simulate(EngineConfig(max_num_seqs=1), reqs, seconds=d, max_num_waiting=None)
    waits = np.array([o.token_times[0] - d - r.arrival for o, r in zip(run.outcomes, reqs)])
    expected = rho * d / (2 * (1 - rho))
    # Batch means over 20 blocks give the sampling error of the autocorrelated waits.
    blocks = waits.reshape(20, -1).mean(axis=1)
    se = blocks.std(ddof=1) / math.sqrt(len(blocks))
    assert abs(waits.mean() - expected) < 3 * se + 1e-9, (waits.mean(), expected, se)
    assert se < 0.1 * expected  # the test has power: the error bar is tight


def _workload():
    shared = list(range(10, 42))  # two full 16-token blocks shared by every prompt
    return [(f"{i}", shared + [100 + i] * (8 + 3 * i), 12 + 2 * i) for i in range(8)]


def test_preemptions_and_prefix_hits_equal_the_real_engines():
    # A pool too small for all eight to decode: preemption by recompute, and prefix hits.
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    blocks = 14
    runner = FakeRunner(token_id=7)
    engine = Engine(config, runner=runner, num_blocks=blocks, max_model_len=4096, eos_token_ids=[2])
    for rid, ids, n in _workload():
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    real = engine.get_stats()
    real_schedule = [[(s.request.request_id, len(s.token_ids)) for s in out.scheduled] for out in runner.steps]

    reqs = [SimRequest(int(rid), 0.0, ids, n, n) for rid, ids, n in _workload()]
    sim = Simulator(config, constant_profile(0.01), num_blocks=blocks, max_model_len=4096, eos_token_ids=[2])
    schedule = []
    inner = sim.replicas[0].runner.execute
    sim.replicas[0].runner.execute = lambda out: (  # type: ignore[method-assign]
        schedule.append([(s.request.request_id, len(s.token_ids)) for s in out.scheduled]) or inner(out))
    run = sim.run(reqs)
    simulated = sim.replicas[0].engine.get_stats()
    assert real.num_preemptions > 0 and real.prefix_cache_hits > 0  # the workload exercises both
    assert simulated.num_preemptions == real.num_preemptions
    assert simulated.prefix_cache_hits == real.prefix_cache_hits
    assert simulated.prefix_cache_queries == real.prefix_cache_queries
    assert schedule == real_schedule
    assert [o.output_tokens for o in run.outcomes] == [n for _, _, n in _workload()]
    assert run.counters["inflight:num_preemptions_total"] == real.num_preemptions


def test_same_seed_same_run_noise_changes_with_seed():
    from inflight.sim.fitted_cost import fit_cost_model
    from inflight.sim.step_shape import StepShape
    rng = np.random.default_rng(0)
    shapes = [StepShape(b, b, b, 0, 50 * b, 0) for b in (1, 2, 4, 8, 16) for _ in range(6)]
    seconds = [0.01 + 0.002 * s.rows * rng.uniform(0.8, 1.3) for s in shapes]
    prof = StepProfile("measured", fit_cost_model(shapes, seconds), {}, {}, {})
    arrivals = np.cumsum(np.random.default_rng(1).exponential(0.02, 200))

    def once(seed):
        sim = Simulator(EngineConfig(max_num_seqs=8), prof, num_blocks=512, max_model_len=4096,
                        eos_token_ids=[2], seed=seed)
        return [o.token_times for o in sim.run([SimRequest(i, float(t), [5] * 20, 6, 6)
                                                for i, t in enumerate(arrivals)]).outcomes]
    assert once(0) == once(0)
    assert once(0) != once(1)


def test_admission_bound_refuses_with_503_and_loses_nothing():
    reqs = [SimRequest(i, 0.0, [5] * 4, 20, 20) for i in range(12)]
    _, run = simulate(EngineConfig(max_num_seqs=2), reqs, max_num_waiting=3)
    codes = [o.status for o in run.outcomes]
    # Admission reads the state reported at the last step's end: before the first step,
    # 2 free slots + 3 waiting places.
    assert codes.count(200) == 5 and codes.count(503) == 7
    assert all(o.end_time is not None for o in run.outcomes)


def test_replicas_route_shared_prefixes_together():
    from inflight.routing import make_router
    prefix_a, prefix_b = list(range(10, 74)), list(range(200, 264))  # 4 blocks each
    # Prefixes b, b, a, a, b, b, ...: round robin sends each replica both of them.
    reqs = [SimRequest(i, 0.05 * i, (prefix_a if i // 2 % 2 else prefix_b) + [300 + i] * 5, 3, 3)
            for i in range(20)]

    def hits(router):
        sim = Simulator(EngineConfig(), constant_profile(0.01), num_blocks=512, max_model_len=4096,
                        eos_token_ids=[2], replicas=2, router=make_router(router, 16))
        run = sim.run(reqs)
        assert all(o.status == 200 for o in run.outcomes)
        return sum(r["prefix_cache_hits"] for r in run.replicas)
    assert hits("prefix_affinity") == 18 * 64  # all but the first of each prefix hit 4 blocks
    assert hits("round_robin") == 16 * 64  # each replica sees each prefix cold once


def test_prefix_affinity_yields_to_load_past_its_threshold():
    from inflight.routing import PrefixAffinityRouter, ReplicaLoad
    r = PrefixAffinityRouter(block_size=4, threshold=2)
    prompt = list(range(12))
    idle = [ReplicaLoad(), ReplicaLoad()]
    assert r.route(prompt, [ReplicaLoad(1, 0), ReplicaLoad()]) == 1  # no prefix known: least load
    assert r.route(prompt, [ReplicaLoad(), ReplicaLoad(2, 0)]) == 1  # its prefix, 2 more: stays
    assert r.route(prompt, [ReplicaLoad(), ReplicaLoad(3, 0)]) == 0  # 3 more: load wins
    assert (r.hits, r.overrides) == (1, 1)
    assert r.route(list(range(3)), idle) == 0  # under one block: no prefix, least load


def test_tenants_reach_the_fair_policy():
    # Each request: a 4-token prompt and 2 output tokens, charged 4 + 2 x 2 = 8 virtual tokens.
    reqs = [SimRequest(0, 0.0, [5] * 4, 2, 2, tenant="heavy"), SimRequest(1, 0.0, [6] * 4, 2, 2, tenant="heavy"),
            SimRequest(2, 0.0, [7] * 4, 2, 2, tenant="light")]
    sim, run = simulate(EngineConfig(scheduling_policy="fair"), reqs)
    assert all(o.status == 200 for o in run.outcomes)
    assert dict(sim.replicas[0].engine.scheduler.policy.counters) == {"heavy": 16.0, "light": 8.0}
