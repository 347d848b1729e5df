"""vLLM's operational endpoints and metrics: ``/version``, ``HEAD /metrics``, the
``model_name`` label, the per-request histograms, ``cache_config_info``, and the shipped
Grafana dashboard querying only series the server exports.

A fake runner (one fixed token per row after a short sleep) and the bundled tokenizer
stand in for the model, so these run in seconds.
"""

from __future__ import annotations

import json
import re
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.config import EngineConfig
from inflight.core.output import SampleResult
from inflight.engine import Engine
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.stats import EngineStats
from inflight.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inflight.server.app import build_app
from inflight.server.metrics import ServerMetrics
from tests.server.conftest import ServerThread, wait_until

MODEL, ALIAS = "fake-model", "fake-alias"
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "inflight-dashboard.json"
PROMETHEUS_YML = ROOT / "examples" / "prometheus" / "prometheus.yml"
NUM_BLOCKS = 128


class StepRunner:
    """Every sampling row gets ``token_id`` after ``delay`` seconds."""

    def __init__(self, token_id: int, delay: float = 0.005) -> None:
        self.token_id, self.delay = token_id, delay

    def execute(self, out):
        time.sleep(self.delay)
        return [SampleResult(s.request, self.token_id, None) for s in out.scheduled if s.samples]


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    from inflight.tokenizer import Tokenizer
    return Tokenizer.from_gguf(bundled_model_path)


@pytest.fixture(scope="module")
def served(tokenizer):
    runner = StepRunner(tokenizer.encode(" hi")[0])
    engine = Engine(EngineConfig(max_num_seqs=8, max_model_len=512), runner=runner,
                    tokenizer=tokenizer, num_blocks=NUM_BLOCKS, max_model_len=512,
                    eos_token_ids=tokenizer.eos_token_ids)
    app = build_app(AsyncEngine(engine, log_interval_s=0), model_names=[MODEL, ALIAS])
    srv = ServerThread(app).start()
    yield srv, app.state.ctx.metrics
    srv.stop()


@pytest.fixture(scope="module")
def url(served):
    return served[0].base_url


def samples(url: str) -> list:
    """Every sample of ``GET /metrics``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def values(url: str) -> dict[str, float]:
    """Samples keyed ``name{k=v,...}``, ``model_name`` left out of the key (checked)."""
    out = {}
    for s in samples(url):
        assert s.labels.get("model_name") == MODEL, s
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
        out[f"{s.name}{{{labels}}}"] = s.value
    return out


def idle(url: str) -> bool:
    s = httpx.get(url + "/stats", timeout=10).json()
    return s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0


# --- endpoints ----------------------------------------------------------------------------
def test_version_is_the_package_version(url):
    r = httpx.get(url + "/version", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"version": version("inflight-serve")}
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", r.json()["version"])


def test_retrieve_model_and_404_for_unknown_ids(url):
    for name in (MODEL, ALIAS):
        r = httpx.get(f"{url}/v1/models/{name}", timeout=10)
        assert r.status_code == 200
        card = r.json()
        assert (card["id"], card["object"], card["root"], card["max_model_len"]) == \
            (name, "model", MODEL, 512)
    r = httpx.get(url + "/v1/models/no-such-model", timeout=10)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `no-such-model` does not exist.",
                                  "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}}


def test_head_metrics_answers_200_without_a_body(url):
    head = httpx.head(url + "/metrics", timeout=10)
    assert head.status_code == 200
    assert head.content == b""
    get = httpx.get(url + "/metrics", timeout=10)
    assert get.status_code == 200 and "inflight:num_requests_running" in get.text
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-type"].startswith("text/plain; version=")
    # Both are documented, as a client probing the OpenAPI document would check.
    paths = httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
    assert {"get", "head"} <= set(paths["/metrics"]) and "get" in paths["/version"]


# --- labels and per-request histograms ------------------------------------------------------
def test_every_series_carries_the_served_model_name(url):
    r = httpx.post(url + "/v1/completions", timeout=30,
                   json={"prompt": "Label me", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    all_samples = samples(url)
    names = {s.name for s in all_samples}
    assert len(names) > 40
    assert {s.labels.get("model_name") for s in all_samples} == {MODEL}  # the first name
    info = [s for s in all_samples if s.name == "inflight:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1.0
    assert info[0].labels == {"model_name": MODEL, "block_size": "16",
                              "num_gpu_blocks": str(NUM_BLOCKS), "cache_dtype": "auto",
                              "enable_prefix_caching": "true"}
    engine_info = [s for s in all_samples if s.name == "inflight:engine_config_info"]
    assert engine_info[0].labels["model"] == MODEL and engine_info[0].labels["model_name"] == MODEL


def test_per_request_histograms_observe_a_known_request(url, served, tokenizer):
    metrics: ServerMetrics = served[1]
    wait_until(lambda: idle(url), what="an idle server")
    before = values(url)
    prompt, n, max_tokens = "Count the tokens of this prompt", 2, 5
    r = httpx.post(url + "/v1/completions", timeout=30, json={
        "prompt": prompt, "n": n, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == n * max_tokens
    wait_until(lambda: idle(url), what="the request to finish")
    after = values(url)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt_len = len(tokenizer.encode(prompt))
    # One observation per user request, with the request's own values.
    for name in ("request_params_n", "request_params_max_tokens", "request_prompt_tokens",
                 "request_generation_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert delta(f"inflight:{name}_count{{}}") == 1, name
    assert delta("inflight:request_params_n_sum{}") == n
    assert delta("inflight:request_params_n_bucket{le=1.0}") == 0
    assert delta("inflight:request_params_n_bucket{le=2.0}") == 1
    assert delta("inflight:request_params_max_tokens_sum{}") == max_tokens
    assert delta("inflight:request_params_max_tokens_bucket{le=2.0}") == 0
    assert delta("inflight:request_params_max_tokens_bucket{le=5.0}") == 1
    assert delta("inflight:request_prompt_tokens_sum{}") == prompt_len
    assert delta("inflight:request_generation_tokens_sum{}") == n * max_tokens
    assert delta("inflight:request_success_total{finished_reason=length}") == n
    # The phases add up: inference = prefill + decode; TPOT = decode / (tokens - 1).
    prefill = delta("inflight:request_prefill_time_seconds_sum{}")
    decode = delta("inflight:request_decode_time_seconds_sum{}")
    inference = delta("inflight:request_inference_time_seconds_sum{}")
    tpot = delta("inflight:request_time_per_output_token_seconds_sum{}")
    assert prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode, rel=1e-9)
    assert tpot == pytest.approx(decode / (max_tokens - 1), rel=1e-9)
    assert delta("inflight:e2e_request_latency_seconds_sum{}") >= inference
    assert metrics._num_output_tokens == {}  # nothing kept once the request finished


def test_requests_without_a_max_tokens_record_the_applied_one(url, tokenizer):
    # A completion with max_tokens null gets what the context leaves (vLLM's rule); one
    # that leaves it out gets 16 (OpenAI's and vLLM's default).
    wait_until(lambda: idle(url), what="an idle server")
    before = values(url)
    prompt_ids = tokenizer.encode("x " * 200)
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": prompt_ids, "ignore_eos": True, "max_tokens": None})
    assert r.status_code == 200
    left_out = httpx.post(url + "/v1/completions", timeout=60,
                          json={"prompt": prompt_ids, "ignore_eos": True})
    assert left_out.status_code == 200
    wait_until(lambda: idle(url), what="the requests to finish")
    after = values(url)
    applied = 512 - len(prompt_ids)
    assert r.json()["usage"]["completion_tokens"] == applied
    assert left_out.json()["usage"]["completion_tokens"] == 16
    assert after["inflight:request_params_max_tokens_sum{}"] \
        - before["inflight:request_params_max_tokens_sum{}"] == applied + 16
    assert after["inflight:request_params_n_sum{}"] - before["inflight:request_params_n_sum{}"] == 2


def test_an_aborted_stream_counts_in_every_request_series_and_the_sums_agree(url, served):
    metrics: ServerMetrics = served[1]
    wait_until(lambda: idle(url), what="an idle server")
    before = values(url)
    with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
            "prompt": "Go on", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)  # running; leaving the block closes the connection: an abort
    wait_until(lambda: idle(url), what="the abort")
    after = values(url)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)
    assert delta("inflight:request_success_total{finished_reason=abort}") == 1
    for name in ("request_params_n", "request_params_max_tokens", "e2e_request_latency_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"inflight:{name}_count{{}}") == 1, name
    assert delta("inflight:request_params_max_tokens_sum{}") == 400
    generated = delta("inflight:generation_tokens_total{}")
    assert 1 <= generated < 400
    assert delta("inflight:request_generation_tokens_sum{}") == generated
    assert delta("inflight:request_prompt_tokens_sum{}") == delta("inflight:prompt_tokens_total{}") > 0
    # Over the whole life of this server too: every request so far has finished.
    assert after["inflight:request_prompt_tokens_sum{}"] == after["inflight:prompt_tokens_total{}"]
    assert after["inflight:request_generation_tokens_sum{}"] == after["inflight:generation_tokens_total{}"]
    assert metrics._num_output_tokens == {}


def test_phase_histograms_from_known_timestamps():
    """Exact values from one request's timestamps: arrival 10, scheduled 10.5, first token
    11, last token (5th) 13, finished 13."""
    class State:
        max_model_len = 1024
        num_waiting = 0

        def get_stats(self):
            return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                               num_preemptions=0, prompt_tokens=0, generation_tokens=0,
                               num_steps=0)

    m = ServerMetrics(State(), model_name="m")
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                             first_token_time=11.0, last_token_time=13.0, finished_time=13.0,
                             n=1, max_tokens=8)
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", [7] * 5, None, "length")],
                        finished=True, metrics=metrics)
    m.on_step(State().get_stats(), [out], 13.0)
    reg = m.registry

    def value(name: str) -> float | None:
        return reg.get_sample_value(f"inflight:{name}", {"model_name": "m"})

    assert value("request_queue_time_seconds_sum") == 0.5
    assert value("request_prefill_time_seconds_sum") == 0.5
    assert value("request_decode_time_seconds_sum") == 2.0
    assert value("request_inference_time_seconds_sum") == 2.5
    assert value("request_time_per_output_token_seconds_sum") == 0.5   # 2 s / 4 gaps
    assert value("e2e_request_latency_seconds_sum") == 3.0
    assert value("request_params_n_sum") == 1
    assert value("request_params_max_tokens_sum") == 8
    assert value("request_generation_tokens_sum") == 5
    assert value("request_prompt_tokens_sum") == 3
    assert reg.get_sample_value("inflight:request_success_total",
                                {"model_name": "m", "finished_reason": "length"}) == 1
    # One output token: no interval, so no time-per-output-token observation (vLLM, SGLang).
    one = RequestOutput("s", None, [1], [CompletionOutput(0, "", [7], None, "length")],
                        finished=True, metrics=RequestMetrics(
                            arrival_time=20.0, first_scheduled_time=20.0, first_token_time=20.5,
                            last_token_time=20.5, finished_time=20.5, n=1, max_tokens=1))
    m.on_step(State().get_stats(), [one], 20.5)
    assert value("request_time_per_output_token_seconds_count") == 1
    assert value("request_decode_time_seconds_count") == 2
    assert value("e2e_request_latency_seconds_count") == 2
    # vLLM's buckets: 1-2-5 up to max_model_len for token counts, 1, 2, 5, 10, 20 for n.
    hist = {f.name: f for f in reg.collect()}
    les = [s.labels["le"] for s in hist["inflight:request_params_max_tokens"].samples
           if s.name.endswith("_bucket")]
    assert les[:4] == ["1.0", "2.0", "5.0", "10.0"] and les[-2:] == ["1000.0", "+Inf"]
    assert [s.labels["le"] for s in hist["inflight:request_params_n"].samples
            if s.name.endswith("_bucket")] == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]


# --- the shipped examples -------------------------------------------------------------------
def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows included) and variables."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def test_dashboard_queries_only_series_the_server_exports(url):
    r = httpx.post(url + "/v1/completions", timeout=30,
                   json={"prompt": "Fill the series", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    wait_until(lambda: idle(url), what="the request to finish")
    exported = {s.name for s in samples(url)}
    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    queried = {name for e in exprs for name in re.findall(r"inflight:[A-Za-z0-9_:]+", e)}
    missing = queried - exported
    assert not missing, f"the dashboard queries series /metrics does not export: {missing}"
    # What the issue asks the dashboard to show, by the series it reads.
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_success_total",
                 "prompt_tokens_total", "generation_tokens_total", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_hits_total", "prefix_cache_queries_total",
                 "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
                 "request_decode_time_seconds_bucket", "request_inference_time_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket",
                 "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
                 "request_params_max_tokens_bucket", "request_params_n_sum",
                 "cache_config_info"):
        assert f"inflight:{name}" in queried, name
    for q in ("0.5", "0.95", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q}, ") and "time_to_first_token" in e
                   for e in exprs), q
    # Every selector picks the dashboard's model: series of other servers stay out.
    for e in exprs[:-1]:
        for selector in re.findall(r"inflight:[A-Za-z0-9_:]+(\{[^}]*\})?", e):
            assert 'model_name=~"$model_name"' in selector, e


def test_dashboard_layout_is_valid_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids, cells = set(), set()
    for p in dash["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                cell = (g["x"] + dx, g["y"] + dy)
                assert cell not in cells, f"panel {p['title']!r} overlaps another"
                cells.add(cell)
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]


def test_prometheus_example_scrapes_the_default_server():
    text = PROMETHEUS_YML.read_text()
    assert re.search(r'targets:\s*\["127\.0\.0\.1:8000"\]', text)
    assert re.search(r"metrics_path:\s*/metrics", text)
