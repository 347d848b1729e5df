"""``inflight bench ... --simulate``: the bench commands on the simulator, end to end."""

from __future__ import annotations

import json
import pathlib

import pytest

from inflight.cli import main
from inflight.sim.fitted_cost import fit_cost_model
from inflight.sim.profile import StepProfile, save_profile
from inflight.sim.step_shape import StepShape

DATA = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
pytestmark = pytest.mark.skipif(not (DATA / "vllm_sonnet.txt").exists(), reason="needs ../shared/data")


def _step_seconds(s: StepShape) -> float:
    # About this CPU in bfloat16: 20 ms a decode step plus 1.5 ms a row, 0.6 ms a prompt token.
    return 0.02 + 0.0015 * s.rows + 0.0006 * s.prefill_tokens + 1e-7 * s.decode_context


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory, bundled_model_path):
    shapes = [StepShape(b, b, b, 0, b * c, 0) for b in (1, 2, 4, 8, 16, 32, 64) for c in (16, 256)]
    shapes += [StepShape(p + d, d + 1, d + 1, p, d * 64, p * p // 2) for p in (16, 64, 128, 256, 512, 1024, 2048) for d in (0, 8, 32)]
    prof = StepProfile("measured", fit_cost_model(shapes, [_step_seconds(s) for s in shapes]),
                       {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 4096, "max_model_len": 2048,
                        "model_path": str(bundled_model_path), "eos_token_ids": [2], "kv_block_bytes": 1,
                        "config": {"max_num_seqs": 64}},
                       {"name": "SmolLM2-135M-Instruct", "max_position_embeddings": 2048}, {"cpu": "test"})
    path = tmp_path_factory.mktemp("sim") / "profile.json"
    save_profile(path, prof)
    return path


COMMON = ["--dataset", "random", "--input-len", "64", "--output-len", "16", "--disable-tqdm", "--seed", "1"]


def test_serve_simulated_matches_the_schema_and_the_command(profile_path, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--simulate", str(profile_path), *COMMON, "--num-prompts", "40",
               "--request-rate", "4", "--save-result", str(out),
               "--serve-cmd", "inflight serve --port 8000 --max-num-seqs 2"])
    assert rc == 0
    assert "SIMULATED" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["simulated"]["engine"]["max_num_seqs"] == 2 and doc["fixed"]["simulated"] is True
    reqs = doc["requests"]
    assert len(reqs) == 40 and all(r["success"] for r in reqs)
    assert all(r["output_tokens"] == 16 and len(r["chunk_times"]) == 16 for r in reqs)
    # Prompt lengths are the model tokenizer's: the dataset fitted them exactly.
    assert all(r["prompt_tokens"] >= 64 for r in reqs)
    # Two slots: never more than two requests have a first token and no end at once.
    events = sorted([(r["chunk_times"][0], 1) for r in reqs] + [(r["end_time"], -1) for r in reqs])
    running = peak = 0
    for _, d in events:
        running += d
        peak = max(peak, running)
    assert peak <= 2
    assert doc["summary"]["simulation"]["simulated_seconds"] > 0


def test_capacity_simulated_is_repeatable_and_bounded(profile_path, tmp_path):
    def limit(name):
        out = tmp_path / f"{name}.json"
        rc = main(["bench", "capacity", "--simulate", str(profile_path), *COMMON, "--num-prompts", "60",
                   "--duration", "30", "--hold-duration", "60", "--slo", "ttft_p95=1,itl_p95=0.2",
                   "--rate-start", "2", "--save-result", str(out), "--report", str(tmp_path / name),
                   "--serve-cmd", "inflight serve --port 8000 --max-num-seqs 8"])
        doc = json.loads(out.read_text())
        assert doc["simulated"] is True
        assert "**SIMULATED**" in (tmp_path / name / "report.md").read_text()
        return rc, doc["results"][0]
    rc, res = limit("a")
    assert rc == 0 and res["held"] and res["limits"][0] is not None
    # 8 slots and 16 outputs of >= 20 ms steps (plus prefill): at most 8 / (16 x 0.02) = 25 req/s.
    assert 1 < res["limits"][0] < 25
    assert limit("b")[1]["limits"] == res["limits"]


def test_capacity_finds_a_limit_below_one_request_a_second(bundled_model_path, tmp_path):
    """A slow model on a CPU is the common case (issue 54): one slot and 16 outputs of
    0.26 s steps serve at most 1 / (16 x 0.26 s + the prefill) = 0.23 req/s, so the limit
    under a 10 s TTFT p95 lies below that, and the search must find it held there with
    the next load it tried failing (the bracket: within 1.2x)."""
    shapes = [StepShape(b, b, b, 0, b * c, 0) for b in (1, 2, 4) for c in (16, 256)]
    shapes += [StepShape(p + d, d + 1, d + 1, p, d * 64, p * p // 2) for p in (16, 64, 256) for d in (0, 2)]

    def seconds(s: StepShape) -> float:
        return 0.25 + 0.01 * s.rows + 0.002 * s.prefill_tokens + 1e-7 * s.decode_context
    prof = StepProfile("measured", fit_cost_model(shapes, [seconds(x) for x in shapes]),
                       {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 4096, "max_model_len": 2048,
                        "model_path": str(bundled_model_path), "eos_token_ids": [2], "kv_block_bytes": 1,
                        "config": {"max_num_seqs": 64}},
                       {"name": "SmolLM2-135M-Instruct", "max_position_embeddings": 2048}, {"cpu": "test"})
    save_profile(tmp_path / "slow.json", prof)
    out = tmp_path / "slow_limit.json"
    rc = main(["bench", "capacity", "--simulate", str(tmp_path / "slow.json"), *COMMON,
               "--slo", "ttft_p95=10,itl_p95=1", "--save-result", str(out),
               "--serve-cmd", "inflight serve --port 8000 --max-num-seqs 1"])
    res = json.loads(out.read_text())["results"][0]
    assert rc == 0 and res["held"]
    limit, failed = res["limits"][0], res["failed_above"][0]
    service = 16 * 0.26 + 0.25 + 0.002 * 64
    assert 0.05 < limit < 1 / service
    assert limit < failed <= 1.2 * limit


def test_a_replica_what_if_is_compared_with_one_replica(profile_path, tmp_path, capsys):
    """One thing changed against the same baseline: two replicas on the same profile,
    workload and engine, and one; two never predict less than one here (each replica has
    the whole profile's speed and the router spreads the load)."""
    out = tmp_path / "two.json"
    rc = main(["bench", "capacity", "--simulate", str(profile_path), *COMMON, "--num-prompts", "60",
               "--duration", "30", "--hold-duration", "0", "--slo", "ttft_p95=1,itl_p95=0.2",
               "--rate-start", "2", "--replicas", "2", "--router", "round_robin", "--save-result", str(out),
               "--serve-cmd", "inflight serve --port 8000 --max-num-seqs 8"])
    assert rc == 0
    doc = json.loads(out.read_text())
    (base,) = doc["one_replica"]
    assert base["replicas"] == 2 and base["limit"] == doc["results"][0]["spread"]["mean"]
    assert base["one_replica_limit"] is not None and base["limit"] >= base["one_replica_limit"]
    assert base["explanation"] is None
    assert "one replica on the same profile" in capsys.readouterr().out


@pytest.mark.parametrize("command, message", [
    ("python -m http.server", "is not one"),
    ("vllm serve --max-num-seqs 2", "is not one"),
    ("inflight serve --max-num-seqs 2 --no-such-flag", "--serve-cmd: unrecognized arguments: --no-such-flag"),
])
def test_simulate_refuses_a_command_that_is_not_inflight_serve(profile_path, capsys, command, message):
    rc = main(["bench", "serve", "--simulate", str(profile_path), *COMMON, "--num-prompts", "2",
               "--serve-cmd", command])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" not in err


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2"], "need --simulate"),
    (["--router", "least_load"], "need --simulate"),
])
def test_replica_flags_need_simulate(flags, message, capsys):
    rc = main(["bench", "serve", *COMMON, "--num-prompts", "2", *flags])
    assert rc == 2 and message in capsys.readouterr().err


def test_simulate_refuses_too_many_replicas(profile_path, capsys):
    rc = main(["bench", "serve", "--simulate", str(profile_path), *COMMON, "--num-prompts", "2",
               "--replicas", "100000"])
    assert rc == 2 and "--replicas must be in 1..1024" in capsys.readouterr().err
