"""The simulator's speculative steps against analytic results: tokens per verification,
step counts, verification rows priced as decode rows, acceptance rates from measured
counters and back."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

from inflight.config import EngineConfig
from inflight.core.spec_config import SpeculativeConfig
from inflight.sampling_params import SamplingParams
from inflight.sim.acceptance import AcceptanceProfile, acceptance_of
from inflight.sim.fitted_cost import Fit, FittedCostModel
from inflight.sim.profile import StepProfile, load_profile, save_profile
from inflight.sim.simulator import SimRequest, Simulator
from inflight.sim.step_shape import StepShape
from inflight.sim.steplog import StepLog, read_step_logs
from inflight.sim.virtual_replica import SimReplica

PROMPT = 8
FIXED_S, ROW_S, PREFILL_S = 1.0, 0.125, 0.5  # binary fractions: sums of step times are exact


@dataclass
class RowCost:
    """``FIXED_S + ROW_S * rows + PREFILL_S * prefill_tokens``; records every shape priced."""

    shapes: list[StepShape] = field(default_factory=list)

    def predict(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return FIXED_S + ROW_S * shape.rows + PREFILL_S * shape.prefill_tokens


def spec_config(k: int, **kw: object) -> EngineConfig:
    # disable_by_batch_size=2: a lone decoding request always verifies (no exploring steps
    # of the cost-aware switch), min_acceptance_rate=0: no request pauses.
    opts = {"disable_by_batch_size": 2, "min_acceptance_rate": 0.0, **kw}
    return EngineConfig(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=k, **opts))


def run_one(config: EngineConfig, max_tokens: int, rates: tuple[float, ...] | None, seed: int = 0,
            output_len: int | None = None):
    cost = RowCost()
    accept = None if rates is None else AcceptanceProfile(rates)
    profile = StepProfile("test", cost, {}, {}, {}, request_overhead_s=0.0, delivery_s=0.0, acceptance=accept)
    sim = Simulator(config, profile, num_blocks=4096, max_model_len=65536, eos_token_ids=[2], noise=False,
                    seed=seed, max_num_waiting=None)
    req = SimRequest(0, 0.0, [5] * PROMPT, max_tokens, output_len or max_tokens, ignore_eos=output_len is None)
    run = sim.run([req])
    return run.outcomes[0], cost.shapes, sim.replicas[0]


def decode_shape(context: int, drafts: int) -> StepShape:
    """A lone request's step after ``context`` computed tokens, verifying ``drafts``."""
    n = 1 + drafts
    return StepShape(n, n, n, 0, sum(context + 1 + i for i in range(n)), 0)


def prefill_shape() -> StepShape:
    return StepShape(PROMPT, 1, 1, PROMPT, 0, PROMPT * (PROMPT + 1) // 2)


def price(shape: StepShape) -> float:
    return RowCost().predict(shape)


@pytest.mark.parametrize("k, m", [(1, 10), (3, 10), (4, 11), (4, 6), (2, 2), (5, 1)])
def test_all_accepted_yields_k_plus_1_tokens_a_step(k, m):
    # The prefill step samples token 1; each step after it drafts min(k, m - out - 1)
    # (num_to_draft leaves room for its own token) and keeps them all plus its own.
    o, shapes, rep = run_one(spec_config(k), m, (1.0,))
    expected, out = [prefill_shape()], 1
    while out < m:
        d = min(k, m - out - 1)
        expected.append(decode_shape(PROMPT + out - 1, d))
        out += 1 + d
    assert len(expected) == 1 + math.ceil((m - 1) / (k + 1))
    assert shapes == expected  # every verification priced as 1 + d decode rows
    assert rep.runner.num_steps == len(expected)
    assert (o.output_tokens, o.finish_reason) == (m, "length")
    assert len(o.token_times) == len(expected)
    assert o.end_time == sum(price(s) for s in expected)  # E2E: the cost model's step times, summed
    stats = rep.engine.scheduler.speculation.stats
    # Each step after the prefill yields its own token and its drafts: m - 1 in all.
    assert stats.num_accepted_tokens == stats.num_draft_tokens == m - 1 - (len(expected) - 1)


@pytest.mark.parametrize("k, m", [(1, 7), (4, 9), (3, 2)])
def test_nothing_accepted_yields_one_token_a_step_at_the_verification_price(k, m):
    o, shapes, rep = run_one(spec_config(k), m, (0.0,))
    plain, plain_shapes, _ = run_one(EngineConfig(), m, None)
    drafts = [min(k, m - out - 1) for out in range(1, m)]
    assert shapes == [prefill_shape()] + [decode_shape(PROMPT + out - 1, d) for out, d in enumerate(drafts, 1)]
    assert plain_shapes == [prefill_shape()] + [decode_shape(PROMPT + out - 1, 0) for out in range(1, m)]
    assert o.output_tokens == plain.output_tokens == m and len(o.token_times) == len(plain.token_times) == m
    # Same tokens, same steps; every draft row costs a decode row's price.
    assert o.end_time - plain.end_time == ROW_S * sum(drafts)
    stats = rep.engine.scheduler.speculation.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        sum(d > 0 for d in drafts), sum(drafts), 0)


@pytest.mark.parametrize("r", [0.3, 0.75])
def test_mean_tokens_per_verification_is_one_plus_the_rate(r):
    m = 4001
    o, shapes, rep = run_one(spec_config(1), m, (r,), seed=7)
    stats = rep.engine.scheduler.speculation.stats
    n, accepted = stats.num_drafts, stats.num_accepted_tokens
    plain = m - 1 - n - accepted  # a last step with no room for a draft
    assert plain in (0, 1) and rep.runner.num_steps == 1 + n + plain and o.output_tokens == m
    sigma = math.sqrt(r * (1 - r) / n)
    assert abs((1 + accepted / n) - (1 + r)) < 4 * sigma, (accepted / n, r, sigma)


def test_measured_counters_give_back_the_per_position_rates():
    rates = (0.9, 0.7, 0.4)
    _, _, rep = run_one(spec_config(3), 6001, rates, seed=3)
    stats = rep.engine.scheduler.speculation.stats
    got = AcceptanceProfile.from_stats(stats)
    assert got.measured_drafts == stats.num_drafts
    denominators = [stats.num_drafts] + stats.accepted_per_position[:-1]
    for p, q, n in zip(rates, got.per_position, denominators):
        # Binomial at each position; +2/n: the last verifications near max_tokens draft fewer.
        assert abs(q - p) < 4 * math.sqrt(p * (1 - p) / n) + 2 / n, (p, q, n)


def test_eos_ends_a_verification_at_the_requests_length():
    # All drafts accepted, k=4, EOS after 7 tokens: prefill 1, a step of 5, then the
    # step that would keep 5 keeps 1 (the EOS: the draft there is rejected).
    o, shapes, rep = run_one(spec_config(4), 50, (1.0,), output_len=7)
    assert (o.output_tokens, o.finish_reason) == (7, "stop")
    assert [s.rows for s in shapes] == [1, 5, 5]
    stats = rep.engine.scheduler.speculation.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 4 + 0)


def test_a_seed_gives_the_same_acceptances():
    a, _, _ = run_one(spec_config(2), 300, (0.5,), seed=1)
    b, _, _ = run_one(spec_config(2), 300, (0.5,), seed=1)
    c, _, _ = run_one(spec_config(2), 300, (0.5,), seed=2)
    assert a.token_times == b.token_times and a.token_times != c.token_times


def test_the_load_aware_switch_learns_on_the_virtual_clock():
    # Decode rows priced ROW_S each on top of FIXED_S. With a row as dear as the step
    # (FIXED_S=0 in effect: a draft row costs what a plain step does) drafts never pay,
    # so once a plain step has taught t(1) no step verifies; cheap rows keep verifying.
    def runs(row_s: float, fixed_s: float):
        @dataclass
        class Cost(RowCost):
            def predict(self, shape: StepShape) -> float:
                self.shapes.append(shape)
                return fixed_s + row_s * shape.rows + PREFILL_S * shape.prefill_tokens
        cost = Cost()
        config = EngineConfig(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                                                   min_acceptance_rate=0.0))
        profile = StepProfile("t", cost, {}, {}, {}, request_overhead_s=0.0, delivery_s=0.0,
                              acceptance=AcceptanceProfile((0.5,)))
        sim = Simulator(config, profile, num_blocks=4096, max_model_len=65536, eos_token_ids=[2], noise=False)
        sim.run([SimRequest(0, 0.0, [5] * PROMPT, 400, 400)])
        rows = [s.rows for s in cost.shapes[1:]]
        first_plain = rows.index(1)
        return rows[:first_plain], rows[first_plain + 1:]
    before, after = runs(row_s=1.0, fixed_s=0.0)
    assert before and all(r > 1 for r in before)  # verified while t(1) was unknown
    assert after and all(r == 1 for r in after)
    before, after = runs(row_s=0.01, fixed_s=1.0)
    assert all(r > 1 for r in after[:-1]) and len(after) > 100


def test_shape_of_a_verification_is_that_of_its_decode_rows():
    @dataclass
    class Row:
        token_ids: list[int]
        num_computed_tokens: int
        samples: bool
        num_draft_tokens: int = 0
    spec = StepShape.of([Row([0] * 4, 20, True, 3), Row([0], 9, True), Row([0] * 16, 32, False)])
    split = StepShape.of([Row([0], 20 + i, True) for i in range(4)] + [Row([0], 9, True), Row([0] * 16, 32, False)])
    assert spec == split == StepShape(tokens=21, rows=6, samples=5, prefill_tokens=16,
                                      decode_context=21 + 22 + 23 + 24 + 10, prefill_pairs=16 * 32 + 16 * 17 // 2)
    assert StepShape.of([Row([0] * 4, 20, True, 3)]).kind == "decode"


def test_rates_from_counters():
    p = AcceptanceProfile.from_counts(100, [80, 60, 30, 0])
    assert p.per_position == (0.8, 0.75, 0.5, 0.0) and p.measured_drafts == 100
    assert p.expected_accepted(3) == pytest.approx(0.8 + 0.8 * 0.75 + 0.8 * 0.75 * 0.5)
    assert AcceptanceProfile.from_counts(10, [5, 0, 0]).per_position == (0.5, 0.0)  # nothing reached position 2
    q = AcceptanceProfile((0.9, 0.5))
    assert [q.rate(i) for i in range(4)] == [0.9, 0.5, 0.5, 0.5]  # the last rate past the list
    with pytest.raises(ValueError, match="num_drafts is 0"):
        AcceptanceProfile.from_counts(0, [0])
    with pytest.raises(ValueError, match="between 0 and the one before"):
        AcceptanceProfile.from_counts(10, [5, 6])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        AcceptanceProfile((1.5,))


def test_a_speculating_simulation_needs_acceptance_rates():
    profile = StepProfile("t", RowCost(), {}, {}, {})
    with pytest.raises(ValueError, match="does not say how often drafts are accepted"):
        Simulator(spec_config(2), profile, num_blocks=64, max_model_len=1024, eos_token_ids=[2])


def test_profile_json_carries_the_acceptance_rates(tmp_path):
    cost = FittedCostModel({"decode": Fit("decode", [1, 2], [0.01, 0.02, 0.0, 0.0])})
    accept = AcceptanceProfile((0.8, 0.6), draft_s=0.003, measured_drafts=500)
    save_profile(tmp_path / "p.json", StepProfile("measured", cost, {}, {}, {}, acceptance=accept))
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["speculation"] == {"acceptance_per_position": [0.8, 0.6], "draft_s": 0.003, "measured_drafts": 500}
    assert load_profile(tmp_path / "p.json").acceptance == accept
    doc["speculation"] = {"acceptance_per_position": [0.8, 2.0]}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="bad.json: a bad \"speculation\""):
        load_profile(tmp_path / "bad.json")
    del doc["speculation"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_profile(tmp_path / "old.json").acceptance is None


def test_draft_cost_is_added_to_each_proposing_step():
    # draft_s per draft position of a proposing step: all accepted, k=3, m=9: prefill
    # proposes 3, the next step (4 tokens, out=5) proposes 3, the last keeps 4 and
    # proposes nothing (the request ended).
    o, shapes, _ = run_one(spec_config(3), 9, (1.0,))
    cost = RowCost()
    accept = AcceptanceProfile((1.0,), draft_s=0.25)
    profile = StepProfile("t", cost, {}, {}, {}, request_overhead_s=0.0, delivery_s=0.0, acceptance=accept)
    sim = Simulator(spec_config(3), profile, num_blocks=4096, max_model_len=65536, eos_token_ids=[2], noise=False)
    slow = sim.run([SimRequest(0, 0.0, [5] * PROMPT, 9, 9)]).outcomes[0]
    assert cost.shapes == shapes and slow.end_time == o.end_time + 2 * 3 * 0.25


def test_step_log_counters_become_the_profiles_rates(tmp_path):
    # A speculating simulated engine logged as a served one: the counters written are
    # the scheduler's, and the rates read back are those of its counters.
    profile = StepProfile("t", RowCost(), {}, {}, {}, acceptance=AcceptanceProfile((0.6, 0.5)))
    rep = SimReplica(0, spec_config(2), profile, 4096, 65536, [2], None)

    class Served:
        num_waits = 0
        engine = rep.engine
    path = tmp_path / "steps.jsonl"
    log = StepLog(path, Served(), None, header={"engine": {"block_size": 16}, "model": {}})
    rep.engine.add_request("a", [5] * PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    while rep.engine.has_unfinished_requests():
        rep.engine.step()
        log(None, None, rep.clock.now)
    log.close()
    stats = rep.engine.scheduler.speculation.stats
    header, shapes, _ = read_step_logs([path, path])
    assert len(shapes) == 2 * (rep.runner.num_steps - 1)  # counter lines keep steps back to back
    assert header["spec_decode"]["num_drafts"] == 2 * stats.num_drafts
    # Two logs' counters summed (the same log twice here): the same rates, twice the drafts.
    assert acceptance_of(header["spec_decode"]) == AcceptanceProfile(
        AcceptanceProfile.from_stats(stats).per_position, measured_drafts=2 * stats.num_drafts)
    assert acceptance_of(read_step_logs([path])[0]["spec_decode"]) == AcceptanceProfile.from_stats(stats)
