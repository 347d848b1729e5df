"""The streaming client with a virtual clock: per-request timings exact.

A stand-in for aiohttp's session streams scripted SSE bytes; before each chunk it advances
a fake clock by the scripted delay. The client reads that clock as it parses each line, so
the measured TTFT, ITL, TPOT and E2E must equal the script exactly. The real aiohttp
session is driven against real servers in test_bench_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import types

import aiohttp
import pytest

from inflight.bench.client import DONE, RequestRecord, _SSE, build_payload, sse_lines, stream_request
from inflight.bench.datasets import RequestSpec
from inflight.bench.summary import parse_slo, request_metrics, summarize


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


class ScriptedSession:
    """What ``stream_request`` uses of an ``aiohttp.ClientSession``: ``post`` answers
    ``status`` with the bytes ``body()`` yields, as ``resp.content.iter_any()`` would."""

    def __init__(self, body, status=200) -> None:
        self.body, self.status = body, status

    @contextlib.asynccontextmanager
    async def post(self, url, json=None, headers=None):
        session = self

        class Content:
            def iter_any(self):
                return session.body()

        class Response:
            status = session.status
            content = Content()

            async def read(self):
                return b"".join([c async for c in session.body()])
        yield Response()


def scripted(clock: FakeClock, events, status=200) -> ScriptedSession:
    """A session whose response streams ``events`` = [(delay s, bytes)], advancing ``clock``."""
    async def body():
        for delay, chunk in events:
            clock.t += delay
            yield chunk
    return ScriptedSession(body, status)


async def run(clock, events, status=200, start=0.0, timeout=30.0):
    clock.t = start
    return await stream_request(scripted(clock, events, status), "http://fake/v1/completions", {},
                                RequestRecord(0, start), timeout=timeout, clock=clock)


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
        return await stream_request(ScriptedSession(body), "http://fake/v1/completions", {},
                                    RequestRecord(0, 0.0), timeout=0.05)
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


def test_sse_lines_joins_lines_split_across_chunks():
    """Lines cut anywhere by the transport, a character's bytes split between two chunks,
    CRLF ends, and a last line without an end all come out whole."""
    body = 'data: {"t": "é"}\r\n\ndata: [DONE]'.encode()
    cut = body.index("é".encode()) + 1  # between the two bytes of "é"

    async def lines(chunks):
        async def gen():
            for c in chunks:
                yield c
        return [line async for line in sse_lines(gen())]
    expected = ['data: {"t": "é"}', "", "data: [DONE]"]
    assert asyncio.run(lines([body])) == expected
    assert asyncio.run(lines([body[:cut], body[cut:]])) == expected
    assert asyncio.run(lines([body[i:i + 1] for i in range(len(body))])) == expected
    assert asyncio.run(lines([b"data: x\n", b"\n"])) == ["data: x", ""]


def test_not_utf8_is_a_bad_stream():
    r = asyncio.run(run(FakeClock(), [(0.1, b"data: \xff\n\n")]))
    assert not r.success and r.error.startswith("bad stream: UnicodeDecodeError")


def test_payloads():
    spec = RequestSpec("hello", None, 3, 16, ignore_eos=True)
    body = build_payload(spec, "completions", "m", 0.0, {"top_k": 5})
    assert body == {"model": "m", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                    "prompt": "hello", "temperature": 0.0, "ignore_eos": True, "top_k": 5}
    body = build_payload(RequestSpec("q", None, None, 8, ignore_eos=False), "chat", "m", None)
    assert body["messages"] == [{"role": "user", "content": "q"}]
    assert "ignore_eos" not in body and "temperature" not in body and "prompt" not in body


# ---------------------------------------------------------------- connection retries

class FlakySession(ScriptedSession):
    """``post`` fails with ``errors[k]`` on its k-th call (None: answers), before any status
    line, after ``fail_delay`` seconds of the virtual clock: the time the failed attempt took."""

    def __init__(self, clock, events, errors, fail_delay=0.5) -> None:
        super().__init__(scripted(clock, events).body)
        self.clock, self.errors, self.fail_delay, self.calls = clock, list(errors), fail_delay, 0

    @contextlib.asynccontextmanager
    async def post(self, url, json=None, headers=None):
        k, self.calls = self.calls, self.calls + 1
        error = self.errors[k] if k < len(self.errors) else None
        if error is not None:
            self.clock.t += self.fail_delay
            raise error
        async with super().post(url, json, headers) as resp:
            yield resp


def connector_error():
    key = types.SimpleNamespace(host="127.0.0.1", port=8080, ssl=True)
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connection refused"))


PRE_RESPONSE = [
    aiohttp.ClientOSError(32, "Can not write request body for http://fake/v1/completions"),
    aiohttp.ServerDisconnectedError(),
    aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
    connector_error(),
]


@pytest.mark.parametrize("error", PRE_RESPONSE, ids=lambda e: type(e).__name__)
def test_a_connection_failing_before_the_status_line_is_retried_once(error):
    """The retry succeeds: the request is no failure, counted once, and timed from the
    retry (the failed attempt's 0.5 s is in neither TTFT nor E2E)."""
    clock = FakeClock()
    clock.t = 3.0
    session = FlakySession(clock, completion_events(0.25, [0.125]), [error])
    r = asyncio.run(stream_request(session, "http://fake/v1/completions", {}, RequestRecord(0, 3.0), clock=clock))
    assert session.calls == 2
    assert r.success and r.error is None and r.connection_retries == 1
    assert r.send_time == 3.5 and r.chunk_times == [3.75, 3.875] and r.end_time == 3.875
    m = request_metrics(r)
    assert (m.ttft, m.e2e) == (0.25, 0.375)


def test_a_second_failure_before_the_status_line_fails_the_request():
    clock = FakeClock()
    session = FlakySession(clock, completion_events(0.25, [0.125]),
                           [aiohttp.ServerDisconnectedError(), PRE_RESPONSE[0]])
    r = asyncio.run(stream_request(session, "http://fake/v1/completions", {}, RequestRecord(0, 0.0), clock=clock))
    assert session.calls == 2  # one retry, no more
    assert not r.success and r.connection_retries == 1 and r.status is None
    assert r.error == "ClientOSError: [Errno 32] Can not write request body for http://fake/v1/completions"
    assert r.send_time == 0.5 and r.end_time == 1.0


@pytest.mark.parametrize("error", [aiohttp.ServerDisconnectedError(),
                                   aiohttp.ClientPayloadError("Response payload is not completed")],
                         ids=lambda e: type(e).__name__)
def test_an_error_after_the_status_line_is_not_retried(error):
    """The answer had started (status 200, one token): the server's failure, not retried."""
    clock = FakeClock()
    calls = []

    async def body():
        calls.append(1)
        clock.t += 0.25
        yield sse(comp("a"))
        raise error
    r = asyncio.run(stream_request(ScriptedSession(body), "http://fake/v1/completions", {},
                                   RequestRecord(0, 0.0), clock=clock))
    assert len(calls) == 1
    assert not r.success and r.connection_retries == 0 and r.status == 200
    assert r.error.startswith(type(error).__name__) and r.chunk_times == [0.25]


def test_a_timeout_before_the_status_line_is_not_retried():
    clock = FakeClock()
    session = FlakySession(clock, completion_events(0.25, []), [aiohttp.ConnectionTimeoutError("connect")])
    r = asyncio.run(stream_request(session, "http://fake/v1/completions", {}, RequestRecord(0, 0.0),
                                   timeout=7.0, clock=clock))
    assert session.calls == 1 and not r.success and r.connection_retries == 0
    assert r.error == "timeout after 7 s"


def test_summary_counts_connection_retries_apart_from_failures():
    clock = FakeClock()
    flaky = [[PRE_RESPONSE[1]], [], [PRE_RESPONSE[0], PRE_RESPONSE[1]], [PRE_RESPONSE[0]]]
    records = []
    for i, errors in enumerate(flaky):
        clock.t = float(i)
        r = RequestRecord(i, float(i), warmup=i == 3, phase="cooldown" if i == 3 else "sample")
        records.append(asyncio.run(stream_request(FlakySession(clock, completion_events(0.125, [0.125]), errors),
                                                  "http://fake/v1/completions", {}, r, clock=clock)))
    s = summarize(records)
    # Requests 0 and 3 retried and completed; request 2 retried and failed; request 3 is a
    # cool-down request: its retry counts, its outcome does not.
    assert s["connection_retries"] == 3
    assert (s["completed"], s["failed"]) == (2, 1)
    assert list(s["errors"]) == ["ServerDisconnectedError: Server disconnected"]
    assert records[0].to_json()["connection_retries"] == 1
