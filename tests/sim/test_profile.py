"""Step-time profiles: the fit against known functions, the roofline against hand sums."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from inflight.sim.fitted_cost import FittedCostModel, fit_cost_model, nnls
from inflight.sim.profile import StepProfile, load_profile, save_profile
from inflight.sim.step_shape import StepShape
from inflight.sim.roofline import Hardware, ModelShape, RooflineCostModel, derive_profile, kv_blocks_for


def test_nnls_matches_the_constrained_optimum():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 5))
    truth = np.array([1.0, 0.0, 2.5, 0.0, 0.7])
    b = a @ truth
    assert np.allclose(nnls(a, b), truth, atol=1e-9)
    # An unconstrained optimum with a negative coefficient: NNLS pins it at 0 and is
    # optimal on the rest (KKT: zero gradient on the free set, gradient <= 0 on the bound).
    b2 = a @ np.array([1.0, -2.0, 0.5, 0.0, 0.0])
    x = nnls(a, b2)
    grad = a.T @ (b2 - a @ x)
    assert (x >= 0).all() and x[1] == 0
    assert np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] <= 1e-8).all()


def _truth(s: StepShape) -> float:
    # Flat up to 2 rows (one native call), then linear in rows; attention per KV token.
    rows = 0.010 if s.rows <= 2 else 0.010 + 0.0015 * (s.rows - 2)
    if s.kind == "decode":
        return rows + 2e-7 * s.decode_context
    return 0.012 + 4e-4 * s.tokens + 3e-9 * s.prefill_pairs + 1e-4 * s.rows


def test_fit_recovers_a_piecewise_linear_step_time():
    shapes = [StepShape(b, b, b, 0, b * ctx, 0) for b in (1, 2, 4, 8, 16, 32, 64) for ctx in (16, 256, 1024)]
    shapes += [StepShape(p + d, d + 1, d + 1, p, d * 64, p * (p + 1) // 2)
               for p in (64, 256, 512, 1024, 2048) for d in (0, 4, 16)]
    cost = fit_cost_model(shapes, [_truth(s) for s in shapes])
    for s in shapes:
        assert cost.predict(s) == pytest.approx(_truth(s), rel=0.02)
    # Between the measured shapes too (interpolated in rows and tokens).
    for s in (StepShape(12, 12, 12, 0, 12 * 500, 0), StepShape(700, 5, 5, 696, 256, 696 * 697 // 2)):
        assert cost.predict(s) == pytest.approx(_truth(s), rel=0.05)
    assert cost.fits["decode"].error["in_sample_max_abs_pct"] < 2
    assert cost.in_range(StepShape(64, 64, 64, 0, 64, 0)) and not cost.in_range(StepShape(65, 65, 65, 0, 65, 0))
    assert cost.in_range(StepShape(2048, 1, 1, 2048, 0, 0)) and not cost.in_range(StepShape(2049, 1, 1, 2049, 0, 0))


def test_fit_ignores_a_busy_machines_outliers():
    shapes = [StepShape(b, b, b, 0, b * 100, 0) for b in (1, 2, 4, 8, 16) for _ in range(8)]
    seconds = [_truth(s) * (4.0 if i % 10 == 3 else 1.0) for i, s in enumerate(shapes)]
    cost = fit_cost_model(shapes, seconds)
    assert cost.predict(StepShape(8, 8, 8, 0, 800, 0)) == pytest.approx(_truth(StepShape(8, 8, 8, 0, 800, 0)), rel=0.03)
    assert max(cost.fits["decode"].ratios) == pytest.approx(4.0, rel=0.05)  # kept as noise to replay


def test_shape_of_a_plan():
    class Row:
        def __init__(self, n, start, samples):
            self.token_ids, self.num_computed_tokens, self.samples = [0] * n, start, samples
    s = StepShape.of([Row(1, 99, True), Row(1, 9, True), Row(16, 32, False)])
    assert s == StepShape(tokens=18, rows=3, samples=2, prefill_tokens=16, decode_context=110,
                          prefill_pairs=16 * 32 + 16 * 17 // 2)
    assert s.kind == "mixed" and StepShape.of([Row(1, 5, True)]).kind == "decode"


TINY = ModelShape(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
HW = Hardware(name="toy", kind="gpu", peak_flops={"bfloat16": 1e12}, memory_bandwidth=1e9, memory_bytes=1 << 30,
              compute_efficiency=0.5, memory_efficiency=0.5, step_overhead_s=1e-3, row_overhead_s=1e-5,
              kv_memory_fraction=0.5)


def test_roofline_by_hand():
    m = RooflineCostModel(HW, TINY, "bfloat16")
    lin = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    assert TINY.linear_params == lin and TINY.head_params == 64000
    kv_tok = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head_dim 16, 2 bytes
    decode = StepShape(1, 1, 1, 0, 100, 0)  # memory-bound: weights + KV read/written once
    weights = (lin + 64000) * 2
    assert m.predict(decode) == pytest.approx((weights + kv_tok * 101) / 0.5e9 + 1e-3 + 1e-5)
    prefill = StepShape(100_000, 1, 1, 100_000, 0, 10**9)  # compute-bound
    flops = 2 * lin * 100_000 + 2 * 64000 + 4 * 2 * 4 * 16 * 10**9
    assert flops / 0.5e12 > (weights + kv_tok * 100_000) / 0.5e9
    assert m.predict(prefill) == pytest.approx(flops / 0.5e12 + 1e-3 + 1e-5)
    blocks = kv_blocks_for(HW, TINY, "bfloat16", 16)
    assert blocks == (int((1 << 30) * 0.5) - (lin + 2 * 64000) * 2) // (kv_tok * 16)


def test_profiles_round_trip(tmp_path):
    shapes = [StepShape(b, b, b, 0, b * 50, 0) for b in (1, 2, 4, 8)] * 3
    fitted = StepProfile("measured", fit_cost_model(shapes, [_truth(s) for s in shapes]),
                         {"dtype": "bfloat16", "block_size": 16}, {"name": "m"}, {"cpu": "x"})
    derived = derive_profile(HW, TINY, {"dtype": "bfloat16", "block_size": 16}, {"name": "tiny"})
    for prof in (fitted, derived):
        save_profile(tmp_path / "p.json", prof)
        back = load_profile(tmp_path / "p.json")
        assert type(back.cost) is type(prof.cost)
        for s in shapes:
            assert back.predict(s) == pytest.approx(prof.predict(s))
    assert isinstance(load_profile(tmp_path / "p.json").cost, RooflineCostModel)
    assert derived.engine["num_kv_blocks"] == kv_blocks_for(HW, TINY, "bfloat16", 16)
    (tmp_path / "bad.json").write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="not an inflight step profile"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "damaged.json").write_text('{"kind": "inflight-step-profile", "version": 1, "cost": {"kind": "fitted", "fits": {}}}')
    with pytest.raises(ValueError, match="damaged step profile"):
        load_profile(tmp_path / "damaged.json")
    with pytest.raises(ValueError, match="not a JSON step profile"):
        load_profile(tmp_path)
    assert isinstance(fitted.cost, FittedCostModel)


def test_shipped_hardware_descriptions_load():
    from inflight.sim.roofline import shipped_hardware
    names = shipped_hardware()
    assert {"cpu-2core-xeon", "a100-80gb", "h100-sxm"} <= set(names)
    for n in names:
        hw = Hardware.load(n)
        assert hw.memory_bandwidth > 0 and "bfloat16" in hw.peak_flops
    with pytest.raises(FileNotFoundError, match="shipped"):
        Hardware.load("no-such-gpu")


def test_a_file_that_is_not_hardware_is_refused_plainly(tmp_path):
    (tmp_path / "x.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a hardware description"):
        Hardware.load(str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="not a hardware description"):
        Hardware.load(str(tmp_path))


@pytest.mark.parametrize("flops, expected", [({"bfloat16": 4e11, "float32": 2e11}, "bfloat16"),
                                             ({"float32": 2e11}, "float32")])
def test_a_roofline_profile_resolves_auto_dtype_as_the_engine_does(tmp_path, flops, expected):
    # `inflight serve` runs bfloat16 where the CPU computes it natively; a roofline of such a
    # CPU in float32 predicted a third of the server's limit.
    import json

    from inflight.cli import main
    shipped = json.loads((pathlib.Path(__file__).resolve().parents[2] / "inflight/sim/hardware/"
                          "cpu-2core-xeon.json").read_text())
    hw = tmp_path / "cpu.json"
    hw.write_text(json.dumps({**shipped, "name": "cpu-test", "peak_flops": flops}))
    out = tmp_path / "p.json"
    assert main(["profile", "--hardware", str(hw), "-o", str(out)]) == 0
    assert load_profile(out).engine["dtype"] == expected
