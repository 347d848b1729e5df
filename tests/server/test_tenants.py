"""Tenants on a real server: named API keys, per-tenant limits (429 + Retry-After), per-tenant
series, prefix-cache isolation, and ``--max-tokens-default``."""

from __future__ import annotations

import argparse

import httpx
import pytest

from inflight.server.tenants import (TenantLimits, TenantSettings, add_tenant_args,
                                     parse_api_keys)
from prometheus_client import CollectorRegistry

from inflight.server.error_responses import OpenAIError
from tests.server.conftest import MODEL, serve, wait_until
from tests.server.test_robustness import _scrape

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
PROMPT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 3


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(url: str, key: str, max_tokens: int = 2, prompt: str = PROMPT) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=_auth(key), timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


@pytest.fixture(scope="module")
def isolated(real_engine):
    real_engine.reset_prefix_cache()
    srv, engine = serve(real_engine, tenants=TenantSettings(
        KEYS, max_concurrent_requests=1, shared_prefix_cache=False), max_tokens_default=3)
    yield srv.base_url, engine
    srv.stop()


def test_each_key_is_its_tenant_and_a_wrong_key_is_refused(isolated):
    url, _ = isolated
    before = _scrape(url)
    assert _complete(url, "sk-alice").status_code == 200
    assert _complete(url, "sk-bob").status_code == 200
    r = _complete(url, "sk-carol")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    after = _scrape(url)
    for tenant in ("alice", "bob"):
        key = f"inflight:tenant_requests_total{{outcome=admitted,tenant={tenant}}}"
        assert after[key] - before.get(key, 0) == 1
        # prompt tokens as counted by the server, and the 2 generated
        gen = f"inflight:tenant_tokens_total{{kind=generation,tenant={tenant}}}"
        assert after[gen] - before.get(gen, 0) == 2
    assert after["inflight:tenant_requests_in_flight{tenant=alice}"] == 0


def test_a_tenant_at_its_concurrency_limit_gets_429_and_others_do_not(isolated):
    url, engine = isolated
    with httpx.Client(timeout=60) as client:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with client.stream("POST", url + "/v1/completions", headers=_auth("sk-alice"),
                           json=body) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # alice's one place is taken
            r = _complete(url, "sk-alice")
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "alice" in err["message"]
            assert err["type"] == "requests"  # OpenAI's type for a request-rate limit
            assert _complete(url, "sk-bob").status_code == 200
        # the stream closed: its request is aborted and alice's place comes back
        wait_until(lambda: engine.num_in_flight == 0, what="the held stream to end")
        assert _complete(url, "sk-alice").status_code == 200
    assert _scrape(url)["inflight:tenant_requests_total{outcome=rate_limited,tenant=alice}"] >= 1


def test_tenants_do_not_share_cached_prefix_blocks_unless_told(isolated, real_engine):
    url, _ = isolated
    n = len(real_engine.tokenizer.encode(PROMPT))
    full_blocks = (n - 1) // 16 * 16
    prompt = "A fresh prefix for this test only. " + PROMPT

    def hits(key: str) -> float:
        before = _scrape(url)["inflight:prefix_cache_hits_total"]
        assert _complete(url, key, prompt=prompt).status_code == 200
        return _scrape(url)["inflight:prefix_cache_hits_total"] - before

    assert hits("sk-alice") == 0
    assert hits("sk-bob") == 0           # alice's blocks are not bob's
    assert hits("sk-alice") >= full_blocks  # alice's own are
    # a request's own cache_salt (vLLM's field) separates within a tenant too
    before = _scrape(url)["inflight:prefix_cache_hits_total"]
    r = httpx.post(url + "/v1/completions", headers=_auth("sk-alice"), timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "mine"})
    assert r.status_code == 200
    assert _scrape(url)["inflight:prefix_cache_hits_total"] == before


def test_max_tokens_default_bounds_a_request_that_sets_none(isolated):
    url, _ = isolated
    r = httpx.post(url + "/v1/chat/completions", headers=_auth("sk-bob"), timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to one hundred."}],
        "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url + "/v1/chat/completions", headers=_auth("sk-bob"), timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
        "ignore_eos": True, "max_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] == 5  # an explicit value wins


def test_shared_cache_when_keys_are_unnamed(real_engine):
    real_engine.reset_prefix_cache()
    srv, _ = serve(real_engine, tenants=TenantSettings({"k1": "default", "k2": "default"}))
    try:
        n = len(real_engine.tokenizer.encode(PROMPT))
        before = _scrape(srv.base_url)["inflight:prefix_cache_hits_total"]
        assert _complete(srv.base_url, "k1").status_code == 200
        assert _complete(srv.base_url, "k2").status_code == 200
        hit = _scrape(srv.base_url)["inflight:prefix_cache_hits_total"] - before
        assert hit == (n - 1) // 16 * 16
    finally:
        srv.stop()


def test_tokens_per_minute_window_and_its_retry_after():
    t = [1000.0]
    limits = TenantLimits(None, 100, ["alice"], CollectorRegistry(), clock=lambda: t[0])
    lease = limits.admit("alice")
    lease.charge(60, "prompt")
    t[0] += 10
    lease.charge(50)
    lease.release()
    with pytest.raises(OpenAIError) as e:
        limits.admit("alice")  # 110 tokens in the window
    assert e.value.status == 429
    # 11 tokens must expire: the first 60, at t = 1000 + 60
    assert e.value.headers["Retry-After"] == str(60 - 10)
    t[0] = 1060.0
    limits.admit("alice").release()
    limits.admit("someone-unknown").release()  # counted as default, label set bounded
    assert limits.in_flight("alice") == 0


def test_key_parsing_and_the_default_sharing_rule(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalice=sk-a\n\nbob=sk-b==\n")
    assert parse_api_keys(["plain", "default=c2VjcmV0==", "a/b=c"], str(f)) == {
        "plain": "default", "c2VjcmV0==": "default", "a/b=c": "default", "sk-a": "alice",
        "sk-b==": "bob"}
    with pytest.raises(ValueError, match="twice"):
        parse_api_keys(["a=x", "b=x"])
    # "alice=$UNSET" must not become the guessable key "alice="
    for bad, why in (("alice=", "empty key for tenant 'alice'"), ("c2VjcmV0==", "empty key"),
                     ("=k", "empty tenant name")):
        with pytest.raises(ValueError, match=why):
            parse_api_keys([bad])
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no keys"):
        parse_api_keys([], str(tmp_path / "empty"))
    (tmp_path / "bad").write_text("no-name-here\n")
    with pytest.raises(ValueError, match="bad:1: expected NAME=SECRET"):
        parse_api_keys([], str(tmp_path / "bad"))
    p = argparse.ArgumentParser()
    add_tenant_args(p)
    named = TenantSettings.from_cli_args(p.parse_args(["--api-key", "alice=sk-a"]))
    assert not named.shared_prefix_cache
    assert TenantSettings.from_cli_args(p.parse_args(["--api-key", "sk-a"])).shared_prefix_cache
    env = TenantSettings.from_cli_args(p.parse_args([]), env_key="sk-env")
    assert env.keys == {"sk-env": "default"}
    forced = TenantSettings.from_cli_args(p.parse_args(["--api-key", "a=1", "--shared-prefix-cache"]))
    assert forced.shared_prefix_cache
    with pytest.raises(ValueError, match="tenant_tokens_per_minute"):
        TenantSettings.from_cli_args(p.parse_args(["--tenant-tokens-per-minute", "0"]))


def test_the_document_lists_429_only_where_limits_are_set(isolated, real_engine):
    url, _ = isolated
    doc = httpx.get(url + "/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "429" in doc["paths"][path]["post"]["responses"]
    srv, _ = serve(real_engine)
    try:
        doc = httpx.get(srv.base_url + "/openapi.json", timeout=10).json()
        assert "429" not in doc["paths"]["/v1/completions"]["post"]["responses"]
    finally:
        srv.stop()
