"""vLLM's `vllm bench serve` spellings parse into the same run as ours; the saved result
carries vLLM's keys with the values vLLM's formulas give; --goodput counts as by hand."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from bench_fake_openai import Plan, ServerState

from inflight.bench.__main__ import main
from inflight.bench.arguments import add_bench_parser, run_bench
from inflight.bench.client import RequestRecord
from inflight.bench.configure import bench_config
from inflight.bench.datasets import DatasetConfig, build_chat
from inflight.bench.summary import SLO, summarize
from inflight.bench.vllm_compat import parse_goodput
from inflight.bench.vllm_result import result_path, vllm_result


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="inflight")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def configs(args: argparse.Namespace):
    """The run's load, dataset, arrival and SLO configurations from parsed flags."""
    c = bench_config(args)
    return c.load, c.dataset, c.arrival, c.slo


def test_vllm_spellings_parse_into_our_configuration():
    vllm = parse("--host", "10.0.0.2", "--port", "8001", "--backend", "openai-chat",
                 "--endpoint", "/v1/chat/completions", "--dataset-name", "random", "--random-input-len", "100",
                 "--random-output-len", "20", "--random-range-ratio", "0.1", "--num-prompts", "50",
                 "--request-rate", "4", "--burstiness", "0.5", "--max-concurrency", "8", "--ignore-eos",
                 "--seed", "3", "--model", "m", "--tokenizer", "/tok", "--top-k", "20", "--top-p", "0.9",
                 "--goodput", "ttft:500", "tpot:50", "e2el:2000", "--num-warmups", "2")
    ours = parse("--base-url", "http://10.0.0.2:8001", "--endpoint-type", "chat", "--dataset", "random",
                 "--input-len", "100", "--output-len", "20", "--range-ratio", "0.1", "--num-prompts", "50",
                 "--request-rate", "4", "--arrival", "gamma", "--burstiness", "0.5", "--max-concurrency", "8",
                 "--ignore-eos", "--seed", "3", "--model", "m", "--tokenizer", "/tok",
                 "--extra-body", '{"top_k": 20, "top_p": 0.9}', "--slo", "ttft=500ms,tpot=50ms,e2e=2000ms",
                 "--num-warmups", "2")
    a, b = configs(vllm), configs(ours)
    assert a == b
    load, dataset, arrival, slo = a
    assert load.base_url == "http://10.0.0.2:8001" and load.endpoint == "chat" and load.max_concurrency == 8
    assert dataset.input_len == 100 and dataset.ignore_eos is True and arrival.process == "gamma"
    assert slo.per_request == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    # vLLM's backend names for completions, and the defaults of --host/--port.
    assert configs(parse("--backend", "vllm"))[0].endpoint == "completions"
    assert configs(parse("--endpoint", "/v1/completions"))[0].endpoint == "completions"
    assert configs(parse("--port", "9000"))[0].base_url == "http://127.0.0.1:9000"
    assert configs(parse("--host", "::1"))[0].base_url == "http://[::1]:8000"
    assert configs(parse())[0].base_url == "http://127.0.0.1:8000"


def test_dataset_names_map_with_vllms_defaults(tmp_path):
    # vLLM's spelling brings vLLM's defaults; ours keeps ours.
    _, d, _, _ = configs(parse("--dataset-name", "sonnet"))
    assert (d.name, d.input_len, d.output_len, d.prefix_len, d.num_prompts) == ("sonnet", 550, 150, 200, 1000)
    _, d, _, _ = configs(parse("--dataset", "sonnet"))
    assert (d.name, d.input_len, d.output_len, d.prefix_len, d.num_prompts) == ("sonnet", 256, 128, 0, 100)
    _, d, _, _ = configs(parse("--dataset-name", "random"))
    assert (d.input_len, d.output_len, d.num_prompts) == (1024, 128, 1000)
    # vLLM's random prompt is its prefix plus --random-input-len tokens; ours counts the prefix in.
    _, d, _, _ = configs(parse("--dataset-name", "random", "--random-input-len", "100", "--random-prefix-len", "20"))
    assert (d.input_len, d.prefix_len) == (120, 20)
    assert configs(parse("--dataset-name", "random", "--random-input-len", "100", "--random-prefix-len", "20"))[1] \
        == configs(parse("--input-len", "120", "--prefix-len", "20", "--num-prompts", "1000"))[1]
    # --dataset-path names the data file of the dataset.
    _, d, _, _ = configs(parse("--dataset-name", "sonnet", "--dataset-path", "/data/my_sonnet.txt"))
    assert d.sonnet_file == "/data/my_sonnet.txt"
    custom = tmp_path / "prompts.jsonl"
    custom.write_text('{"prompt": "What is the capital of India?"}\n{"prompt": "And of Iran?"}\n')
    load, d, _, _ = configs(parse("--dataset-name", "custom", "--dataset-path", str(custom)))
    assert (d.name, d.chat_file, d.output_len, load.endpoint) == ("chat", str(custom), 256, None)
    load, d, _, _ = configs(parse("--dataset-name", "custom", "--dataset-path", str(custom), "--skip-chat-template",
                                  "--custom-output-len", "7"))
    assert (load.endpoint, d.output_len) == ("completions", 7)
    import asyncio
    specs = asyncio.run(build_chat(DatasetConfig(name="chat", chat_file=str(custom), output_len=5), None, 2))
    assert sorted(s.prompt for s in specs) == ["And of Iran?", "What is the capital of India?"]
    _, d, _, _ = configs(parse("--dataset", "trace", "--dataset-path", "/t.csv"))
    assert d.trace_file == "/t.csv"


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "no ShareGPT loader"),
    (["--dataset-name", "hf"], "Hugging Face"),
    (["--dataset-name", "nope"], "unknown"),
    (["--dataset-name", "random", "--dataset-path", "x.json"], "--dataset-path with the random dataset"),
    (["--dataset-name", "sonnet", "--dataset", "chat"], "contradicts --dataset"),
    (["--base-url", "http://a:1", "--port", "2"], "--base-url or --host/--port"),
    (["--endpoint", "/v1/embeddings"], "expected /v1/completions or /v1/chat/completions"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "contradicts"),
    (["--goodput", "itl:50"], "--slo itl="),
    (["--goodput", "ttft=50"], "KEY:VALUE"),
    (["--goodput", "ttft:-1"], ">= 0 ms"),
    (["--goodput", "ttft:100", "--slo", "ttft=1s"], "differently"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
    (["--metric-percentiles", "50,101"], "--metric-percentiles"),
    (["--save-result", "a.json", "--result-filename", "b.json"], "give one"),
    (["--arrival", "poisson", "--burstiness", "2"], "--burstiness needs --arrival gamma"),
])
def test_contradictions_and_missing_datasets_are_usage_errors(argv, message, capsys):
    args = parse(*argv)
    with pytest.raises(ValueError, match=None) as e:
        configs(args)
    assert message in str(e.value)
    assert run_bench(parse(*argv)) == 2 and message in capsys.readouterr().err


def test_unknown_backend_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--backend", "tgi")
    assert "not OpenAI streaming endpoints" in capsys.readouterr().err


def _records() -> list[RequestRecord]:
    ok0 = RequestRecord(0, 0.0, send_time=0.0, chunk_times=[0.1, 0.3, 0.6], end_time=0.61, success=True,
                        prompt_len=10, prompt_tokens=10, output_tokens=3, generated_text="abc")
    ok1 = RequestRecord(1, 0.05, send_time=0.05, chunk_times=[0.25, 0.3], end_time=0.31, success=True,
                        prompt_len=12, prompt_tokens=12, output_tokens=2, generated_text="de")
    bad = RequestRecord(2, 0.1, send_time=0.1, end_time=0.2, success=False, error="HTTP 500: boom", prompt_len=8,
                        output_tokens=0)
    warm = RequestRecord(3, 0.0, send_time=0.0, chunk_times=[5.0], end_time=5.0, success=True, warmup=True,
                         prompt_len=4, output_tokens=1, phase="session-warmup")
    return [ok0, ok1, bad, warm]


def test_vllm_result_keys_from_known_records():
    records = _records()
    summary = summarize(records, SLO(per_request={"ttft": 0.15}))
    r = vllm_result(records, summary, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99, 99.9])
    # Totals over the counted requests (the warm-up left out), duration first send to last end.
    assert r["duration"] == pytest.approx(0.61) and r["completed"] == 2 and r["failed"] == 1
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (22, 5)
    assert r["request_throughput"] == pytest.approx(2 / 0.61)
    assert r["output_throughput"] == pytest.approx(5 / 0.61)
    assert r["total_token_throughput"] == pytest.approx(27 / 0.61)
    assert r["request_goodput"] == pytest.approx(1 / 0.61)  # only request 0 has TTFT <= 150 ms
    # Latencies in ms, as vLLM's calculate_metrics: by hand.
    ttfts, tpots, itls, e2els = [0.1, 0.2], [(0.6 - 0.1) / 2, (0.25 - 0.2) / 1], [0.2, 0.3, 0.05], [0.6, 0.25]
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        assert r[f"mean_{name}_ms"] == pytest.approx(1000 * np.mean(xs))
        assert r[f"median_{name}_ms"] == pytest.approx(1000 * np.median(xs))
        assert r[f"std_{name}_ms"] == pytest.approx(1000 * np.std(xs))
        for p, key in ((50, "p50"), (90, "p90"), (99, "p99"), (99.9, "p99.9")):
            assert r[f"{key}_{name}_ms"] == pytest.approx(1000 * np.percentile(xs, p))
    assert r["mean_ttft_ms"] == pytest.approx(150.0) and r["p99_ttft_ms"] == pytest.approx(199.0)
    assert r["mean_itl_ms"] == pytest.approx(1000 * 0.55 / 3)
    # And they agree with our own summary (seconds).
    assert r["mean_ttft_ms"] == pytest.approx(1000 * summary["ttft"]["mean"])
    assert r["p99_e2el_ms"] == pytest.approx(1000 * summary["e2e"]["p99"])
    # Per request, in send order, as vLLM saves them.
    assert r["input_lens"] == [10, 12, 8] and r["output_lens"] == [3, 2, 0]
    assert r["ttfts"] == pytest.approx([0.1, 0.2, 0.0])
    assert [pytest.approx(x) for x in r["itls"]] == [[0.2, 0.3], [0.05], []]
    assert r["generated_texts"] == ["abc", "de", ""] and r["errors"] == ["", "", "HTTP 500: boom"]
    # Only the metrics asked for; an empty metric reads 0, as vLLM's np.mean(x or 0).
    r = vllm_result(records[2:3], summarize(records[2:3]), ["ttft"], [99])
    assert r["mean_ttft_ms"] == 0.0 and r["p99_ttft_ms"] == 0.0 and "mean_itl_ms" not in r
    assert r["request_goodput"] is None


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000.5"]) == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0005}
    assert parse_goodput(None) == {}


def test_result_file_names(tmp_path):
    import datetime as dt
    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    args = parse("--save-result", "--request-rate", "4", "--max-concurrency", "8")
    assert result_path(bench_config(args), "serve", "org/Model-7B", "completions", now) \
        == "openai-4.0qps-concurrency8-Model-7B-20260102-030405.json"
    args = parse("--save-result", "--label", "mine", "--result-dir", str(tmp_path))
    assert result_path(bench_config(args), "serve", "m", "chat", now) == str(tmp_path / "mine-infqps-m-20260102-030405.json")
    assert result_path(bench_config(parse("--result-filename", "x.json", "--result-dir", "d")), "serve", "m",
                       "chat") == "d/x.json"
    assert result_path(bench_config(parse("--save-result", "r.json")), "serve", "m", "chat") == "r.json"
    assert result_path(bench_config(parse()), "serve", "m", "chat") is None


def test_serve_saves_vllm_keys_and_goodput_matches_a_hand_count(fake_server, data_dir, tmp_path, capsys):
    # Odd requests (by arrival at the server) wait 0.6 s for their first token, even ones none:
    # with a 250 ms TTFT target, exactly half are good.
    async def plan(body, i):
        return Plan(ttft=0.6 if i % 2 else 0.0, gaps=[0.0, 0.0])
    srv = fake_server(ServerState(plan=plan))
    host, port = srv.base_url.removeprefix("http://").split(":")
    rc = main(["serve", "--host", host, "--port", port, "--data-dir", str(data_dir), "--disable-tqdm",
               "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "3",
               "--num-prompts", "6", "--backend", "openai", "--endpoint", "/v1/completions", "--ignore-eos",
               "--goodput", "ttft:250", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(tmp_path / "res"),
               "--metadata", "run=ci", "--no-metrics"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "P90 TTFT (ms):" in out and "Request goodput (req/s):" in out and "P50 E2EL (ms):" in out
    files = list((tmp_path / "res").glob("openai-infqps-fake-model-*.json"))
    assert len(files) == 1
    r = json.loads(files[0].read_text())
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors"):
        assert key in r, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in r
    assert r["backend"] == "openai" and r["model_id"] == "fake-model" and r["run"] == "ci"
    assert r["completed"] == 6 and r["input_lens"] == [8] * 6 and r["output_lens"] == [3] * 6
    assert r["generated_texts"] == ["toktoktok"] * 6 and r["errors"] == [""] * 6
    # Goodput: the hand count of TTFTs within 250 ms, over the duration.
    good = sum(1 for t in r["ttfts"] if t <= 0.25)
    assert good == 3 and r["summary"]["good_requests"] == 3
    assert r["request_goodput"] == pytest.approx(good / r["duration"])
    # The vLLM keys are computed from the saved per-request records.
    ttfts = [q["chunk_times"][0] - q["send_time"] for q in r["requests"]]
    assert r["ttfts"] == pytest.approx(ttfts)
    assert r["mean_ttft_ms"] == pytest.approx(1000 * np.mean(ttfts))
    assert r["p90_ttft_ms"] == pytest.approx(1000 * np.percentile(ttfts, 90))
    assert r["args"]["goodput"] == ["ttft:250"] and r["summary"]["slo"] == {"ttft": 0.25}
