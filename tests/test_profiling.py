"""The step breakdown (``--step-breakdown``): phases recorded per step, summaries exact."""

from __future__ import annotations

import pytest

from inflight.profiling import PHASES, StepRecord, StepTimer
from inflight.sampling_params import SamplingParams
from tests.conftest import FakeRunner
from tests.core.test_scheduler import make_engine


def test_summary_means_and_uncovered_time():
    t = StepTimer(enabled=True)
    t.records.extend([
        StepRecord(2, 2, 0.010, {"schedule": 0.001, "forward": 0.006, "attention": 0.002,
                                 "sample": 0.001}),
        StepRecord(4, 40, 0.030, {"schedule": 0.003, "prepare": 0.002, "forward": 0.020,
                                  "attention": 0.010, "output": 0.001}),
    ])
    s = t.summary()
    assert (s["steps"], s["mean_seqs"], s["mean_tokens"]) == (2, 3, 21)
    assert s["total_ms"] == pytest.approx(20.0)
    assert s["forward_ms"] == pytest.approx(13.0) and s["attention_ms"] == pytest.approx(6.0)
    # Attention is inside forward: the uncovered rest is 20 - (2 + 1 + 13 + 0.5 + 0.5).
    assert s["other_ms"] == pytest.approx(3.0)
    assert "13.0" in StepTimer.format(s) and StepTimer().summary() == {}


def test_engine_records_one_entry_per_computing_step():
    engine = make_engine(FakeRunner(), step_breakdown=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recs = list(engine.step_timer.records)
    # prefill of both (5 tokens), a decode of both, a decode of "a" alone.
    assert [(r.num_seqs, r.num_tokens) for r in recs] == [(2, 5), (2, 2), (1, 1)]
    assert all(set(r.seconds) <= set(PHASES) and r.seconds["schedule"] > 0
               and r.seconds["output"] > 0 for r in recs)
    assert all(r.total >= sum(v for k, v in r.seconds.items() if k != "attention") for r in recs)


def test_disabled_timer_records_nothing():
    engine = make_engine(FakeRunner())
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.step_timer.enabled and not engine.step_timer.records
