"""Faults inside the engine, injected at a chosen call (``inflight.faults``), and a client
that stops reading: on a real uvicorn around the real model.

Promises checked: only the failing step's requests fail (a model or sampling fault fails
the step's batch; a detokenizer fault fails its one request); their clients hear it (an
error event before ``[DONE]`` on a stream whose 200 went out, a 500 with an OpenAI error
body otherwise); their KV blocks are freed; requests outside the step finish normally; the
engine keeps stepping; and an unread stream neither stalls the others nor piles up output.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from inflight.faults import FAULTS
from tests.reliability.conftest import (app_metrics, assert_engine_clean, engine_sharing_model,
                                        finished_by_reason, is_idle, scrape)
from tests.server.conftest import MODEL, serve, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MAX_NUM_SEQS = 3


@pytest.fixture(scope="module")
def served(base_engine):
    with engine_sharing_model(base_engine, max_num_seqs=MAX_NUM_SEQS) as engine:
        srv, async_engine = serve(engine)
        try:
            yield srv, engine, async_engine
        finally:
            FAULTS.disarm()
            srv.stop()
            async_engine.shutdown()


@pytest.fixture(autouse=True)
def _disarmed():
    FAULTS.disarm()
    yield
    FAULTS.disarm()


def _stream(url: str, body: dict, out: dict, key: str) -> None:
    """POST a streamed completion and keep its status and ``data:`` payloads in ``out[key]``."""
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": MODEL, "stream": True, **body}) as r:
        out[key] = (r.status_code, [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")])


def _finish(events: list[str]) -> str | None:
    reasons = [c["finish_reason"] for e in events[:-1] if "choices" in (d := json.loads(e))
               for c in d["choices"]]
    return next((r for r in reversed(reasons) if r), None)


@pytest.mark.parametrize("site", ["runner", "sampler"])
def test_a_step_fault_fails_only_that_steps_requests(served, site):
    srv, engine, async_engine = served
    url = srv.base_url
    before = scrape(url)
    out: dict = {}
    # Three running streams fill max_num_seqs; a fourth waits, outside every step.
    runners = [threading.Thread(target=_stream, args=(url, {
        "prompt": f"Story {i}:", "max_tokens": 40, "ignore_eos": True}, out, f"r{i}"))
        for i in range(MAX_NUM_SEQS)]
    for t in runners:
        t.start()
    wait_until(lambda: engine.scheduler.num_running == MAX_NUM_SEQS, what="three running")
    waiter = threading.Thread(target=_stream, args=(url, {
        "prompt": "Waiting:", "max_tokens": 5, "ignore_eos": True}, out, "w"))
    waiter.start()
    wait_until(lambda: engine.scheduler.num_waiting == 1, what="one waiting")
    steps = engine.get_stats().num_steps
    FAULTS.arm(site)
    for t in [*runners, waiter]:
        t.join(60)
    assert FAULTS.tripped == [(site, None)]
    for i in range(MAX_NUM_SEQS):
        status, events = out[f"r{i}"]
        # The 200 went out with the first token: the failure is an error event, then [DONE].
        assert status == 200 and events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert f"injected fault at {site}" in err["message"]
    status, events = out["w"]
    assert status == 200 and events[-1] == "[DONE]" and _finish(events) == "length"
    assert engine.get_stats().num_steps > steps + 1  # it stepped on after the fault
    wait_until(lambda: is_idle(url), what="idle")
    assert_engine_clean(engine, async_engine, app_metrics(srv))
    grew = finished_by_reason(before, scrape(url))
    assert (grew["error"], grew["length"]) == (MAX_NUM_SEQS, 1), grew


def test_a_fault_before_the_first_token_is_a_500_with_an_error_body(served):
    srv, engine, async_engine = served
    FAULTS.arm("runner")
    for body in ({"prompt": "Hello", "max_tokens": 4},
                 {"prompt": "Hello", "max_tokens": 4, "stream": True}):
        r = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={"model": MODEL, **body})
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "engine_error"
        FAULTS.arm("runner")
    FAULTS.disarm()
    ok = httpx.post(srv.base_url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    wait_until(lambda: is_idle(srv.base_url), what="idle")
    assert_engine_clean(engine, async_engine)


def test_a_detokenizer_fault_fails_only_its_request(served):
    srv, engine, async_engine = served
    url = srv.base_url
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, {
        "prompt": f"Poem {i}:", "max_tokens": 30, "ignore_eos": True}, out, i)) for i in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: engine.scheduler.num_running == 2, what="both running")
    FAULTS.arm("detokenizer", nth=3)  # one sequence's token, a few tokens from now
    for t in threads:
        t.join(60)
    (site, failed_id), = FAULTS.tripped
    assert site == "detokenizer" and failed_id is not None
    results = sorted((_finish(out[i][1]) or "error", "error" in out[i][1][-2]) for i in range(2))
    assert results == [("error", True), ("length", False)], out
    wait_until(lambda: is_idle(url), what="idle")
    assert_engine_clean(engine, async_engine)


def test_a_client_that_stops_reading_stalls_nobody(served):
    srv, engine, async_engine = served
    url = srv.base_url
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "Never read:", "max_tokens": 60,
                       "ignore_eos": True, "stream": True}).encode()
    # A raw client that sends its request and then reads nothing.
    silent = socket.create_connection((host, int(port)))
    silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                   b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        wait_until(lambda: engine.scheduler.num_running == 1, what="the silent one running")
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - t0 < 10
        # The engine generated the silent request to its end meanwhile.
        wait_until(lambda: engine.scheduler.num_running == 0, timeout=30, what="it to finish")
        data = b""
        silent.settimeout(10)
        while not data.endswith(b"0\r\n\r\n"):  # the end of the chunked body
            chunk = silent.recv(65536)
            assert chunk, "connection closed before the stream ended"
            data += chunk
        assert b"data: [DONE]" in data and b'"finish_reason": "length"' in data
    finally:
        silent.close()
    wait_until(lambda: is_idle(url), what="idle")
    assert_engine_clean(engine, async_engine)


def test_an_unread_stream_holds_one_merged_output_not_a_backlog():
    import asyncio

    from inflight.outputs import CompletionOutput, RequestOutput
    from inflight.engine.stream import RequestStream

    def delta(i: int, last: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(
            0, f"t{i} ", [i], finish_reason="length" if last else None)], finished=last)

    async def run():
        stream = RequestStream("r", lambda _: None, asyncio.get_running_loop())
        for i in range(200):
            stream.put(delta(i))
        await asyncio.sleep(0)  # let the loop run the engine thread's hand-offs
        assert stream.num_pending == 1
        stream.put(delta(200, last=True))
        stream.put(RuntimeError("after the end"))
        await asyncio.sleep(0)
        # The final output merges into the pending one; an error is never merged.
        assert stream.num_pending == 2
        items = [item async for item in stream]
        return items

    items = asyncio.run(run())
    assert len(items) == 1 and items[0].finished
    assert items[0].outputs[0].token_ids == list(range(201))
    assert items[0].outputs[0].text == "".join(f"t{i} " for i in range(201))


def test_the_heap_is_trimmed_when_idle_and_at_a_longer_interval_when_busy():
    from inflight.engine.memory import HeapTrimmer

    now = [100.0]
    calls = []
    heap = HeapTrimmer(idle_interval_s=5, busy_interval_s=60, clock=lambda: now[0],
                       trim=lambda: calls.append(now[0]) or 1)
    assert not heap.maybe(idle=True)  # 0 s since construction
    now[0] = 105.0
    assert heap.maybe(idle=True) and calls == [105.0]
    now[0] = 140.0
    assert not heap.maybe(idle=False)  # busy: 35 s < 60 s
    assert heap.maybe(idle=True)  # idle: 35 s >= 5 s
    now[0] = 200.0
    assert heap.maybe(idle=False) and calls == [105.0, 140.0, 200.0]
    assert heap.num_trims == 3
