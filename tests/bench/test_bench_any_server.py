"""Against any OpenAI-compatible server (llama.cpp's llama-server, vLLM-style servers):
connections that fail before an answer are retried once and counted, not failed; a server
without ``/tokenize``, ``/reset_prefix_cache`` or ``/metrics`` is measured all the same,
and the run says what it skipped. Real sockets: the fake server, behind ``DroppingProxy``
where a connection must fail."""

from __future__ import annotations

import asyncio
import json
import logging

from bench_fake_openai import DroppingProxy, Plan, ServerState

from inflight.bench.__main__ import main
from inflight.bench.client import RequestRecord, make_client, stream_request
from inflight.bench.datasets import DatasetConfig
from inflight.bench.http_target import open_session
from inflight.bench.session import ArrivalConfig, LoadConfig, run_point

RUNNER = "inflight.bench"  # the loggers of http_target and server_routes


def send_one(base_url: str, max_tokens: int = 4) -> RequestRecord:
    async def go():
        async with make_client() as client:
            return await stream_request(client, base_url + "/v1/completions",
                                        {"model": "fake-model", "prompt": "hello there", "max_tokens": max_tokens,
                                         "stream": True}, RequestRecord(0, 0.0), timeout=20.0)
    return asyncio.run(go())


def test_a_connection_reset_before_the_answer_is_retried_on_a_new_connection(fake_server):
    srv = fake_server()
    with DroppingProxy(srv.port, drop={0}) as proxy:
        r = send_one(proxy.base_url)
    assert r.success and r.error is None and r.connection_retries == 1
    assert proxy.seen == 2 and len(srv.state.bodies) == 1  # the server answered the retry only
    assert len(r.chunk_times) == 4


def test_two_resets_in_a_row_fail_the_request(fake_server):
    srv = fake_server()
    with DroppingProxy(srv.port, drop={0, 1}) as proxy:
        r = send_one(proxy.base_url)
    assert not r.success and r.connection_retries == 1 and r.status is None
    assert r.error.startswith(("ClientOSError", "ServerDisconnectedError", "ClientConnectionResetError")), r.error
    assert proxy.seen == 2 and srv.state.bodies == []  # no third try


def test_a_connection_dropped_after_the_status_line_is_not_retried(fake_server):
    async def plan(body, i):
        return Plan(gaps=[0.0] * 3, abort_after=2)
    srv = fake_server(ServerState(plan=plan))
    with DroppingProxy(srv.port) as proxy:
        r = send_one(proxy.base_url)
    assert not r.success and r.connection_retries == 0 and r.status == 200
    assert r.error.startswith("ClientPayloadError"), r.error
    assert len(r.chunk_times) == 2 and proxy.seen == 1 and len(srv.state.bodies) == 1


def test_retries_in_a_run_are_counted_apart_from_failures(fake_server, data_dir, caplog):
    """Six requests one at a time: completions requests 0, 3, 5 and 6 reaching the proxy
    are reset before an answer. Request 0 and request 2 are retried and complete; request 3
    is retried, reset again, and fails."""
    srv = fake_server()
    ds = DatasetConfig(name="random", num_prompts=6, input_len=8, output_len=3, data_dir=str(data_dir))

    async def go(base_url):
        async with make_client() as client:
            load = LoadConfig(base_url=base_url, progress=False, max_concurrency=1, scrape_metrics=False)
            session = await open_session(load, ds, client)
            return await run_point(session, ArrivalConfig())
    with DroppingProxy(srv.port, drop={0, 3, 5, 6}) as proxy, caplog.at_level(logging.WARNING, RUNNER):
        point = asyncio.run(go(proxy.base_url))
    assert [r.connection_retries for r in point.records] == [1, 0, 1, 1, 0, 0]
    assert [r.success for r in point.records] == [True, True, True, False, True, True]
    s = point.summary
    assert (s["completed"], s["failed"], s["connection_retries"]) == (5, 1, 3)
    assert proxy.seen == 9 and len(srv.state.bodies) == 5
    said = [m for m in caplog.messages if "sent again on a new connection" in m]
    assert len(said) == 3 and "then: " in said[2]


def test_a_server_without_optional_routes_is_measured_and_says_what_it_skipped(fake_server, data_dir, tmp_path,
                                                                               caplog):
    state = ServerState(tokenize=False, reset_route=False, metrics_route=False)
    srv = fake_server(state)
    out = tmp_path / "sweep.json"
    with caplog.at_level(logging.WARNING, RUNNER):
        rc = main(["sweep", "--base-url", srv.base_url, "--data-dir", str(data_dir), "--disable-tqdm",
                   "--input-len", "8", "--output-len", "3", "--num-prompts", "4", "--request-rates", "20,40",
                   "--reset-prefix-cache", "--save-result", str(out)])
    assert rc == 0
    points = json.loads(out.read_text())["points"]
    assert [p["summary"]["completed"] for p in points] == [4, 4]
    assert [p["summary"]["failed"] for p in points] == [0, 0]
    assert [p["summary"]["connection_retries"] for p in points] == [0, 0]
    assert points[-1]["fixed"]["skipped"] == ["tokenize: HTTP 404", "metrics: HTTP 501",
                                              "reset_prefix_cache: HTTP 404"]
    assert points[-1]["fixed"]["tokenizer"] == "approx-words"
    # Tried once, not before every point; each skip said once.
    assert state.reset_requests == 1 and state.prefix_cache_resets == 0
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2, lines
    assert "skipped: /tokenize: HTTP 404 (prompt lengths approximate" in lines[0]
    assert "/metrics: HTTP 501 (no server-side" in lines[0]
    assert "lacks /reset_prefix_cache (HTTP 404)" in lines[1]


def test_with_every_route_nothing_is_skipped(fake_server, data_dir, tmp_path, caplog):
    state = ServerState()
    srv = fake_server(state)
    out = tmp_path / "serve.json"
    with caplog.at_level(logging.WARNING, RUNNER):
        rc = main(["serve", "--base-url", srv.base_url, "--data-dir", str(data_dir), "--disable-tqdm",
                   "--input-len", "8", "--output-len", "3", "--num-prompts", "3", "--reset-prefix-cache",
                   "--save-result", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["fixed"]["skipped"] == [] and result["summary"]["connection_retries"] == 0
    assert state.prefix_cache_resets == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_llama_server_tokenize_body(fake_server, data_dir):
    """llama-server's /tokenize takes {"content", "add_special"} and answers vLLM's body with
    no tokens: the counter switches to its body, and prompt lengths stay exact (BOS included)."""
    srv = fake_server(ServerState(tokenize_shape="llama.cpp"))
    ds = DatasetConfig(name="random", num_prompts=4, input_len=12, output_len=2, data_dir=str(data_dir))

    async def go():
        async with make_client() as client:
            session = await open_session(LoadConfig(base_url=srv.base_url, progress=False), ds, client)
            return session, await run_point(session, ArrivalConfig())
    session, point = asyncio.run(go())
    assert session.tokenizer_mode == "server" and session.counter.shape == "llama.cpp"
    assert session.skipped == []
    assert [r.prompt_tokens for r in point.records] == [12] * 4
    assert point.summary["prompt_len_mismatches"] == 0
