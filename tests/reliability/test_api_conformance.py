"""Conformance gaps found by using the server as an OpenAI / vLLM client would: the shape of
streamed chunks, fields the scheduling policy would ignore, the API key checked before the
body, and error messages in plain words. On a real uvicorn and the real model."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL, serve

pytestmark = pytest.mark.slow

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def url(base_engine):
    srv, _ = serve(base_engine, api_key=KEY, max_body_bytes=4096)
    yield srv.base_url
    srv.stop()


def _events(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed call, in order; asserts ``[DONE]`` ends it."""
    with httpx.stream("POST", url + path, json={"model": MODEL, "stream": True, **body},
                      headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    return [json.loads(d) for d in data[:-1]]


def test_chat_stream_opens_each_choice_with_the_role_alone(url):
    chunks = _events(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "n": 2,
                                                    "temperature": 1.0, "seed": 3})
    # OpenAI and vLLM: the first chunk of a choice is {"role": "assistant", "content": ""}.
    firsts = {}
    for c in chunks:
        for ch in c["choices"]:
            firsts.setdefault(ch["index"], ch["delta"])
    assert firsts == {0: {"role": "assistant", "content": ""},
                      1: {"role": "assistant", "content": ""}}
    later = [ch["delta"] for c in chunks[2:] for ch in c["choices"]]
    assert later and all(set(d) == {"content"} for d in later)
    assert all("usage" not in c for c in chunks)  # not asked for


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "The capital of France is"}),
])
def test_include_usage_puts_null_on_every_chunk_but_the_last(url, path, body):
    chunks = _events(url, path, {**body, "max_tokens": 6, "ignore_eos": True,
                                 "stream_options": {"include_usage": True}})
    *deltas, last = chunks
    assert deltas and all("usage" in c and c["usage"] is None for c in deltas)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 6


def test_continuous_usage_stats_carries_the_running_usage(url):
    chunks = _events(url, "/v1/completions", {
        "prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *deltas, last = chunks
    counts = [c["usage"]["completion_tokens"] for c in deltas]
    # vLLM: every chunk has the usage so far, growing to the final count.
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {last["usage"]["prompt_tokens"]}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("field,value,policy", [
    ("priority", 5, "priority"), ("ttft_slo", 2.0, "slo"), ("itl_slo", 0.1, "slo")])
def test_a_field_the_policy_ignores_is_a_400_naming_it(url, field, value, policy):
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field
    assert f"--scheduling-policy {policy}" in err["message"] and "fcfs" in err["message"]
    # The default (priority 0, no targets) is what every client sends: accepted.
    ok = httpx.post(url + "/v1/completions", headers=AUTH, timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": 0})
    assert ok.status_code == 200


@pytest.mark.parametrize("content,headers", [
    ("{not json", {"content-type": "application/json"}),
    ("x" * 10_000, {"content-type": "application/json"}),  # over the 4096-byte cap
    ('{"prompt": 5}', {"content-type": "text/plain"}),
    ("", {}),
])
def test_a_wrong_key_gets_401_whatever_the_body(url, content, headers):
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/completions", content=content, headers={**headers, **auth})
        assert r.status_code == 401, (r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    # With the key, the body's own fault is reported.
    r = httpx.post(url + "/v1/completions", content="{not json",
                   headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 400
    # Outside /v1, the routes stay open, as in vLLM.
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content",
     "messages[0].content: must be a string or an array of text part objects (got integer)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "messages[0].content[0].type: Input should be 'text'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text: is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text: must be a string (got integer)"),
    ("/v1/completions", {"prompt": [1.5]}, "prompt[0]",
     "prompt[0]: must be a string, an integer or an array (got number)"),
    ("/v1/completions", {"prompt": 5}, "prompt",
     "prompt: must be a string, an array of strings, an array of integers or an array of "
     "arrays of integers (got integer)"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop",
     "stop: must be a string or an array of strings (got integer)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5", "n": "2"}, "max_tokens",
     "max_tokens: must be an integer (got string) (and 1 more invalid field)"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage",
     "stream_options.include_usage: must be a boolean (got string)"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt: is required"),
])
def test_wrong_types_are_named_in_plain_words(url, path, body, param, message):
    r = httpx.post(url + path, json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["message"]) == (param, message)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # a sandbox escape
    "{% for m in messages %}{{ m.content.nope.deeper }}{% endfor %}",  # a broken template
])
def test_a_failing_chat_template_is_the_servers_500_not_the_clients_400(url, base_engine,
                                                                       monkeypatch, template):
    # The template changed under a running server (start-up would have refused the unsafe
    # one): what a client sees when the model's template, not its request, is at fault.
    monkeypatch.setattr(base_engine.tokenizer, "chat_template", template)
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", "chat_template_error", None)
    assert err["message"].startswith("the model's chat template failed")
    assert "__" not in err["message"] and "jinja" not in err["message"].lower()
    tok = httpx.post(url + "/tokenize", timeout=30, json={"messages": CHAT})
    assert tok.status_code == 500 and tok.json()["error"]["code"] == "chat_template_error"


def test_a_model_is_retrieved_by_its_name(url):
    r = httpx.get(url + f"/v1/models/{MODEL}", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    missing = httpx.get(url + "/v1/models/gpt-9", headers=AUTH, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_stop_token_ids_outside_the_vocabulary_are_refused(url, base_engine):
    vocab = base_engine.tokenizer.vocab_size
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=10, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "stop_token_ids": [vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
