"""Bad input, disconnects and metrics, on a real uvicorn and the real model."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError,
                             RequestFailedError)
from inflight.server.error_responses import to_openai
from tests.server.conftest import MODEL, get_json, serve, wait_until

pytestmark = pytest.mark.slow

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def served(real_engine):
    srv, async_engine = serve(real_engine, max_body_bytes=MAX_BODY)
    calls = []
    real_add = async_engine.add_request

    def spy(request_id, *args, **kwargs):
        calls.append(request_id)
        return real_add(request_id, *args, **kwargs)

    async_engine.add_request = spy  # what reached the engine
    yield srv, calls
    srv.stop()


@pytest.fixture(scope="module")
def url(served):
    return served[0].base_url


def _scrape(url: str) -> dict[str, float]:
    """Every sample (buckets left out) of /metrics, keyed by name and labels; the
    ``model_name`` label, the served name on every sample, is left out of the key."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                assert s.labels.get("model_name") == MODEL, s
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _idle(url: str) -> bool:
    s = get_json(url, "/stats")
    return s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0 \
        and s["kv_cache_usage_perc"] == 0


LONG = "tok " * 2100
BAD_INPUTS = [
    # (path, body: dict or raw str, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[]", 400, None),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2048}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 2048}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-3]}, 400, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "suffix": "there"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logit_bias": {"7042": -101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 4000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}, 413, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    # Lone surrogates are valid JSON escapes but not Unicode text.
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udfff"}]}', 400,
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', 400, "prompt"),
    # Known OpenAI/vLLM fields this server does not implement are refused, not ignored.
    # Structured output that cannot compile, or two at once, names the field.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "guided_json": {"type": 5}}, 400, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "best_of": 3}, 400, "best_of"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS,
                         ids=[f"{i}-{c[0].removeprefix('/v1').strip('/')}" for i, c in enumerate(BAD_INPUTS)])
def test_bad_input_gets_status_and_openai_error_body(served, url, path, body, status, param):
    _, calls = served
    before = len(calls)
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + path, content=content, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert len(calls) == before, "a bad request reached the engine"


def test_json_sent_as_another_content_type_is_named_as_the_problem(served, url):
    r = httpx.post(url + "/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 2}),
                   headers={"content-type": "text/plain"}, timeout=10)
    assert r.status_code == 400, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    assert "text/plain" in r.json()["error"]["message"]


@pytest.mark.parametrize("content", [b'{"prompt": "\xff\xfe", "max_tokens": 2}', b"[" * 20_000])
def test_a_body_that_is_not_json_text_says_malformed_json(served, url, content):
    # Invalid UTF-8 and nesting past the decoder's depth: FastAPI's own "error parsing the
    # body" before; the same words as any other malformed JSON now.
    r = httpx.post(url + "/v1/completions", content=content, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("malformed JSON body: ")


def test_other_http_errors_are_openai_shaped(url):
    for r, status in ((httpx.get(url + "/v1/completions"), 405), (httpx.get(url + "/nope"), 404)):
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_an_empty_prompt_is_its_bos_where_the_tokenizer_adds_one(url, real_engine, monkeypatch):
    """``""`` tokenizes to the BOS alone on a tokenizer that adds one (Gemma's ``[2]``), and
    vLLM and llama.cpp's server generate from it; the bundled tokenizer adds none, so there
    it has no tokens and is a 400. (A bench trace row scaled to one token is ``""``.)"""
    r = httpx.post(url + "/v1/completions", json={"prompt": "", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "has no tokens" in r.json()["error"]["message"]
    # and the document says so: a text prompt of at least one character on this tokenizer
    doc = httpx.get(url + "/openapi.json", timeout=10).json()
    texts = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"][:2]
    assert texts[0]["minLength"] == texts[1]["items"]["minLength"] == 1
    tok = real_engine.tokenizer
    real_encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, add_special_tokens=True: (
        [1] if add_special_tokens else []) + real_encode(text, add_special_tokens))
    r = httpx.post(url + "/v1/completions", json={"prompt": "", "max_tokens": 2,
                                                 "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_serves_after_bad_input(url):
    for body in ("{broken", json.dumps({"prompt": "", "max_tokens": 1})):
        httpx.post(url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=10)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_disconnect_aborts_and_frees_blocks(url):
    before = _scrape(url)
    body = {"prompt": "Write a very long essay.", "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        received = 0
        for line in lines:
            received += line.startswith("data: ")
            if received == 3:
                break
        assert get_json(url, "/stats")["num_requests_running"] == 1
    # Leaving the block closed the connection, long before 500 tokens could be generated.
    wait_until(lambda: _idle(url), timeout=5, what="the aborted request to free its blocks")
    after = _scrape(url)
    key = "inflight:request_success_total{finished_reason=abort}"
    assert after[key] - before.get(key, 0) == 1
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:kv_cache_usage_perc"] == 0


def test_non_stream_disconnect_aborts(url):
    body = {"prompt": "Write a very long essay.", "max_tokens": 500, "ignore_eos": True}
    done = threading.Event()

    def client():
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass  # the client gives up and closes its connection
        done.set()

    t = threading.Thread(target=client, daemon=True)
    t.start()
    wait_until(lambda: get_json(url, "/stats")["num_requests_running"] == 1, timeout=5,
               what="the request to run")
    assert done.wait(10)
    wait_until(lambda: _idle(url), timeout=5, what="the abandoned request to be aborted")
    t.join(5)


def test_metrics_parse_and_count_exactly(url, real_engine):
    names = {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "iteration_tokens_total", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
                 "num_preemptions", "request_success", "time_to_first_token_seconds_window",
                 "inter_token_latency_seconds_window", "e2e_request_latency_seconds_window"):
        assert f"inflight:{name}" in names, name

    before = _scrape(url)
    n, max_tokens = 4, 5
    prompts = [f"Number {i} is" for i in range(n)]
    for p in prompts:
        r = httpx.post(url + "/v1/completions", timeout=30, json={
            "prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "stream": p.endswith("1 is")})
        assert r.status_code == 200
    after = _scrape(url)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    prompt_tokens = sum(len(real_engine.tokenizer.encode(p)) for p in prompts)
    assert delta("inflight:request_success_total{finished_reason=length}") == n
    assert delta("inflight:prompt_tokens_total") == prompt_tokens
    assert delta("inflight:generation_tokens_total") == n * max_tokens
    assert delta("inflight:time_to_first_token_seconds_count") == n
    assert delta("inflight:e2e_request_latency_seconds_count") == n
    assert delta("inflight:request_queue_time_seconds_count") == n
    assert delta("inflight:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert delta("inflight:iteration_tokens_total_sum") == prompt_tokens + n * max_tokens
    assert after["inflight:num_requests_running"] == 0

    stats = get_json(url, "/stats")
    for key in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                "e2e_request_latency_seconds"):
        s = stats[key]
        assert s["count"] >= n
        assert 0 < s["p50"] <= s["p95"] <= s["p99"]
        q = {k: v for k, v in after.items() if k.startswith(f"inflight:{key}_window{{")}
        assert len(q) == 3 and all(v > 0 for v in q.values())


def test_tokenize_detokenize(url, real_engine):
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == real_engine.tokenizer.encode("Hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    chat = httpx.post(url + "/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}], "model": MODEL}).json()
    assert chat["count"] > 3


@pytest.mark.parametrize("error,status,code,param,retry", [
    (InvalidRequestError("prompt: too long", param="prompt", code="context_length_exceeded"),
     400, "context_length_exceeded", "messages", None),
    (InvalidRequestError("max_tokens: too many"), 400, None, "max_completion_tokens", None),
    (EngineOverloadedError("queue full", retry_after=2.6), 503, "server_overloaded", None, "3"),
    (EngineDeadError("stopped"), 503, "server_unavailable", None, "1"),  # retry elsewhere, or after a restart
    (RequestFailedError("boom"), 500, "engine_error", None, None),
])
def test_engine_errors_convert_once_at_the_http_edge(error, status, code, param, retry):
    e = to_openai(error, {"prompt": "messages", "max_tokens": "max_completion_tokens"})
    assert (e.status, e.code, e.param) == (status, code, param)
    assert (e.headers or {}).get("Retry-After") == retry
    assert error.message in e.message
