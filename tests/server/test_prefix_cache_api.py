"""Prefix-cache metrics and ``POST /reset_prefix_cache`` on a real server."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, serve
from tests.server.test_robustness import _scrape


@pytest.fixture(scope="module")
def url(real_engine):
    real_engine.reset_prefix_cache()
    srv, _ = serve(real_engine, api_key=API_KEY)
    yield srv.base_url
    srv.stop()


def test_hits_are_counted_and_reset_starts_cold(url, real_engine):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    prompt = "Shall I compare thee to a summer's day? " * 6
    n = len(real_engine.tokenizer.encode(prompt))
    full_blocks = (n - 1) // 16 * 16       # a hit never covers the last token

    def complete():
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        return r.json()

    before = _scrape(url)
    first = complete()
    second = complete()
    mid = _scrape(url)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert mid["inflight:prefix_cache_queries_total"] - before["inflight:prefix_cache_queries_total"] == 2 * n
    assert mid["inflight:prefix_cache_hits_total"] - before["inflight:prefix_cache_hits_total"] == full_blocks

    assert httpx.post(url + "/reset_prefix_cache").status_code == 401
    r = httpx.post(url + "/reset_prefix_cache", headers=auth)
    assert r.status_code == 200 and r.json()["num_dropped_blocks"] >= full_blocks // 16
    complete()
    after = _scrape(url)
    assert after["inflight:prefix_cache_hits_total"] == mid["inflight:prefix_cache_hits_total"]
    stats = httpx.get(url + "/stats").json()
    assert stats["prefix_cache_hits_total"] == real_engine.get_stats().prefix_cache_hits
