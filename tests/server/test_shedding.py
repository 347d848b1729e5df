"""Load shedding over HTTP: a request past --max-queue-time gets 503 with Retry-After."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from inflight.config import EngineConfig
from inflight.engine import Engine
from tests.server.conftest import MODEL, serve, wait_until


@pytest.fixture(scope="module")
def served(real_engine):
    # Same weights, new knobs: one running sequence, shed what waited over 0.3 s.
    engine = Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=1, max_queue_time=0.3),
                    runner=real_engine.runner, tokenizer=real_engine.tokenizer, num_blocks=64,
                    max_model_len=2048, eos_token_ids=real_engine.eos_token_ids)
    srv, _ = serve(engine)
    yield srv.base_url, engine
    srv.stop()


def test_request_waiting_past_max_queue_time_gets_503(served):
    url, engine = served
    long_one = {}

    def hog():
        long_one["r"] = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Tell a long story", "max_tokens": 60, "ignore_eos": True,
            "priority": 0})

    t = threading.Thread(target=hog)
    t.start()
    wait_until(lambda: engine.scheduler.num_running == 1, what="the hog to run")
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Quick question", "max_tokens": 4})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert err["code"] == "server_overloaded" and "max_queue_time" in err["message"]
    wait_until(lambda: f'inflight:requests_shed_total{{model_name="{MODEL}"}} 1.0'
               in httpx.get(url + "/metrics").text,
               what="the shed counter")
    t.join(120)
    assert long_one["r"].status_code == 200
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    bad = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "ttft_slo": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttft_slo"


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "Quick question"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Quick question"}]}),
])
def test_streamed_request_shed_before_first_token_gets_503_not_an_event(served, route, body):
    # Headers wait for the first token, so a shed stream gets a status a client can act on.
    url, engine = served
    hog = threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs={
        "timeout": 120, "json": {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 60,
                                 "ignore_eos": True}})
    hog.start()
    wait_until(lambda: engine.scheduler.num_running == 1, what="the hog to run")
    with httpx.stream("POST", url + route, timeout=60, json={
            "model": MODEL, "max_tokens": 4, "stream": True, **body}) as r:
        r.read()
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "server_overloaded"
    hog.join(120)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    with httpx.stream("POST", url + route, timeout=60, json={
            "model": MODEL, "max_tokens": 4, "stream": True, **body}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
