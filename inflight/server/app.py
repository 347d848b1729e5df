"""The OpenAI-compatible HTTP server: FastAPI routes and ``inflight serve``.

Routes (shapes of OpenAI's API and vLLM's server,
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE or not),
  ``GET /v1/models``: behind ``--api-key`` when one is set (401 otherwise).
- ``GET /health`` (200 while the engine loop runs, else 503), ``GET``/``HEAD /metrics``
  (Prometheus, every series labelled ``model_name``), ``GET /stats`` (sliding-window
  latency percentiles, JSON), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``
  (vLLM's).

The engine steps in a background thread (``AsyncEngine``); routes only validate, tokenize
(in a worker thread) and wait on their request's queue. A client that disconnects aborts
its request at once, streamed or not. See docs/server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from inflight.engine.async_engine import AsyncEngine
from inflight.engine.watchdog import EXIT_ENGINE_DEAD
from inflight.server import responses as R
from inflight.server import serving
from inflight.server.error_responses import OpenAIError, bad_request, install_error_handlers
from inflight.server.generation import Generation, ServerContext, encode
from inflight.server.logprobs import TokenTexts
from inflight.server.metrics import ServerMetrics
from inflight.server.middleware import (AdmissionMiddleware, ApiKeyMiddleware,
                                        BodySizeLimitMiddleware)
from inflight.server.tenants import (DEFAULT_TENANT, TenantKeys, TenantLimits, TenantSettings,
                                     add_tenant_args, describe_tenants)
from inflight.server.tool_parsers import TOOL_PARSERS
from inflight.server.protocol import (MAX_TOKENS_MARK, TOKEN_ID_MARK, ChatCompletionRequest,
                                      CompletionRequest, DetokenizeRequest, TokenizeRequest)

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_WAITING = 512
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
API_KEY_ENV = "INFLIGHT_API_KEY"


# --- the app ------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, *, model_names: Sequence[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, stats_window_s: float = 60.0,
              manage_engine: bool = True, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, tenants: TenantSettings | None = None,
              max_tokens_default: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: the engine loop; started by the app's lifespan (and shut down with it
            when ``manage_engine``).
        model_names: names clients may use in ``model``; the first is reported.
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>`` (the
            tenant ``default``; ``tenants`` adds named keys).
        max_body_bytes: larger request bodies get 413.
        stats_window_s: seconds covered by ``/stats`` and the ``*_window`` gauges.
        manage_engine: shut the engine down when the app stops.
        tool_call_parser: how ``tool_choice: "auto"`` replies are parsed into tool calls
            (``tool_parsers.TOOL_PARSERS``); None: no auto tool choice.
        enable_auto_tool_choice: allow ``tool_choice: "auto"`` (vLLM's flag).
        tenants: API keys by tenant, per-tenant limits, prefix-cache sharing
            (``server/tenants.py``).
        max_tokens_default: tokens a request generates when its body sets no limit
            (``--max-tokens-default``; None: what ``max_model_len`` leaves).

    Raises:
        ValueError: no model name, an unknown tool parser, or auto tool choice without one.
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: one of {sorted(TOOL_PARSERS)}, "
                         f"got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")
    if not model_names:
        raise ValueError("model_names: at least one name is required")
    cfg = engine.config
    metrics = ServerMetrics(engine, window_s=stats_window_s,
                            max_num_batched_tokens=cfg.max_num_batched_tokens,
                            config_labels=_config_labels(engine, model_names[0]),
                            model_name=model_names[0], cache_config=_cache_config(engine))
    engine.listeners.append(metrics.on_step)
    tenants = tenants or TenantSettings()
    keys = dict(tenants.keys)
    if api_key:
        keys.setdefault(api_key, DEFAULT_TENANT)
    tenant_keys = TenantKeys(keys)
    limits = TenantLimits(tenants.max_concurrent_requests, tenants.tokens_per_minute,
                          tenant_keys.names, metrics.registry, model_name=model_names[0])
    ctx = ServerContext(engine, list(model_names), metrics, TokenTexts(engine.tokenizer),
                        tool_call_parser, enable_auto_tool_choice, max_tokens_default,
                        isolate_prefix_cache=not tenants.shared_prefix_cache, tenants=limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="inflight", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.openapi = lambda: _openapi(  # type: ignore[method-assign]
        app, engine, model_names, rate_limited=limits.limited)
    app.state.ctx = ctx
    install_error_handlers(app)
    # Starlette runs the middleware added last first: the key, then admission, then size.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(AdmissionMiddleware, refusal=engine.refusal, paths=_GENERATION_PATHS)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=tenant_keys, protected=_needs_key)
    app.include_router(_v1_router(ctx))
    app.include_router(_ops_router(ctx, metrics))
    app.include_router(_admin_router(ctx))
    return app


_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

# Routes behind --api-key: the OpenAI API and what changes engine state. /health, /metrics,
# /stats and /tokenize stay open, as in vLLM.
_ADMIN_PATHS = ("/reset_prefix_cache",)


def _needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in _ADMIN_PATHS


# Request fields each scheduling policy acts on; under another policy they are refused
# (RequestOptions.check_policy) and left out of the document.
_POLICY_FIELDS = {"priority": ("priority", "fair"), "ttft_slo": ("slo",), "itl_slo": ("slo",)}


def _openapi(app: FastAPI, engine: AsyncEngine, model_names: Sequence[str],
             rate_limited: bool = False) -> dict[str, Any]:
    """The OpenAPI document as this server behaves: validation failures are 400 (FastAPI
    documents 422); token ids and ``max_tokens`` carry this model's bounds, ``model`` the
    served names, and only the scheduling fields this server's policy acts on are listed;
    so a client, or a fuzzer, learns from it what will be accepted."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=_version(), summary=app.summary, routes=app.routes)
    for ops in doc["paths"].values():
        for op in ops.values():
            op["responses"].pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    bounds = {TOKEN_ID_MARK: engine.tokenizer.vocab_size - 1,
              MAX_TOKENS_MARK: engine.max_model_len - 1}

    def bound(node: Any) -> None:
        if isinstance(node, dict):
            for mark, limit in bounds.items():
                if node.pop(mark, False):
                    node["maximum"] = limit
            for v in node.values():
                bound(v)
        elif isinstance(node, list):
            for v in node:
                bound(v)
    bound(schemas)
    for ops in doc["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", []):
                if param.get("name") == "model_id":
                    param["schema"] = {"type": "string", "enum": list(model_names)}
    policy = engine.config.scheduling_policy
    ignored = [f for f, policies in _POLICY_FIELDS.items() if policy not in policies]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
                 "DetokenizeRequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"]["anyOf"] = [{"type": "string", "enum": list(model_names)},
                                       {"type": "null"}]
        for field in ignored:
            props.pop(field, None)
    if rate_limited:  # per-tenant limits: the generation routes may answer 429
        for path in _GENERATION_PATHS:
            op = doc["paths"][path]["post"]
            op["responses"]["429"] = {
                "description": R.errors(429)[429]["description"],
                "content": op["responses"]["400"]["content"]}
    app.openapi_schema = doc
    return doc


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("inflight-serve")
    except PackageNotFoundError:
        return "0"


def _cache_config(engine: AsyncEngine) -> dict[str, str]:
    """The labels of ``inflight:cache_config_info``, vLLM's ``cache_config_info`` names.

    ``num_gpu_blocks`` is the KV pool in blocks wherever it lives (vLLM's name, which
    dashboards and benchmark tools read); ``cache_dtype`` the pool's element type where the
    runner has KV tensors, else the ``--kv-cache-dtype`` setting.
    """
    cfg = engine.config
    caches = getattr(getattr(engine.engine, "runner", None), "kv_caches", None)
    dtype = str(caches[0].dtype).removeprefix("torch.") if caches else cfg.kv_cache_dtype
    return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(engine.num_kv_blocks),
            "cache_dtype": dtype,
            "enable_prefix_caching": str(cfg.enable_prefix_caching).lower()}


def _config_labels(engine: AsyncEngine, name: str) -> dict[str, str]:
    cfg = engine.config
    return {"model": name, "block_size": str(cfg.block_size),
            "num_kv_blocks": str(engine.num_kv_blocks),
            "max_num_seqs": str(cfg.max_num_seqs),
            "max_num_batched_tokens": str(cfg.max_num_batched_tokens),
            "max_model_len": str(engine.max_model_len), "batching_policy": cfg.batching_policy,
            "enable_chunked_prefill": str(cfg.enable_chunked_prefill).lower()}


class _SSEResponse(StreamingResponse):
    """A streamed response that aborts its requests however the stream ends (client gone,
    server shutting down), not only when the generator gets to run its ``finally``."""

    def __init__(self, content, gen: Generation) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()


async def _wait_disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _unless_disconnect(request: Request, gen: Generation, coro):
    """``await coro``, or None when the client left first (its requests are aborted)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        gen.abort()
        return None
    finally:
        for t in (work, watch):
            t.cancel()


async def _prepare(ctx: ServerContext, request: Request, prepare, body) -> Generation:
    """Take a place under the caller's tenant limits (429 past them), then ``prepare`` the
    body (``serving.prepare_*``); the place goes back if that fails."""
    lease = ctx.admit_tenant(request)
    try:
        return await prepare(ctx, body, time.monotonic(), lease)
    except BaseException:
        lease.release()
        raise


async def _respond(request: Request, gen: Generation, body, stream_fn, response_fn):
    gen.start()
    gone = Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    if body.stream:
        # Headers wait for the first token, so a request shed or refused before it gets a
        # 503/4xx status, not a 200 stream carrying an error event.
        try:
            if await _unless_disconnect(request, gen, gen.first_delta()) is None:
                return gone
        except BaseException:
            gen.abort()
            raise
        return _SSEResponse(stream_fn(gen, body), gen)
    finals = await _unless_disconnect(request, gen, gen.collect())
    if finals is None:
        return gone
    return JSONResponse(response_fn(gen, body, finals))



def _v1_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", operation_id="list_models", response_model=None,
                responses={200: {"model": R.ModelList}, **R.errors(401)})
    async def models() -> dict:
        """OpenAI's model list: the served names."""
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "inflight",
             "root": ctx.model_name, "max_model_len": ctx.engine.max_model_len}
            for name in ctx.model_names]}

    @router.get("/models/{model_id:path}", operation_id="retrieve_model", response_model=None,
                responses={200: {"model": R.ModelCard}, **R.errors(401, 404)})
    async def model(model_id: str) -> dict:
        """OpenAI's model retrieval: one served name, else 404 ``model_not_found``."""
        ctx.check_model(model_id)
        return {"id": model_id, "object": "model", "created": int(time.time()),
                "owned_by": "inflight", "root": ctx.model_name,
                "max_model_len": ctx.engine.max_model_len}

    @router.post("/completions", operation_id="create_completion", response_model=None, responses={
        **R.streamed(R.CompletionResponse, "the completion, or its chunks as events"),
        **R.errors(400, 401, 404, 413, 500, 503)})
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's legacy completions (https://platform.openai.com/docs/api-reference/completions)."""
        gen = await _prepare(ctx, request, serving.prepare_completion, body)
        return await _respond(request, gen, body, serving.stream_completion,
                              serving.completion_response)

    @router.post("/chat/completions", operation_id="create_chat_completion", response_model=None,
                 responses={
        **R.streamed(R.ChatCompletionResponse, "the completion, or its chunks as events"),
        **R.errors(400, 401, 404, 413, 500, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI's chat completions (https://platform.openai.com/docs/api-reference/chat)."""
        gen = await _prepare(ctx, request, serving.prepare_chat, body)
        return await _respond(request, gen, body, serving.stream_chat, serving.chat_response)

    return router


def _admin_router(ctx: ServerContext) -> APIRouter:
    """Routes that change engine state; they need the API key when one is set (``_ADMIN_PATHS``)."""
    router = APIRouter()

    @router.post("/reset_prefix_cache", response_model=None, responses={
        200: {"model": R.ResetPrefixCacheResponse}, **R.errors(401, 503)})
    async def reset_prefix_cache() -> dict:
        """Drop every cached KV block no running request holds (vLLM's route), so a
        benchmark can start cold. Returns how many blocks were dropped."""
        return {"num_dropped_blocks": await ctx.engine.reset_prefix_cache()}

    return router


def _ops_router(ctx: ServerContext, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    async def health() -> Response:
        """200 while the engine takes requests; 503 while it drains for shutdown or once
        its loop stopped (crash), so a load balancer takes this replica out."""
        if ctx.engine.is_accepting:
            return JSONResponse({})
        why = "the server is shutting down" if ctx.engine.is_running else "the engine is not running"
        raise OpenAIError(503, why, code="server_unavailable")

    health_doc = {200: {"model": R.Health}, **R.errors(503)}
    router.add_api_route("/health", health, methods=["GET"], operation_id="health",
                         response_model=None, responses=health_doc)
    router.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head",
                         response_model=None, responses=health_doc)

    async def prometheus() -> Response:
        """Prometheus text exposition (``inflight:*`` metrics, each labelled ``model_name``).
        ``HEAD`` answers the same headers without the body (load generators such as AIPerf
        probe with it)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    metrics_doc: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition format 0.0.4"}}
    router.add_api_route("/metrics", prometheus, methods=["GET"], operation_id="metrics",
                         response_class=PlainTextResponse, responses=metrics_doc)
    router.add_api_route("/metrics", prometheus, methods=["HEAD"], operation_id="metrics_head",
                         response_class=PlainTextResponse, responses=metrics_doc)

    @router.get("/version", response_model=None, responses={200: {"model": R.Version}})
    async def version() -> dict:
        """vLLM's ``/version``: this package's version."""
        return {"version": _version()}

    @router.get("/stats", response_model=None, responses={200: {"model": R.Stats}})
    async def stats() -> dict:
        """p50/p95/p99 of TTFT, ITL and E2E over the recent window, plus engine gauges."""
        return metrics.stats()

    @router.post("/tokenize", response_model=None, responses={
        200: {"model": R.TokenizeResponse}, **R.errors(400, 404, 413, 500)})
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's ``/tokenize``: a prompt, or messages through the chat template."""
        ctx.check_model(body.model)
        tok = ctx.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await encode(ctx, body.prompt, "prompt", add_special)
        else:
            messages = serving.render_messages(body.messages)
            text = await serving.render_chat(ctx, messages, body.add_generation_prompt)
            ids = await encode(ctx, text, "messages", bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}

    @router.post("/detokenize", response_model=None, responses={
        200: {"model": R.DetokenizeResponse}, **R.errors(400, 404, 413)})
    async def detokenize(body: DetokenizeRequest) -> dict:
        """vLLM's ``/detokenize``: token ids to text."""
        ctx.check_model(body.model)
        vocab = ctx.engine.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: id {bad} is outside the vocabulary [0, {vocab})",
                              param="tokens")
        return {"prompt": await asyncio.to_thread(ctx.engine.tokenizer.decode, body.tokens)}

    return router


# --- inflight serve -----------------------------------------------------------------------
def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``inflight serve`` (server flags plus every engine flag) to ``subparsers``."""
    from inflight.config import DEFAULT_MAX_STEP_TIME, DEFAULT_OVERLOAD_TTFT, EngineConfig

    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    add_tenant_args(p)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use in 'model' (default: the --model argument, or the "
                        "bundled model's name)")
    p.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING,
                   help="sequences allowed to wait for admission; past it requests get 503 "
                        "with Retry-After (default %(default)s)")
    p.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="tokens a request generates when it sets no max_tokens (chat, or a "
                        "completion with max_tokens null; a completion that leaves it out "
                        "keeps OpenAI's 16); default: what max_model_len leaves, as vLLM")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default %(default)s)")
    p.add_argument("--stats-window", type=float, default=60.0,
                   help="seconds of the latency percentile window of /stats (default %(default)s)")
    p.add_argument("--stats-log-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy; 0 disables (default %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before "
                        "they are aborted (default %(default)s)")
    p.add_argument("--watchdog-timeout", type=float, default=None, metavar="S",
                   help="seconds one engine step may run before the engine is declared dead: "
                        "/health answers 503, requests in flight get an error, the process "
                        "exits with status %d for its supervisor to restart (SGLang's flag); "
                        "default: 20 x the predicted full-budget step, at least 60 s; 0: off"
                        % EXIT_ENGINE_DEAD)
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log every HTTP request")
    p.add_argument("--step-log", metavar="FILE.jsonl",
                   help="write every engine step's shape and time here, to fit a simulator profile "
                        "from real serving (`inflight profile --from-step-log`)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) to use instead "
                        "of the model's, e.g. one that renders tools (vLLM's flag)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="how replies are parsed into tool calls for tool_choice auto: hermes "
                        "(<tool_call> JSON, Hermes / Qwen) or llama3_json (Llama 3.1+)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice auto (needs --tool-call-parser), as vLLM")
    EngineConfig.add_cli_args(p)
    # A server protects its running requests by default; the engine (offline batches) not.
    p.set_defaults(overload_ttft=DEFAULT_OVERLOAD_TTFT,
                   max_step_time=DEFAULT_MAX_STEP_TIME)
    return p


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


def _bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a taken port or a bad address
    fails in a second, not after start-up. Raises ``ValueError`` saying which."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def default_model_name(model: str | None) -> str:
    """vLLM reports the ``--model`` argument; for the bundled GGUF, its model name."""
    if model is not None:
        return model
    from inflight.model.bundled import find_bundled_model
    return find_bundled_model().name.split(".")[0]


# After the drain: how long aborts get to land (one engine step), then how long connections
# get to deliver their last bytes before uvicorn closes them. Together under a second.
_ABORT_WAIT_S = 0.3
_CLOSE_GRACE_S = 0.5


class _Server(uvicorn.Server):
    """uvicorn's server with a drain in front of its graceful shutdown.

    On SIGINT/SIGTERM the socket stays open for up to ``grace_s``: requests in flight run
    on, new ones get 503 (``server_unavailable``) and ``/health`` 503, instead of a refused
    connection. Requests still running then are cut, and their clients hear it as an error
    (a 503 with ``Retry-After``, or an error event and ``[DONE]`` on a stream whose 200 went
    out), never as a success; the log says how many finished and how many were aborted. uvicorn then closes the socket and connections (``_CLOSE_GRACE_S`` for their
    last bytes). The process exits within about ``grace_s + 1`` s.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s
        self.exit_code = 0

    def engine_died(self, reason: str) -> None:
        """``AsyncEngine.on_dead``: stop serving and exit ``EXIT_ENGINE_DEAD``. The requests
        in flight already got their errors; uvicorn's shutdown gives them
        ``_CLOSE_GRACE_S`` to go out. Any thread may call it (uvicorn polls the flag)."""
        logger.critical("engine dead (%s); shutting down with exit status %d", reason, EXIT_ENGINE_DEAD)
        self.exit_code = EXIT_ENGINE_DEAD
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        engine = self._engine
        engine.drain()
        start, in_flight = time.monotonic(), engine.num_in_flight
        if in_flight:
            logger.info("shutting down: %d requests in flight get %.1f s to finish",
                        in_flight, self._grace_s)
        while engine.num_in_flight and time.monotonic() - start < self._grace_s:
            await asyncio.sleep(0.02)
        left = engine.num_in_flight
        if left:
            engine.abort_all()
            # The aborts land after the engine's current step; their final outputs go out
            # before uvicorn starts closing connections.
            deadline = time.monotonic() + _ABORT_WAIT_S
            while engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        logger.info("shutdown: %d requests finished during the %.1f s drain, %d aborted",
                    max(0, in_flight - left), time.monotonic() - start, left)
        await super().shutdown(sockets)


def build_engine_off_main_thread(build: Callable[[], Any]) -> Any:
    """``build()`` run on a short-lived thread, its result returned (its exception raised).

    Loading the model runs PyTorch's first parallel ops, and libgomp keeps the thread team
    of the thread that ran them for the life of that thread. Built on the main thread (the
    event loop's, alive for ever), that team stayed, and every step on the engine thread
    then ran 3-4x slower on this 2-core machine (8 decode rows: 55-60 ms offline, 175-260 ms
    on the engine thread; docs/simulator.md). A helper thread takes its team with it.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["engine"] = build()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e
    t = threading.Thread(target=run, name="inflight-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


def load_chat_template(arg: str) -> str:
    """``--chat-template``: a file's text, or the argument itself when it holds Jinja
    (vLLM's rule). Raises ``FileNotFoundError`` for a path that is neither."""
    path = pathlib.Path(arg)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in arg or "{%" in arg:
        return arg
    raise FileNotFoundError(f"chat_template: no such file: {arg}")


def run_serve(args: argparse.Namespace) -> int:
    """``inflight serve``: load the engine, serve until SIGINT/SIGTERM, exit 0; exit
    ``EXIT_ENGINE_DEAD`` (70) when the engine died (the step watchdog, a crashed loop).

    Raises ``ValueError`` for a bad engine flag and ``FileNotFoundError`` for a missing
    model (the CLI prints them).
    """
    from inflight.config import EngineConfig
    from inflight.engine import Engine

    config = EngineConfig.from_cli_args(args)
    if args.max_num_waiting < 0:
        raise ValueError(f"max_num_waiting: must be >= 0, got {args.max_num_waiting}")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ValueError(f"max_tokens_default: must be >= 1, got {args.max_tokens_default}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")
    template = load_chat_template(args.chat_template) if args.chat_template else None
    tenants = TenantSettings.from_cli_args(args, os.environ.get(API_KEY_ENV))
    names = args.served_model_name or [default_model_name(config.model)]
    sock = _bind_socket(args.host, args.port)
    core = build_engine_off_main_thread(lambda: Engine(config))
    if template is not None:
        from inflight.tokenizer import check_chat_template

        core.tokenizer.chat_template = template
        check_chat_template(core.tokenizer, args.chat_template)  # refuse an unsafe one
    engine = AsyncEngine(core, max_num_waiting=args.max_num_waiting,
                         log_interval_s=args.stats_log_interval,
                         watchdog_timeout_s=args.watchdog_timeout, watchdog_backstop=True)
    step_log = None
    if args.step_log:
        from inflight.sim.steplog import StepLog
        step_log = StepLog(args.step_log, engine, args.max_num_waiting)
        engine.listeners.append(step_log)
    app = build_app(engine, model_names=names, tenants=tenants,
                    max_body_bytes=args.max_request_body_bytes, stats_window_s=args.stats_window,
                    tool_call_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    max_tokens_default=args.max_tokens_default)
    log_level = getattr(args, "log_level", "info").lower()
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                               access_log=args.access_log, lifespan="on",
                               # typed int, but uvicorn hands it to asyncio.wait_for
                               timeout_graceful_shutdown=_CLOSE_GRACE_S)  # type: ignore[arg-type]
    server = _Server(uv_config, engine, args.shutdown_timeout)
    engine.on_dead.append(server.engine_died)
    logger.info("serving %s on http://%s:%d (%s)", names[0], args.host, args.port,
                describe_tenants(tenants))
    # uvicorn re-raises the signal it shut down on once it has restored the previous
    # handlers; a no-op handler here turns that into a clean return (exit status 0).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
        if step_log is not None:
            step_log.close()
    return server.exit_code or (0 if server.started else 1)
