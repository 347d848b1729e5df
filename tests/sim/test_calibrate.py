"""``bench capacity --calibrate``'s parts: the step noise drawn by duration, the profile
warnings that block a prediction, outputs that end where the server's did, a step log
fitted while it is written (the ramp is tested in tests/bench/test_bench_ramp.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inflight.bench.datasets import RequestSpec
from inflight.sim.calibrate import fit_step_log
from inflight.sim.fitted_cost import Fit, FittedCostModel
from inflight.sim.profile import StepProfile, profile_warnings
from inflight.sim.step_shape import StepShape


def test_noise_is_drawn_from_steps_of_about_the_same_length():
    # 100 short steps with +-40 % jitter, 100 long ones with +-1 %: a long step's noise
    # must be the long steps' (drawn from all, it would be the short ones' half the time).
    rng = np.random.default_rng(0)
    short = list(1 + 0.4 * rng.uniform(-1, 1, 100))
    long_ = list(1 + 0.01 * rng.uniform(-1, 1, 100))
    fit = Fit("mixed", [1, 2], [0.0, 0.0], ratios=short + long_, ratio_at=[0.008] * 100 + [0.3] * 100)
    draws_long = [fit.draw_ratio(0.31, rng) for _ in range(500)]
    draws_short = [fit.draw_ratio(0.008, rng) for _ in range(500)]
    assert max(abs(r - 1) for r in draws_long) <= 0.01
    assert max(abs(r - 1) for r in draws_short) > 0.2
    # A profile saved before ratio_at: every step's ratio, as before.
    old = Fit("mixed", [1, 2], [0.0, 0.0], ratios=short + long_)
    assert max(abs(old.draw_ratio(0.31, rng) - 1) for _ in range(500)) > 0.2
    assert Fit("mixed", [1, 2], [0.0, 0.0]).draw_ratio(0.3, rng) == 1.0


def _profile(mean_error: float, steps: int, host: dict | None) -> StepProfile:
    fits = {"decode": Fit("decode", [1, 2], [0.01, 0.0], {"in_sample_mean_abs_pct": mean_error, "steps": steps})}
    return StepProfile("serving", FittedCostModel(fits), {}, {}, {"host_load": host})


def test_profile_warnings_say_which_ones_block_a_prediction():
    assert profile_warnings(_profile(12.0, 1000, {"others_cores": 0.0, "steal": 0.02})) == []
    notes = profile_warnings(_profile(37.0, 1000, None))
    assert len(notes) == 1 and "37%" in notes[0][0] and notes[0][1] is True
    notes = profile_warnings(_profile(12.0, 50, None))
    assert notes == [("only 50 steps were fitted (< 200)", True)]
    notes = profile_warnings(_profile(12.0, 1000, {"others_cores": 0.9, "steal": 0.0}))
    assert len(notes) == 1 and notes[0][1] is True and "0.90 cores" in notes[0][0]
    notes = profile_warnings(_profile(12.0, 1000, {"others_cores": 0.0, "steal": 0.11}))
    assert len(notes) == 1 and notes[0][1] is False and "11%" in notes[0][0]


def test_simulated_outputs_end_where_the_servers_did(tmp_path, bundled_model_path):
    from inflight.sim.bench import SimSetup

    def spec(text, n, ignore_eos=False):
        return RequestSpec(text, None, 5, n, ignore_eos)
    setup = SimSetup.__new__(SimSetup)
    setup.output_lengths, setup.output_fractions = {}, []
    seen, other, fixed = spec("seen prompt", 100), spec("never sent", 100), spec("to the end", 100, True)
    assert setup.output_len(seen) == 100  # nothing learned: the dataset's length
    setup.calibrate_outputs([(spec("seen prompt", 100), 20), (spec("b", 50), 25), (fixed, 3)])
    assert setup.output_len(seen) == 20  # the same request: where the server stopped
    assert setup.output_len(other) in (20, 50)  # 20 % or 50 % of its max_tokens
    assert setup.output_len(other) == setup.output_len(spec("never sent", 100))  # by its text: stable
    assert setup.output_len(fixed) == 100  # ignore_eos runs to max_tokens


def test_a_step_log_is_fitted_while_it_is_written(tmp_path):
    path = tmp_path / "steps.jsonl"
    header = {"kind": "inflight-step-log", "engine": {"dtype": "bfloat16"}, "model": {"name": "m"}}
    rows, t = [], 100.0
    rng = np.random.default_rng(1)
    for i in range(400):
        b = int(rng.integers(1, 33))
        shape = StepShape(b, b, b, 0, b * 100, 0)
        t += 0.008 + 0.001 * b
        rows.append([round(t, 6), 0, shape.tokens, shape.rows, shape.samples, 0, shape.decode_context, 0])
    path.write_text(json.dumps(header) + "\n" + "".join(json.dumps(r) + "\n" for r in rows) + "[123.0,0,")
    profile, errors = fit_step_log(path, {"others_cores": 0.0, "steal": 0.0, "is_busy": False})
    assert errors["decode"]["steps"] == 399 and errors["decode"]["mean_abs_pct"] < 2.0
    assert profile.predict(StepShape(16, 16, 16, 0, 1600, 0)) == pytest.approx(0.024, rel=0.02)
    assert profile.machine["host_load"]["steal"] == 0.0 and profile_warnings(profile) == []
