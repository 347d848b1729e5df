"""Streaming client of an OpenAI-compatible server, timing every streamed chunk.

One request = one ``POST /v1/completions`` or ``/v1/chat/completions`` with ``stream: true``
and ``stream_options: {"include_usage": true}``. The answer is Server-Sent Events: ``data:``
lines carrying JSON chunks, a last chunk with ``usage`` and empty ``choices``, then
``data: [DONE]``. Times are read from ``clock`` (seconds) as each line is parsed.

A chunk counts as a token chunk when its first choice carries non-empty ``text``
(completions) or ``delta.content`` (chat). This follows vLLM's ``benchmark_serving``,
except that chunks without text, like the chat role chunk some servers send first, are not
taken as the first token.

The HTTP client is aiohttp's, as in vLLM's ``benchmark_serving``: its response parser is
compiled, and the load generator shares the cores with the server it measures. Streamed,
it spends about half of httpx's CPU per token (0.35-0.39 ms against 0.64-0.76 ms on the
2-vCPU host of docs/performance.md), time a 1-stream run would otherwise take from the
server's own step.

A connection that fails before the server's status line arrived (the request body could not
be written, the server closed a pooled keep-alive connection just as it was reused, or the
connect failed) is the transport's failure, not the server's answer: the request is sent once
more, on a connection of its own, and counted in ``RequestRecord.connection_retries``. aiohttp
retries exactly these errors itself, once, but only for idempotent methods
(``ClientSession._request``, after RFC 9112 section 9.3.1), never for a POST; vLLM's benchmark
client does not retry and counts them as failed requests. Anything after the status line is
the server's and fails the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import aiohttp

if TYPE_CHECKING:  # a type only: datasets -> prompts -> this module at run time
    from inflight.bench.datasets import RequestSpec

Clock = Callable[[], float]

# What a failed HTTP call raises here: aiohttp's errors, and TimeoutError for a timeout
# (aiohttp's own timeouts subclass both). Every bench call site catches this one tuple.
HTTP_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds since the run's start; lengths in tokens."""

    index: int
    scheduled_time: float  # when the arrival process said to send it
    send_time: float = 0.0  # when it was sent (later than scheduled under --max-concurrency)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    end_time: float = 0.0  # end of the stream, error or timeout
    success: bool = False
    error: str | None = None
    status: int | None = None  # HTTP status
    prompt_len: int | None = None  # expected, from the dataset
    output_len: int = 0  # requested max_tokens
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage, else the number of token chunks
    output_tokens_from_usage: bool = False
    finish_reason: str | None = None
    warmup: bool = False  # not counted: session warm-ups and a windowed point's warm-up/cool-down
    phase: str = "sample"  # session-warmup | warmup | sample | cooldown (see runner.run_point)
    unfinished: bool = False  # a sample request the point ended before it finished
    cancelled: bool = False  # a cool-down request cancelled once the sample was done
    generated_text: str = ""  # the streamed text, joined (vLLM's generated_texts)
    # Sent again because its connection failed before the status line (at most 1; its times
    # are the retry's): not a failure, counted in the summary (stats.summarize).
    connection_retries: int = 0
    model: str | None = None  # the model name sent: a LoRA adapter's with --lora-modules
    # Closed loop (--users): which user sent it, from which conversation, which turn (0-based)
    # of how many.
    user: int | None = None
    conversation: int | None = None
    turn: int | None = None
    turns: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_payload(spec: RequestSpec, endpoint: str, model: str, temperature: float | None,
                  extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body for ``endpoint`` in {"completions", "chat"}."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = spec.as_messages()
    else:
        body["prompt"] = spec.as_text()
    if temperature is not None:
        body["temperature"] = temperature
    if spec.ignore_eos:
        # vLLM's extension; sent only when wanted because strict servers reject unknown fields.
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _chunk_text(data: dict[str, Any]) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def _finish_reason(data: dict[str, Any]) -> str | None:
    for c in data.get("choices") or []:
        if c.get("finish_reason"):
            reason: str = c["finish_reason"]
            return reason
    return None


DONE = "[DONE]"  # what ``_SSE.feed`` returns for the stream's end marker


class _SSE:
    """Joins ``data:`` lines into events; tolerant of servers that omit blank lines.

    Each payload is parsed once, here: a load generator sharing the cores with the server
    it measures should spend as little as it can per token."""

    def __init__(self) -> None:
        self._buf: list[str] = []

    def feed(self, line: str) -> Any:
        """A complete event's payload, parsed (``DONE`` for ``[DONE]``), or None while one
        is still being assembled (or for JSON ``null``, which carries nothing either).

        Raises:
            ValueError: a blank line ended an event that is not JSON.
        """
        if not line:
            return self._flush()
        if line.startswith(":"):
            return None  # comment / keep-alive
        if not line.startswith("data:"):
            return None  # event:, id:, retry: carry nothing we time
        self._buf.append(line[5:].lstrip(" "))
        joined = "\n".join(self._buf)
        if joined == DONE:
            self._buf = []
            return DONE
        try:
            value = json.loads(joined)
        except ValueError:
            return None  # more lines of this event to come
        self._buf = []
        return value

    def _flush(self) -> Any:
        joined = "\n".join(self._buf)
        self._buf = []
        if not joined:
            return None
        return DONE if joined == DONE else json.loads(joined)


def before_response(error: BaseException, status: int | None) -> bool:
    """Whether ``error`` is a connection that failed before any status line came back
    (``status`` is None): aiohttp's ``ClientOSError`` ("Can not write request body", a
    refused or reset connect: ``ClientConnectorError``), ``ServerDisconnectedError`` before
    the answer, ``ClientConnectionResetError``. Not a timeout (``ServerTimeoutError``),
    which is the server's slowness, and nothing once the answer started."""
    return (status is None and isinstance(error, aiohttp.ClientConnectionError)
            and not isinstance(error, TimeoutError))


@contextlib.asynccontextmanager
async def fresh_connection(client: aiohttp.ClientSession) -> AsyncIterator[aiohttp.ClientSession]:
    """A session of ``client``'s settings whose one request opens a new connection, closed
    after it: aiohttp has no per-request way around its pool, and the idle connections a
    server closed together (a keep-alive timeout) may not all be seen closed yet. A
    stand-in for a session (the tests' scripted one) is used as it is."""
    if not isinstance(client, aiohttp.ClientSession):
        yield client
        return
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=client.timeout,
                                     trust_env=client.trust_env) as fresh:
        yield fresh


async def stream_request(client: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                         record: RequestRecord, headers: dict[str, str] | None = None,
                         timeout: float = 600.0, clock: Clock = time.perf_counter) -> RequestRecord:
    """Send one streamed request and fill ``record`` (times from ``clock``, seconds).

    ``timeout`` bounds the whole request (s); a timeout, a connection error, a non-200
    status, an ``error`` event in the stream or a stream that ends without ``[DONE]`` or a
    ``finish_reason`` makes the request a failure (``record.error``); nothing is raised.
    A connection that fails before the status line (:func:`before_response`) is retried
    once on a new connection (``record.connection_retries``); ``send_time`` is then the
    retry's, and ``timeout`` bounds the retry. A second such failure fails the request.
    """
    for attempt in range(2):
        record.send_time = clock()
        try:
            async with asyncio.timeout(timeout):
                if attempt == 0:
                    await _stream(client, url, payload, record, headers or {}, clock)
                else:
                    async with fresh_connection(client) as fresh:
                        await _stream(fresh, url, payload, record, headers or {}, clock)
        except TimeoutError:
            record.error = f"timeout after {timeout:g} s"
        except aiohttp.ClientError as e:
            if attempt == 0 and before_response(e, record.status):
                record.connection_retries += 1
                continue
            record.error = f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, TypeError) as e:  # malformed chunks (or not UTF-8)
            record.error = f"bad stream: {type(e).__name__}: {e}"
        break
    record.end_time = clock()
    if record.error:
        record.success = False
    if record.output_tokens is None:
        record.output_tokens = len(record.chunk_times)
    return record


async def post_json(client: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    """POST ``body`` as JSON to a side route (``/tokenize``, ``/reset_prefix_cache``); returns
    the status and the answer parsed as JSON (None where it is not JSON). A connection that
    fails before the status line is retried once, as a streamed request is.

    Raises:
        aiohttp.ClientError, TimeoutError: no answer (``HTTP_ERRORS``).
    """
    for attempt in range(2):
        status: int | None = None
        try:
            async with client.post(url, json=body, headers=headers or {},
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                status = resp.status
                raw = await resp.read()
            break
        except aiohttp.ClientError as e:
            if attempt == 0 and before_response(e, status):
                continue
            raise
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, None


async def _stream(client: aiohttp.ClientSession, url: str, payload: dict[str, Any], record: RequestRecord,
                  headers: dict[str, str], clock: Clock) -> None:
    async with client.post(url, json=payload, headers=headers) as resp:
        record.status = resp.status
        if resp.status != 200:
            body = (await resp.read()).decode("utf-8", "replace")
            record.error = f"HTTP {resp.status}: {body[:300]}"
            return
        sse, done = _SSE(), False
        async for line in sse_lines(resp.content.iter_any()):
            data = sse.feed(line)
            if data is None:
                continue
            now = clock()
            if data is DONE:
                done = True
                break
            if not isinstance(data, dict):
                continue
            if "error" in data:
                record.error = f"stream error: {json.dumps(data['error'])[:300]}"
                return
            text = _chunk_text(data)
            if text:
                record.chunk_times.append(now)
                record.generated_text += text
            record.finish_reason = _finish_reason(data) or record.finish_reason
            usage = data.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                if usage.get("completion_tokens") is not None:
                    record.output_tokens = int(usage["completion_tokens"])
                    record.output_tokens_from_usage = True
        record.success = done or record.finish_reason is not None
        if not record.success:
            record.error = "stream ended without [DONE] or finish_reason"


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a body that arrives in ``chunks`` of any size, decoded as UTF-8, without
    their ``\\n`` or ``\\r\\n`` ends (a lone ``\\r``, which the SSE spec also allows, is not
    taken as one). Splitting on the raw bytes keeps a character's bytes together, and a
    line may be any length (an echoed prompt's logprobs are one long line).

    Raises:
        UnicodeDecodeError: a line that is not UTF-8.
    """
    tail = b""
    async for data in chunks:
        *lines, tail = (tail + data).split(b"\n")
        for line in lines:
            yield (line[:-1] if line.endswith(b"\r") else line).decode()
    if tail:
        yield tail.rstrip(b"\r").decode()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it), else None
    (asyncio's own), for ``asyncio.Runner(loop_factory=...)``: the load generator shares
    the cores with the server it measures, and on uvloop it spends ~15 % less CPU per
    streamed token (docs/performance.md)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def make_client(max_connections: int | None = None, timeout: float = 600.0) -> aiohttp.ClientSession:
    """An aiohttp session for benchmarking: no proxies from the environment (aiohttp's
    ``trust_env=False``: a benchmark silently routed through a proxy measures the proxy),
    ``max_connections`` at once (None: no cap, so ``--max-concurrency`` alone bounds them),
    ``timeout`` seconds for any one read, 30 s at most to connect. Call it on the running
    event loop; ``async with`` closes it.
    """
    connector = aiohttp.TCPConnector(limit=max_connections or 0)
    return aiohttp.ClientSession(
        connector=connector, trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout, connect=min(timeout, 30.0)))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
