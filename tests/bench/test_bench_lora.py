"""``--lora-modules``: each request names one adapter, chosen at random, seeded (vLLM's
``bench serve --lora-modules``), and a server bench starts gets the adapters' paths."""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import socket
import sys
from collections import Counter

import pytest

from inflight.bench.__main__ import main
from inflight.bench.arguments import add_bench_parser
from inflight.bench.configure import bench_config
from inflight.bench.datasets import RequestSpec
from inflight.bench.lora_modules import LoraModules, assign_adapters, parse_lora_modules, server_flags

NAMES = ("ad-a", "ad-b", "ad-c")
FAKE_SERVER = pathlib.Path(__file__).with_name("bench_fake_openai.py")


def config(*flags: str):
    parser = argparse.ArgumentParser(prog="inflight")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return bench_config(parser.parse_args(["bench", *flags]))


def common(base_url, data_dir) -> list[str]:
    return ["--base-url", base_url, "--data-dir", str(data_dir), "--disable-tqdm", "--input-len", "8",
            "--output-len", "2", "--max-concurrency", "1"]  # one at a time: bodies in mix order


def specs(n: int, **meta) -> list[RequestSpec]:
    return [RequestSpec(f"p{i}", None, 1, 1, True, meta=dict(meta)) for i in range(n)]


def drawn(n: int, seed: int, start: int = 0) -> list[str | None]:
    mix = specs(n)
    assign_adapters(mix, NAMES, seed, start)
    return [s.model for s in mix]


# ---------------------------------------------------------------- parsing

def test_both_forms_parse():
    assert parse_lora_modules(None) == LoraModules()
    assert parse_lora_modules(["a", " b "]) == LoraModules(("a", "b"), ())
    served = parse_lora_modules(["a=/ad/a", "b=/my dir/b"])
    assert served == LoraModules(("a", "b"), ("/ad/a", "/my dir/b"))
    assert served.served() == ("a=/ad/a", "b=/my dir/b")


@pytest.mark.parametrize("items, message", [
    (["a", "b=/x"], "not both"),
    (["a", "a"], "given twice"),
    (["a=/x", "a=/y"], "given twice"),
    (["=/x"], "expected NAME or NAME=PATH"),
    (["a="], "expected NAME or NAME=PATH"),
])
def test_bad_forms_are_refused(items, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules(items)


def test_server_flags_are_added_once():
    two = parse_lora_modules(["a=/ad/a", "b=/my dir/b"])
    assert server_flags(two, "inflight serve --port 8000") == [
        "--enable-lora", "--lora-modules", "a=/ad/a", "b=/my dir/b", "--max-loras", "2"]
    # The command's own --enable-lora and --max-loras stay; nothing is added for bare names.
    assert server_flags(two, "vllm serve m --enable-lora --max-loras=1") == ["--lora-modules", "a=/ad/a",
                                                                           "b=/my dir/b"]
    assert server_flags(parse_lora_modules(["a"]), "inflight serve") == []
    with pytest.raises(ValueError, match="its own --lora-modules"):
        server_flags(two, "inflight serve --lora-modules x=/x")


def test_the_configuration_carries_names_to_the_mix_and_paths_to_the_server():
    cfg = config("serve", "--lora-modules", "a", "b")
    assert cfg.dataset.lora_modules == ("a", "b") and cfg.dataset.describe()["lora_modules"] == ["a", "b"]
    assert cfg.server.launch_command("inflight serve") == "inflight serve"
    assert cfg.recorded["lora_modules"] == ["a", "b"]
    cfg = config("sweep", "--lora-modules", "a=/ad/a", "b=/my dir/b", "--serve-cmd",
                 "inflight serve --max-num-seqs {value}", "--values", "1,2")
    assert cfg.dataset.lora_modules == ("a", "b")
    launched = cfg.server.launch_command(cfg.server.command("2") or "")
    assert shlex.split(launched) == ["inflight", "serve", "--max-num-seqs", "2", "--enable-lora", "--lora-modules",
                                     "a=/ad/a", "b=/my dir/b", "--max-loras", "2"]
    assert config("serve").dataset.lora_modules == ()


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "a=/x"], "loads the adapters into the server bench starts"),
    (["--lora-modules", "a=/x", "--serve-cmd", "inflight serve --lora-modules b=/y"], "its own --lora-modules"),
    (["--lora-modules", "a", "b=/x"], "not both"),
])
def test_usage_errors(flags, message, capsys):
    with pytest.raises(ValueError, match=message):
        config("serve", *flags)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the choice

def test_the_choice_is_seeded_uniform_and_survives_an_extension():
    assert drawn(50, seed=7) == drawn(50, seed=7)
    assert drawn(50, seed=7) != drawn(50, seed=8)
    # Items 0..2999 drawn at once, or as a mix extended past a draw block (1024) later.
    whole = drawn(3000, seed=7)
    assert drawn(1100, seed=7) + drawn(1900, seed=7, start=1100) == whole
    counts = Counter(whole)
    assert set(counts) == set(NAMES)
    # Uniform: each count within 5 sigma of 1000 (sigma = sqrt(3000 * 1/3 * 2/3) = 25.8).
    assert all(abs(c - 1000) < 130 for c in counts.values()), counts
    assert drawn(1, seed=-1)[0] in NAMES  # any int seed


def test_a_conversation_keeps_one_adapter():
    mix = [RequestSpec("q", None, 1, 1, False, meta={"conversation": c, "turn": t})
           for t in range(3) for c in range(40)]
    assign_adapters(mix, NAMES, seed=1)
    by_conversation: dict[int, set[str | None]] = {}
    for s in mix:
        by_conversation.setdefault(s.meta["conversation"], set()).add(s.model)
    assert all(len(models) == 1 for models in by_conversation.values())
    assert {m for models in by_conversation.values() for m in models} == set(NAMES)


# ---------------------------------------------------------------- what is sent

def run_serve(srv, data_dir, tmp_path, *flags: str) -> dict:
    out = tmp_path / f"r{len(srv.state.bodies)}.json"
    rc = main(["serve", *common(srv.base_url, data_dir), "--num-prompts", "12", "--save-result", str(out),
               *flags])
    assert rc == 0
    return json.loads(out.read_text())


def test_request_bodies_name_the_seeded_adapters(fake_server, data_dir, tmp_path, capsys):
    srv = fake_server()
    doc = run_serve(srv, data_dir, tmp_path, "--seed", "3", "--lora-modules", *NAMES)
    sent = [b["model"] for b in srv.state.bodies]
    assert sent == drawn(12, seed=3) and len(set(sent)) > 1
    assert [r["model"] for r in doc["requests"]] == sent
    assert doc["fixed"]["model"] == "fake-model"  # the base model stays the session's
    assert doc["fixed"]["lora_modules"] == dict(sorted(Counter(sent).items()))
    assert doc["fixed"]["dataset"]["lora_modules"] == list(NAMES) and doc["args"]["lora_modules"] == list(NAMES)
    assert "LoRA adapters ad-a, ad-b, ad-c" in capsys.readouterr().err

    run_serve(srv, data_dir, tmp_path, "--seed", "3", "--lora-modules", *NAMES)
    again = [b["model"] for b in srv.state.bodies[12:24]]
    assert again == sent  # a seeded run repeats its choices
    run_serve(srv, data_dir, tmp_path, "--seed", "4", "--lora-modules", *NAMES)
    assert [b["model"] for b in srv.state.bodies[24:36]] == drawn(12, seed=4) != sent


def test_without_the_flag_the_bodies_name_the_base_model(fake_server, data_dir, tmp_path):
    srv = fake_server()
    doc = run_serve(srv, data_dir, tmp_path, "--seed", "3")
    assert [b["model"] for b in srv.state.bodies] == ["fake-model"] * 12
    assert [r["model"] for r in doc["requests"]] == ["fake-model"] * 12
    assert doc["fixed"]["lora_modules"] is None and doc["fixed"]["dataset"]["lora_modules"] == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_bench_starts_gets_the_adapters(data_dir, tmp_path):
    port, argv = free_port(), tmp_path / "argv.txt"
    # sh writes the arguments bench appended ("$@") and runs the fake server without them.
    inner = f'printf "%s\\n" "$@" > {shlex.quote(str(argv))}; exec {sys.executable} {FAKE_SERVER} --port {port}'
    cmd = f"sh -c {shlex.quote(inner)} fake-server"
    out = tmp_path / "r.json"
    rc = main(["serve", *common(f"http://127.0.0.1:{port}", data_dir), "--num-prompts", "6", "--seed", "5",
               "--lora-modules", "ad-a=/adapters/a", "ad-b=/adapters/my b", "--serve-cmd", cmd,
               "--server-start-timeout", "30", "--save-result", str(out)])
    assert rc == 0
    assert argv.read_text().splitlines() == ["--enable-lora", "--lora-modules", "ad-a=/adapters/a",
                                             "ad-b=/adapters/my b", "--max-loras", "2"]
    doc = json.loads(out.read_text())
    expected = specs(6)
    assign_adapters(expected, ("ad-a", "ad-b"), 5)
    assert [r["model"] for r in doc["requests"]] == [s.model for s in expected]
    assert doc["args"]["serve_cmd"] == cmd  # the command as given; the flags are added at launch


# ---------------------------------------------------------------- simulated

@pytest.fixture(scope="module")
def profile_path(tmp_path_factory, bundled_model_path):
    from inflight.sim.fitted_cost import fit_cost_model
    from inflight.sim.profile import StepProfile, save_profile
    from inflight.sim.step_shape import StepShape

    shapes = [StepShape(b, b, b, 0, b * c, 0) for b in (1, 2, 4, 8, 16) for c in (16, 256)]
    shapes += [StepShape(p + d, d + 1, d + 1, p, d * 64, p * p // 2) for p in (16, 64, 256, 1024) for d in (0, 8)]
    seconds = [0.02 + 0.0015 * s.rows + 0.0006 * s.prefill_tokens + 1e-7 * s.decode_context for s in shapes]
    prof = StepProfile("measured", fit_cost_model(shapes, seconds),
                       {"dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 4096, "max_model_len": 2048,
                        "model_path": str(bundled_model_path), "eos_token_ids": [2], "kv_block_bytes": 1,
                        "config": {"max_num_seqs": 8}},
                       {"name": "SmolLM2-135M-Instruct", "max_position_embeddings": 2048}, {"cpu": "test"})
    path = tmp_path_factory.mktemp("sim") / "profile.json"
    save_profile(path, prof)
    return path


def test_the_simulator_records_the_adapters_and_costs_them_as_the_model(profile_path, data_dir, tmp_path):
    from inflight.cli import main as inflight_main

    def simulate(name: str, *flags: str) -> dict:
        out = tmp_path / f"{name}.json"
        rc = inflight_main(["bench", "serve", "--simulate", str(profile_path), "--data-dir", str(data_dir),
                            "--input-len", "32", "--output-len", "4", "--num-prompts", "10", "--disable-tqdm",
                            "--seed", "2", "--request-rate", "20", "--save-result", str(out),
                            "--serve-cmd", "inflight serve --port 8000 --max-num-seqs 2", *flags])
        assert rc == 0
        return json.loads(out.read_text())

    base = simulate("base")
    lora = simulate("lora", "--lora-modules", "ad-a=/adapters/a", "ad-b=/adapters/b")
    expected = specs(10)
    assign_adapters(expected, ("ad-a", "ad-b"), 2)
    assert lora["fixed"]["lora_modules"] == dict(sorted(Counter(s.model for s in expected).items()))
    assert base["fixed"]["lora_modules"] is None
    # The simulated engine is the command's, its steps cost as the base model's: same times.
    assert lora["simulated"]["engine"] == base["simulated"]["engine"]
    timing = ("scheduled_time", "chunk_times", "end_time", "output_tokens")
    assert [[r[k] for k in timing] for r in lora["requests"]] == [[r[k] for k in timing] for r in base["requests"]]
