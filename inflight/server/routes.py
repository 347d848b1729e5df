"""The HTTP routes: OpenAI's ``/v1`` API, the operations routes, the admin routes.

Generation routes only validate, tokenize (in a worker thread) and wait on their
requests' streams; a client that disconnects aborts its requests at once, streamed or
not (``_unless_disconnect``, ``_SSEResponse``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from inflight.outputs import RequestOutput
from inflight.server import responses as R
from inflight.server import serving
from inflight.server.embeddings_api import EmbeddingList, EmbeddingRequest
from inflight.server.embeddings_serving import Embedder
from inflight.server.error_responses import OpenAIError, bad_request
from inflight.server.generation import Generation, ServerContext, encode
from inflight.server.lora_routes import model_card, model_cards
from inflight.server.metrics import ServerMetrics
from inflight.server.openapi import package_version
from inflight.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeRequest)
from inflight.server.responses_api import ResponseObject, ResponsesRequest
from inflight.server.responses_serving import (ResponsesCall, prepare_responses,
                                               response_body)
from inflight.server.responses_stream import stream_response
from inflight.server.tenants import TenantLease

# Routes behind --api-key: the OpenAI API and what changes engine state. /health, /metrics,
# /stats and /tokenize stay open, as in vLLM.
_ADMIN_PATHS = ("/reset_prefix_cache",)


def needs_key(path: str) -> bool:
    """Whether ``path`` is behind ``--api-key``."""
    return path == "/v1" or path.startswith("/v1/") or path in _ADMIN_PATHS


class _Body(Protocol):
    stream: bool


Prepare = Callable[[ServerContext, Any, float, TenantLease], Awaitable[Generation]]
StreamFn = Callable[[Generation, Any], AsyncIterator[str]]
ResponseFn = Callable[[Generation, Any, list[RequestOutput]], dict[str, Any]]


class _SSEResponse(StreamingResponse):
    """A streamed response that aborts its requests however the stream ends (client gone,
    server shutting down), not only when the generator gets to run its ``finally``."""

    def __init__(self, content: AsyncIterator[str], gen: Generation) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()


async def _wait_disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _unless_disconnect(request: Request, gen: Generation,
                             coro: Awaitable[Any]) -> Any:
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


async def _prepare(ctx: ServerContext, request: Request, prepare: Prepare,
                   body: Any) -> Generation:
    """Take a place under the caller's tenant limits (429 past them), then ``prepare`` the
    body (``serving.prepare_*``); the place goes back if that fails."""
    lease = ctx.admit_tenant(request)
    try:
        return await prepare(ctx, body, time.monotonic(), lease)
    except BaseException:
        lease.release()
        raise


async def _respond(request: Request, gen: Generation, body: _Body, stream_fn: StreamFn,
                   response_fn: ResponseFn) -> Response:
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


def v1_router(ctx: ServerContext, pooling: str = "last") -> APIRouter:
    """OpenAI's API: models, completions, chat completions, responses, embeddings
    (``pooling``: ``--pooling``, ``embeddings_serving.Embedder``)."""
    router = APIRouter(prefix="/v1")

    @router.get("/models", operation_id="list_models", response_model=None,
                responses={200: {"model": R.ModelList}, **R.errors(401)})
    async def models() -> dict[str, Any]:
        """OpenAI's model list: the served names, then the LoRA adapters (vLLM's)."""
        return {"object": "list", "data": model_cards(ctx)}

    @router.get("/models/{model_id:path}", operation_id="retrieve_model", response_model=None,
                responses={200: {"model": R.ModelCard}, **R.errors(401, 404)})
    async def model(model_id: str) -> dict[str, Any]:
        """OpenAI's model retrieval: a served name or adapter, else 404 ``model_not_found``."""
        return model_card(ctx, model_id)

    @router.post("/completions", operation_id="create_completion", response_model=None, responses={
        **R.streamed(R.CompletionResponse, "the completion, or its chunks as events"),
        **R.errors(400, 401, 404, 413, 500, 503)})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI's legacy completions (https://platform.openai.com/docs/api-reference/completions)."""
        gen = await _prepare(ctx, request, serving.prepare_completion, body)
        return await _respond(request, gen, body, serving.stream_completion,
                              serving.completion_response)

    @router.post("/chat/completions", operation_id="create_chat_completion", response_model=None,
                 responses={
        **R.streamed(R.ChatCompletionResponse, "the completion, or its chunks as events"),
        **R.errors(400, 401, 404, 413, 500, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions (https://platform.openai.com/docs/api-reference/chat)."""
        gen = await _prepare(ctx, request, serving.prepare_chat, body)
        return await _respond(request, gen, body, serving.stream_chat, serving.chat_response)

    @router.post("/responses", operation_id="create_response", response_model=None, responses={
        **R.streamed(ResponseObject, "the response, or its events (response.created, ..., "
                     "response.completed)"),
        **R.errors(400, 401, 404, 413, 500, 503, *((429,) if ctx.tenants.limited else ()))})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses, stateless (https://platform.openai.com/docs/api-reference/responses)."""
        call = ResponsesCall(body)
        gen = await _prepare(ctx, request, prepare_responses, call)
        return await _respond(request, gen, call, stream_response, response_body)

    _add_embeddings(router, ctx, Embedder(pooling))
    return router


def _add_embeddings(router: APIRouter, ctx: ServerContext, embedder: Embedder) -> None:
    @router.post("/embeddings", operation_id="create_embedding", response_model=None,
                 responses={200: {"model": EmbeddingList, "description": "one vector per input"},
                            **R.errors(400, 401, 404, 413, 500, 503)})
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """OpenAI's embeddings (https://platform.openai.com/docs/api-reference/embeddings):
        the pooled, L2-normalized final hidden state of each input."""
        gen = await _prepare(ctx, request, embedder.prepare, body)
        gen.start()
        finals = await _unless_disconnect(request, gen, gen.collect())
        if finals is None:
            return Response(status_code=499)  # nginx's "client closed request"
        return JSONResponse(embedder.response(gen, body, finals))


def admin_router(ctx: ServerContext) -> APIRouter:
    """Routes that change engine state; they need the API key when one is set (``needs_key``)."""
    router = APIRouter()

    @router.post("/reset_prefix_cache", response_model=None, responses={
        200: {"model": R.ResetPrefixCacheResponse}, **R.errors(401, 503)})
    async def reset_prefix_cache() -> dict[str, int]:
        """Drop every cached KV block no running request holds (vLLM's route), so a
        benchmark can start cold. Returns how many blocks were dropped."""
        return {"num_dropped_blocks": await ctx.engine.reset_prefix_cache()}

    return router


def ops_router(ctx: ServerContext, metrics: ServerMetrics) -> APIRouter:
    """Operations routes: health, metrics, version, stats, tokenize, detokenize."""
    router = APIRouter()
    _add_health(router, ctx)
    _add_metrics(router, metrics)

    @router.get("/version", response_model=None, responses={200: {"model": R.Version}})
    async def version() -> dict[str, str]:
        """vLLM's ``/version``: this package's version."""
        return {"version": package_version()}

    @router.get("/stats", response_model=None, responses={200: {"model": R.Stats}})
    async def stats() -> dict[str, Any]:
        """p50/p95/p99 of TTFT, ITL and E2E over the recent window, plus engine gauges."""
        return metrics.stats()

    _add_tokenizer_routes(router, ctx)
    return router


def _add_health(router: APIRouter, ctx: ServerContext) -> None:
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


def _add_metrics(router: APIRouter, metrics: ServerMetrics) -> None:
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


def _add_tokenizer_routes(router: APIRouter, ctx: ServerContext) -> None:
    @router.post("/tokenize", response_model=None, responses={
        200: {"model": R.TokenizeResponse}, **R.errors(400, 404, 413, 500)})
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize``: a prompt, or messages through the chat template."""
        ctx.check_model(body.model)
        tok = ctx.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await encode(ctx, body.prompt, "prompt", add_special)
        else:
            messages = serving.render_messages(body.messages or [])
            text = await serving.render_chat(ctx, messages, body.add_generation_prompt)
            ids = await encode(ctx, text, "messages", bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}

    @router.post("/detokenize", response_model=None, responses={
        200: {"model": R.DetokenizeResponse}, **R.errors(400, 404, 413)})
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's ``/detokenize``: token ids to text."""
        ctx.check_model(body.model)
        vocab = ctx.engine.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: id {bad} is outside the vocabulary [0, {vocab})",
                              param="tokens")
        return {"prompt": await asyncio.to_thread(ctx.engine.tokenizer.decode, body.tokens)}
