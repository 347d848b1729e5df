"""The streaming client through httpx, with a virtual clock: per-request timings exact.

A MockTransport streams scripted SSE bytes; before each chunk it advances a fake clock by
the scripted delay. The client reads that clock as it parses each line, so the measured
TTFT, ITL, TPOT and E2E must equal the script exactly.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from inflight.bench.client import DONE, RequestRecord, _SSE, build_payload, stream_request
from inflight.bench.datasets import RequestSpec
from inflight.bench.stats import parse_slo, request_metrics, summarize


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def comp(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat(content=None, role=None, finish=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(p, c):
    return {"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}


def scripted(clock: FakeClock, events, status=200):
    """Transport whose response streams ``events`` = [(delay s, bytes)], advancing ``clock``."""
    async def body():
        for delay, chunk in events:
            clock.t += delay
            yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


async def run(clock, events, status=200, start=0.0, timeout=30.0):
    clock.t = start
    async with httpx.AsyncClient(transport=scripted(clock, events, status)) as client:
        return await stream_request(client, "http://fake/v1/completions", {}, RequestRecord(0, start),
                                    timeout=timeout, clock=clock)


def completion_events(ttft, gaps, prompt_tokens=7, tokens_per_chunk=1, with_usage=True):
    delays = [ttft, *gaps]
    ev = [(d, sse(comp("x" * tokens_per_chunk, "length" if i == len(delays) - 1 else None)))
          for i, d in enumerate(delays)]
    if with_usage:
        ev.append((0.0, sse(usage(prompt_tokens, len(delays) * tokens_per_chunk))))
    ev.append((0.0, sse(b"[DONE]")))
    return ev


def test_completion_stream_timings_exact():
    clock = FakeClock()
    r = asyncio.run(run(clock, completion_events(0.25, [0.125, 0.5, 0.125]), start=3.0))
    assert r.success and r.error is None and r.status == 200
    assert r.send_time == 3.0
    assert r.chunk_times == [3.25, 3.375, 3.875, 4.0]
    assert (r.prompt_tokens, r.output_tokens, r.output_tokens_from_usage) == (7, 4, True)
    assert r.finish_reason == "length"
    m = request_metrics(r)
    assert (m.ttft, m.itls, m.e2e, m.tpot) == (0.25, [0.125, 0.5, 0.125], 1.0, 0.25)


def test_chat_stream_role_chunk_is_not_a_token():
    clock = FakeClock()
    events = [(0.125, sse(chat(role="assistant", content=""))), (0.125, sse(chat("Hi"))),
              (0.25, sse(chat(" there", finish="stop"))), (0.0, sse(usage(5, 2))), (0.0, sse(b"[DONE]"))]
    r = asyncio.run(run(clock, events))
    m = request_metrics(r)
    assert r.success and r.chunk_times == [0.25, 0.5]
    assert (m.ttft, m.itls, m.e2e, m.tpot) == (0.25, [0.25], 0.5, 0.25)
    assert r.finish_reason == "stop"


def test_multi_token_chunks_and_missing_usage():
    clock = FakeClock()
    r = asyncio.run(run(clock, completion_events(0.5, [0.25, 0.25], tokens_per_chunk=2)))
    assert r.output_tokens == 6 and request_metrics(r).tpot == (1.0 - 0.5) / 5
    r = asyncio.run(run(clock, completion_events(0.5, [0.25, 0.25], with_usage=False)))
    # Without usage the chunk count stands in, and the record says so.
    assert r.success and r.output_tokens == 3 and not r.output_tokens_from_usage


def test_summary_over_streamed_requests_exact():
    """Four requests streamed on the virtual clock; aggregates and goodput exact."""
    clock = FakeClock()
    plans = [(0.0, 0.125, [0.25, 0.25]), (0.25, 0.5, [0.125]), (0.5, 0.25, [0.5, 0.5, 0.5]), (1.0, 1.0, [])]
    records = [asyncio.run(run(clock, completion_events(ttft, gaps), start=start))
               for start, ttft, gaps in plans]
    for i, r in enumerate(records):
        r.index = i
    s = summarize(records, parse_slo("ttft=0.25,itl=0.25"))
    assert s["duration"] == 2.25 - 0.0  # request 2 ends at 0.5 + 0.25 + 1.5
    assert s["ttft"]["mean"] == (0.125 + 0.5 + 0.25 + 1.0) / 4
    assert s["ttft"]["median"] == (0.25 + 0.5) / 2
    assert sorted(g for r in records for g in request_metrics(r).itls) == [0.125, 0.25, 0.25, 0.5, 0.5, 0.5]
    assert s["itl"]["median"] == 0.375
    assert s["e2e"]["max"] == 1.75
    assert s["tpot"]["mean"] == (0.25 + 0.125 + 0.5) / 3
    # TTFT <= 0.25 and every gap <= 0.25: only request 0 (request 2 has 0.5 s gaps).
    assert s["good_requests"] == 1 and s["goodput"] == 1 / 2.25
    assert s["total_output_tokens"] == 3 + 2 + 4 + 1
    assert s["peak_concurrency"] == 3


@pytest.mark.parametrize("events,status,message", [
    ([(0.0, b'{"error": {"message": "bad"}}')], 400, "HTTP 400"),
    ([(0.1, sse(comp("a"))), (0.1, sse({"error": {"message": "boom"}}))], 200, "stream error"),
    ([(0.1, sse(comp("a")))], 200, "without [DONE]"),
    ([(0.1, b"data: {not json\n\n")], 200, "bad stream"),
])
def test_failures(events, status, message):
    r = asyncio.run(run(FakeClock(), events, status=status))
    assert not r.success and message in r.error
    assert request_metrics(r).ttft is None


def test_timeout_is_a_failure():
    async def main():
        async def body():
            yield sse(comp("a"))
            await asyncio.sleep(5)
            yield sse(b"[DONE]")
        transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, "http://fake/v1/completions", {}, RequestRecord(0, 0.0),
                                        timeout=0.05)
    r = asyncio.run(main())
    assert not r.success and r.error.startswith("timeout")


def test_sse_parser_tolerates_comments_multiline_and_missing_blank_lines():
    p = _SSE()
    assert p.feed(": keep-alive") is None
    assert p.feed("event: message") is None
    assert p.feed('data: {"a":') is None
    assert p.feed('data: 1}') == {"a": 1}  # parsed once the lines make JSON
    assert p.feed('data:{"b": 2}') == {"b": 2}  # no space after the colon
    assert p.feed("data: [DONE]") is DONE
    assert p.feed("") is None
    assert p.feed('data: {"c"') is None
    with pytest.raises(ValueError):  # a blank line ends an event that never became JSON
        p.feed("")


def test_payloads():
    spec = RequestSpec("hello", None, 3, 16, ignore_eos=True)
    body = build_payload(spec, "completions", "m", 0.0, {"top_k": 5})
    assert body == {"model": "m", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                    "prompt": "hello", "temperature": 0.0, "ignore_eos": True, "top_k": 5}
    body = build_payload(RequestSpec("q", None, None, 8, ignore_eos=False), "chat", "m", None)
    assert body["messages"] == [{"role": "user", "content": "q"}]
    assert "ignore_eos" not in body and "temperature" not in body and "prompt" not in body
