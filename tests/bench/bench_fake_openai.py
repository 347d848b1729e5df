"""A small fake OpenAI-compatible server with scripted token timings, for the bench tests.

Each request's timing comes from a ``plan`` callable (async, so it may queue on a lock to
model a busy engine): wait ``ttft`` seconds, send the first token chunk, then one chunk per
entry of ``gaps``. Tokens are "tok" strings; ``usage`` reports ``len(gaps) + 1`` chunks x
``tokens_per_chunk`` completion tokens and the prompt's token count from the same toy
tokenizer as ``/tokenize`` (one token per 4 characters of each word, plus a BOS).

Runs in a thread of the test process (``FakeServer``) or as a script (``--port``, ``--ttft``)
for the ``--serve-cmd`` tests. Listens on 127.0.0.1 only.

Like servers other than inflight and vLLM, it can lack ``/reset_prefix_cache`` (404),
``/metrics`` (501, as llama-server without ``--metrics``) and ``/tokenize`` (404), or take
llama-server's ``/tokenize`` body (``tokenize_shape="llama.cpp"``). ``DroppingProxy`` stands
in front of it and closes chosen requests' connections before any answer, as a server
closing a reused keep-alive connection does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def toy_count(text: str) -> int:
    """BOS + ceil(len(word) / 4) per whitespace word: some words cost several tokens."""
    return 1 + sum(math.ceil(len(w) / 4) for w in text.split())


@dataclass
class Plan:
    ttft: float = 0.0  # s before the first token chunk
    gaps: list[float] = field(default_factory=list)  # s before each further chunk
    tokens_per_chunk: int = 1
    status: int = 200
    usage: bool = True
    error_after: int | None = None  # send an error event after this many chunks
    abort_after: int | None = None  # drop the connection after this many chunks (the answer started)


PlanFn = Callable[[dict, int], Awaitable[Plan]]


async def default_plan(body: dict, index: int) -> Plan:
    return Plan(ttft=0.0, gaps=[0.0] * max(0, int(body.get("max_tokens", 4)) - 1))


@dataclass
class ServerState:
    plan: PlanFn = default_plan
    tokenize: bool = True
    tokenize_shape: str = "vllm"  # or "llama.cpp": body {"content", "add_special"}; {"tokens": []} without it
    reset_route: bool = True  # False: POST /reset_prefix_cache is 404
    metrics_route: bool = True  # False: GET /metrics is 501, as llama-server's without --metrics
    preemptions_per_request: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() per request
    bodies: list[dict] = field(default_factory=list)
    running: int = 0
    preemptions: float = 0.0
    prefix_cache_resets: int = 0
    reset_requests: int = 0  # POST /reset_prefix_cache, answered or not


def make_app(state: ServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        state.reset_requests += 1
        if not state.reset_route:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        state.prefix_cache_resets += 1
        return {"num_dropped_blocks": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": 4096}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        if not state.tokenize:
            return JSONResponse({"error": "no"}, status_code=404)
        body = await req.json()
        if state.tokenize_shape == "llama.cpp":  # llama-server: no "content", no tokens
            if "content" not in body:
                return {"tokens": []}
            n = toy_count(body["content"]) - (0 if body.get("add_special") else 1)
            return {"tokens": list(range(n))}
        n = toy_count(body["prompt"])
        return {"tokens": list(range(n)), "count": n, "max_model_len": 4096}

    @app.get("/metrics")
    async def metrics():
        if not state.metrics_route:
            return PlainTextResponse("This server does not support metrics endpoint.", status_code=501)
        return PlainTextResponse(
            "# HELP inflight:num_requests_running r\n# TYPE inflight:num_requests_running gauge\n"
            f"inflight:num_requests_running{{model_name=\"fake-model\"}} {state.running}\n"
            "# HELP inflight:num_requests_waiting w\n# TYPE inflight:num_requests_waiting gauge\n"
            "inflight:num_requests_waiting{model_name=\"fake-model\"} 0\n"
            "# HELP inflight:kv_cache_usage_perc kv\n# TYPE inflight:kv_cache_usage_perc gauge\n"
            f"inflight:kv_cache_usage_perc{{model_name=\"fake-model\"}} {min(1.0, state.running / 8)}\n"
            "# HELP inflight:num_preemptions_total p\n# TYPE inflight:num_preemptions_total counter\n"
            f"inflight:num_preemptions_total{{model_name=\"fake-model\"}} {state.preemptions}\n"
            "# HELP inflight:cache_config_info c\n# TYPE inflight:cache_config_info gauge\n"
            "inflight:cache_config_info{block_size=\"16\",num_gpu_blocks=\"64\"} 1.0\n")

    async def handle(req: Request, chat: bool):
        state.arrivals.append(time.perf_counter())
        body = await req.json()
        index = len(state.bodies)
        state.bodies.append(body)
        plan = await state.plan(body, index)
        if plan.status != 200:
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error",
                                           "param": None, "code": plan.status}}, status_code=plan.status)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        return StreamingResponse(_stream(state, plan, chat, toy_count(prompt)), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, chat=True)

    return app


def _chunk(chat: bool, text: str, finish: str | None = None) -> str:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return "data: " + json.dumps({"id": "x", "object": "chunk", "choices": [choice]}) + "\n\n"


async def _stream(state: ServerState, plan: Plan, chat: bool, prompt_tokens: int):
    state.running += 1
    try:
        if chat:
            # A role-only first chunk, as vLLM and OpenAI send: not a token.
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
        delays = [plan.ttft, *plan.gaps]
        text = "tok" * plan.tokens_per_chunk
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            if plan.error_after is not None and i == plan.error_after:
                yield "data: " + json.dumps({"error": {"message": "scripted", "code": 500}}) + "\n\n"
                return
            if plan.abort_after is not None and i == plan.abort_after:
                raise ConnectionAbortedError("scripted: the connection drops mid-answer")
            yield _chunk(chat, text, "length" if i == len(delays) - 1 else None)
        state.preemptions += state.preemptions_per_request
        if plan.usage:
            n = len(delays) * plan.tokens_per_chunk
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        state.running -= 1


class FakeServer:
    """Serve ``make_app(state)`` with uvicorn in a daemon thread on a free 127.0.0.1 port."""

    def __init__(self, state: ServerState | None = None) -> None:
        self.state = state or ServerState()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._server.force_exit = True  # do not wait for streams a test left behind
        self._thread.join(timeout=10)
        self._sock.close()


class DroppingProxy:
    """A TCP proxy on a free 127.0.0.1 port in front of ``target_port``, in a thread of its
    own. Requests pass through, except that the connection carrying the ``n``-th request
    whose request line starts with ``match`` (0-based, counted in arrival order), for each
    ``n`` in ``drop``, is reset (RST) once the request has been read whole, before any byte
    of an answer: what a client sees when a server closes a keep-alive connection it is
    reusing. ``seen``: how many matching requests arrived."""

    def __init__(self, target_port: int, drop=(), match: bytes = b"POST /v1/") -> None:
        self.target_port, self.drop, self.match = target_port, set(drop), match
        self.seen = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.base_url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        back = asyncio.ensure_future(self._copy(up_reader, writer))
        try:
            while True:  # one request at a time: head, then a Content-Length body
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                if head.startswith(self.match):
                    n, self.seen = self.seen, self.seen + 1
                    if n in self.drop:
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        break
                up_writer.write(head + body)
                await up_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass  # the client went away, or the proxy stops (a cancelled handler would be logged)
        finally:
            up_writer.close()
            back.cancel()
            writer.close()

    @staticmethod
    async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            dst.close()

    def __enter__(self) -> "DroppingProxy":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def queueing_plan(service: float, slots: int = 1, ttft: float = 0.0) -> PlanFn:
    """A server with a known service rate, ``slots / service`` requests/s: each request holds
    one of ``slots`` for ``service`` seconds (first come, first served), then streams its
    tokens after a further ``ttft`` seconds."""
    sem = asyncio.Semaphore(slots)

    async def plan(body: dict, index: int) -> Plan:
        async with sem:
            await asyncio.sleep(service)
        return Plan(ttft=ttft, gaps=[0.0] * max(0, int(body.get("max_tokens", 4)) - 1))
    return plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft", type=float, default=0.0)
    ap.add_argument("--service", type=float, default=0.0, help="s a request holds a slot")
    ap.add_argument("--slots", type=int, default=1)
    args = ap.parse_args()
    plan = queueing_plan(args.service, args.slots, args.ttft)

    uvicorn.run(make_app(ServerState(plan=plan)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
