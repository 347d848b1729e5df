"""Fixtures and helpers for the reliability tests (abort storms, overload bursts).

The model is loaded once per session (``base_engine``); each test builds its own small
``Engine`` around the *same* loaded runner (``engine_sharing_model``), so a test can pick
``max_num_seqs`` or a tight KV pool without paying another ~6 s model load. The server
helpers (``serve``, ``wait_until``) are the ones tests/server uses.
"""

from __future__ import annotations

import contextlib
import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import SMALL_CONFIG


@pytest.fixture(scope="session")
def base_engine():
    """The bundled model (~6 s to load); only its runner and tokenizer are reused."""
    from inflight.config import EngineConfig
    from inflight.engine import Engine
    return Engine(EngineConfig(**SMALL_CONFIG))


@contextlib.contextmanager
def engine_sharing_model(base, *, num_blocks: int | None = None, **config):
    """An ``Engine`` with its own scheduler, KV pool accounting and config (``config``
    overrides ``base.config``), running on ``base``'s loaded model and KV tensors.

    Only one of them may be stepping at a time (they share the KV tensors); the tests
    here serve one at a time. ``Engine.__init__`` hands the runner its step timer, so the
    base engine's timer is put back afterwards.
    """
    from inflight.engine import Engine

    runner = base.runner
    blocks = runner.num_blocks if num_blocks is None else num_blocks
    assert blocks <= runner.num_blocks, "the shared runner has fewer KV blocks"
    saved_timer = runner.step_timer
    engine = Engine(dataclasses.replace(base.config, **config), runner=runner,
                    tokenizer=base.tokenizer, num_blocks=blocks,
                    max_model_len=base.max_model_len, eos_token_ids=base.eos_token_ids)
    try:
        yield engine
    finally:
        runner.step_timer = saved_timer


def scrape(url: str) -> dict[str, float]:
    """Every non-bucket sample of ``/metrics``, keyed ``name{k=v,...}``; the
    ``model_name`` label every sample carries is left out of the key."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            assert "model_name" in s.labels, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


SUCCESS = "inflight:request_success_total"
FINISH_REASONS = ("stop", "length", "abort", "error")


def finished_by_reason(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Growth of ``inflight:request_success_total`` per ``finished_reason`` between scrapes."""
    return {r: after.get(f"{SUCCESS}{{finished_reason={r}}}", 0.0)
            - before.get(f"{SUCCESS}{{finished_reason={r}}}", 0.0) for r in FINISH_REASONS}


def stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10, trust_env=False).json()


def is_idle(url: str) -> bool:
    s = stats(url)
    return (s["num_requests_running"], s["num_requests_waiting"], s["kv_cache_usage_perc"]) == (0, 0, 0)


def assert_engine_clean(engine, async_engine, metrics=None) -> None:
    """Nothing of any request is left once the server is idle: the scheduler is empty,
    every KV block is back in the free queue (free or prefix-cached, none held), the block
    pool's own invariant holds, and no per-request state is kept by the loop, the sampler
    or the metrics listener (each would grow without bound under aborts).

    Call only while the engine thread is idle (nothing unfinished): it reads engine state.
    """
    kv = engine.kv_cache
    assert not engine.has_unfinished_requests(), "the output processor still holds requests"
    st = engine.get_stats()
    assert (st.num_running, st.num_waiting) == (0, 0), st
    assert kv.block_tables == {}, f"block tables left: {sorted(kv.block_tables)}"
    # Free queue = free + evictable prefix-cached blocks; nothing may still be held.
    assert kv.num_free_blocks == kv.num_blocks, (
        f"{kv.num_blocks - kv.num_free_blocks} of {kv.num_blocks} KV blocks leaked")
    assert sum(kv.pool.ref_counts) == 0, "a block still has a reference"
    kv.check_integrity()  # held + cached + free == total, ref counts match block tables
    assert engine.kv_cache.usage() == 0
    # Per-request state kept outside the scheduler (private, but a leak there is a leak).
    assert async_engine._streams == {}, f"streams left: {sorted(async_engine._streams)[:5]}"
    assert async_engine.num_waiting == 0
    sampler = getattr(engine.runner, "sampler", None)
    if sampler is not None:
        assert sampler._request_generators == {}, "seeded generators of finished requests kept"
    if metrics is not None:
        assert metrics._first_token_seen == set(), "metrics keep ids of finished requests"
        assert metrics._last_emit == {}, "metrics keep emit times of finished requests"
        assert metrics._num_output_tokens == {}, "metrics keep token counts of finished requests"


def app_metrics(server_thread):
    """The ``ServerMetrics`` of the app a ``ServerThread`` serves."""
    return server_thread.server.config.app.state.ctx.metrics
