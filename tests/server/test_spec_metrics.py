"""Speculative decoding's observability (vLLM's ``spec_decode_*``): the ``EngineStats``
counters, the ``inflight:spec_decode_*`` Prometheus series (present only when the server
speculates), the ``spec_decode`` object of ``/stats`` and the ``SpecDecoding metrics`` log line.

A fake runner continues a cyclic token pattern (so the real ngram proposer, looking the
pattern up in the prompt, drafts up to k tokens) and verifies drafts by a fixed schedule of
accepted counts, recording what it accepted; with the bundled tokenizer every counter has
an exact expected value and the tests run in seconds.
"""

from __future__ import annotations

import itertools
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.config import EngineConfig
from inflight.core.output import SampleResult
from inflight.core.spec_config import SpeculativeConfig
from inflight.engine import Engine
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.stats import (EngineStats, StatsLogger, spec_decode_line,
                                   spec_decode_summary, sum_stats)
from inflight.server.app import build_app
from inflight.server.metrics import ServerMetrics
from tests.server.conftest import ServerThread, wait_until

MODEL = "fake-model"
K = 4
# Accepted drafts of successive verifications (capped at the drafts verified).
ACCEPT_SCHEDULE = (4, 2, 0, 1, 3, 4, 0)


WORDS = " one two three four five six"


class DraftRunner:
    """The "model" continues ``cycle`` (the token after a token of ``cycle`` is the next one
    of it); a request verifying d drafts keeps the next count of ``ACCEPT_SCHEDULE`` (at
    most d) of them plus the pattern's token after those, as a verifying sampler returns
    the accepted drafts and the target's token after them. Records what it verified,
    independently of the engine's counters."""

    def __init__(self, cycle: list[int]) -> None:
        self.cycle = cycle
        self.schedule = itertools.cycle(ACCEPT_SCHEDULE)
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.per_pos = [0] * K

    def execute(self, out):
        time.sleep(0.002)
        results = []
        for s in out.scheduled:
            if not s.samples:
                continue
            accepted: list[int] = []
            if s.num_draft_tokens:
                a = min(next(self.schedule), s.num_draft_tokens)
                accepted = s.draft_token_ids[:a]
                self.num_drafts += 1
                self.num_draft_tokens += s.num_draft_tokens
                self.num_accepted += a
                for i in range(a):
                    self.per_pos[i] += 1
            known = s.token_ids[:len(s.token_ids) - s.num_draft_tokens]
            last = (accepted or known)[-1]
            nxt = self.cycle[(self.cycle.index(last) + 1) % len(self.cycle)]
            results += [SampleResult(s.request, t, None) for t in [*accepted, nxt]]
        return results


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    from inflight.tokenizer import Tokenizer
    return Tokenizer.from_gguf(bundled_model_path)


def _serve(tokenizer, spec: SpeculativeConfig | None):
    cycle = tokenizer.encode(WORDS)
    assert len(set(cycle)) == len(cycle) == 6
    runner = DraftRunner(cycle)
    engine = Engine(EngineConfig(max_num_seqs=8, max_model_len=512, speculative_config=spec),
                    runner=runner, tokenizer=tokenizer, num_blocks=128, max_model_len=512,
                    eos_token_ids=tokenizer.eos_token_ids)
    app = build_app(AsyncEngine(engine, log_interval_s=0), model_names=[MODEL])
    return ServerThread(app).start(), engine, runner


@pytest.fixture(scope="module")
def spec_server(tokenizer):
    # disable_by_batch_size: every decode step may verify drafts (no cost-model exploration).
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, disable_by_batch_size=64)
    srv, engine, runner = _serve(tokenizer, spec)
    yield srv.base_url, engine, runner
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(tokenizer):
    srv, engine, runner = _serve(tokenizer, None)
    yield srv.base_url, engine, runner
    srv.stop()


def scrape(url: str) -> dict[str, float]:
    """``spec_decode`` samples of ``GET /metrics``, keyed ``name`` or ``name{position}``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "spec_decode" in s.name and s.name.endswith("_total"):
                assert s.labels.get("model_name") == MODEL, s
                pos = s.labels.get("position")
                out[s.name if pos is None else f"{s.name}{{{pos}}}"] = s.value
    return out


def complete(url: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": WORDS * 2, "max_tokens": max_tokens,
        "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_spec_counters_match_the_verifications(spec_server):
    url, engine, runner = spec_server
    for max_tokens in (30, 17):
        body = complete(url, max_tokens)
        assert body["usage"]["completion_tokens"] == max_tokens  # drafts change no length
    stats = engine.scheduler.speculation.stats

    def settled() -> bool:
        s = httpx.get(url + "/stats", timeout=10).json()
        return (s["num_requests_running"] == 0
                and s["spec_decode"]["num_drafts"] == stats.num_drafts
                and scrape(url).get("inflight:spec_decode_num_drafts_total") == stats.num_drafts)
    wait_until(settled, what="the counters after the last step")

    # The runner verified drafts, with every schedule entry's acceptance, and the engine
    # counted exactly what it verified.
    assert runner.num_drafts >= len(ACCEPT_SCHEDULE)
    assert runner.num_drafts < runner.num_draft_tokens <= K * runner.num_drafts
    assert 0 < runner.num_accepted < runner.num_draft_tokens
    assert runner.per_pos[-1] > 0  # every position saw acceptances
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.accepted_per_position) == \
        (runner.num_drafts, runner.num_draft_tokens, runner.num_accepted, runner.per_pos)
    e = engine.get_stats()
    assert (e.spec_decode_num_drafts, e.spec_decode_num_draft_tokens,
            e.spec_decode_num_accepted_tokens, e.spec_decode_num_accepted_tokens_per_pos) == \
        (runner.num_drafts, runner.num_draft_tokens, runner.num_accepted, runner.per_pos)
    # A copy: the scheduler keeps counting into its own list.
    assert e.spec_decode_num_accepted_tokens_per_pos is not stats.accepted_per_position

    expected = {"inflight:spec_decode_num_drafts_total": runner.num_drafts,
                "inflight:spec_decode_num_draft_tokens_total": runner.num_draft_tokens,
                "inflight:spec_decode_num_accepted_tokens_total": runner.num_accepted}
    for i, n in enumerate(runner.per_pos):
        expected[f"inflight:spec_decode_num_accepted_tokens_per_pos_total{{{i}}}"] = n
    assert scrape(url) == expected

    assert httpx.get(url + "/stats", timeout=10).json()["spec_decode"] == {
        "num_drafts": runner.num_drafts, "num_draft_tokens": runner.num_draft_tokens,
        "num_accepted_tokens": runner.num_accepted,
        "acceptance_rate": runner.num_accepted / runner.num_draft_tokens,
        "mean_acceptance_length": 1 + runner.num_accepted / runner.num_drafts,
        "accepted_per_position": runner.per_pos}


def test_no_spec_series_without_speculation(plain_server):
    url, engine, runner = plain_server
    complete(url, 5)
    wait_until(lambda: httpx.get(url + "/stats", timeout=10).json()["num_requests_running"] == 0,
               what="an idle server")
    assert runner.num_drafts == 0
    text = httpx.get(url + "/metrics", timeout=10).text
    assert "inflight:generation_tokens_total" in text and "spec_decode" not in text
    assert "spec_decode" not in httpx.get(url + "/stats", timeout=10).json()
    e = engine.get_stats()
    assert (e.spec_decode_num_drafts, e.spec_decode_num_draft_tokens,
            e.spec_decode_num_accepted_tokens, e.spec_decode_num_accepted_tokens_per_pos) == \
        (0, 0, 0, [])


# --- pure parts -------------------------------------------------------------------------
def _stats(drafts: int, drafted: int, accepted: int, per_pos: list[int], **kw) -> EngineStats:
    base = dict(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_preemptions=0,
                prompt_tokens=100, generation_tokens=200, num_steps=10)
    return EngineStats(**{**base, **kw}, spec_decode_num_drafts=drafts,
                       spec_decode_num_draft_tokens=drafted,
                       spec_decode_num_accepted_tokens=accepted,
                       spec_decode_num_accepted_tokens_per_pos=per_pos)


BEFORE = _stats(10, 40, 20, [8, 6, 4, 2])
# Over the interval: 20 verifications of 70 drafts, 55 accepted ([20, 16, 11, 8]).
NOW = _stats(30, 110, 75, [28, 22, 15, 10])
LINE = ("SpecDecoding metrics: Mean acceptance length: 3.75, "
        "Accepted throughput: 5.50 tokens/s, Drafted throughput: 7.00 tokens/s, "
        "Accepted: 55 tokens, Drafted: 70 tokens, "
        "Per-position acceptance rate: 1.000, 0.800, 0.550, 0.400, "
        "Avg Draft acceptance rate: 78.6%")


def test_spec_decode_line_reports_the_interval_deltas():
    assert spec_decode_line(NOW, BEFORE, 10.0) == LINE
    assert spec_decode_line(NOW, NOW, 10.0) is None  # no verification in the interval
    off = _stats(0, 0, 0, [])
    assert spec_decode_line(off, off, 10.0) is None


def test_stats_logger_adds_the_spec_line_when_drafts_were_verified(caplog):
    logger = StatsLogger(interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="inflight.engine.stats"):
        logger(BEFORE, [], 100.0)
        logger(BEFORE, [], 105.0)  # within the interval: nothing
        logger(NOW, [], 110.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("running: 1, waiting: 0")
    assert lines[1] == LINE
    caplog.clear()
    off = _stats(0, 0, 0, [])
    logger = StatsLogger(interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="inflight.engine.stats"):
        for t in (0.0, 5.0, 10.0):
            logger(off, [], t)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["running: 1"]


def test_spec_decode_summary_and_sum_stats():
    assert spec_decode_summary(NOW) == {
        "num_drafts": 30, "num_draft_tokens": 110, "num_accepted_tokens": 75,
        "acceptance_rate": 75 / 110, "mean_acceptance_length": 1 + 75 / 30,
        "accepted_per_position": [28, 22, 15, 10]}
    # Replicas: counters summed, per position elementwise (a replica that never reported
    # has no positions).
    total = sum_stats([NOW, BEFORE, _stats(0, 0, 0, [], kv_cache_usage=0.0)])
    assert total == _stats(40, 150, 95, [36, 28, 19, 12], num_running=3, kv_cache_usage=1.0,
                           prompt_tokens=300, generation_tokens=600, num_steps=30)
    with pytest.raises(ValueError):
        sum_stats([])


class _State:
    num_waiting = 0

    def __init__(self) -> None:
        self.stats = _stats(0, 0, 0, [0, 0, 0])

    def get_stats(self) -> EngineStats:
        return self.stats


def test_server_metrics_adds_per_position_deltas():
    state = _State()
    m = ServerMetrics(state, num_speculative_tokens=3)
    state.stats = _stats(2, 6, 3, [2, 1, 0])
    m.on_step(state.stats, [], 0.0)
    state.stats = _stats(5, 14, 7, [4, 2, 1])
    m.on_step(state.stats, [], 0.1)
    got = {(s.name, s.labels.get("position")): s.value
           for fam in text_string_to_metric_families(m.render().decode())
           for s in fam.samples if "spec_decode" in s.name and s.name.endswith("_total")}
    assert got == {("inflight:spec_decode_num_drafts_total", None): 5,
                   ("inflight:spec_decode_num_draft_tokens_total", None): 14,
                   ("inflight:spec_decode_num_accepted_tokens_total", None): 7,
                   ("inflight:spec_decode_num_accepted_tokens_per_pos_total", "0"): 4,
                   ("inflight:spec_decode_num_accepted_tokens_per_pos_total", "1"): 2,
                   ("inflight:spec_decode_num_accepted_tokens_per_pos_total", "2"): 1}
    assert m.stats()["spec_decode"]["accepted_per_position"] == [4, 2, 1]
    assert "spec_decode" not in ServerMetrics(state).stats()
