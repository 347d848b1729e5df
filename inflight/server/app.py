"""The OpenAI-compatible HTTP app: ``build_app`` around an ``EngineClient``.

Routes (shapes of OpenAI's API and vLLM's server,
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html; ``routes.py``):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as SSE or not),
  ``POST /v1/responses``, ``POST /v1/embeddings`` (``--pooling``),
  ``GET /v1/models``: behind ``--api-key`` when one is set (401 otherwise). With
  ``--enable-lora`` a ``model`` may name an adapter, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
  adds vLLM's ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter`` (``lora_routes.py``).
- ``GET /health`` (200 while the engine loop runs, else 503), ``GET``/``HEAD /metrics``
  (Prometheus, every series labelled ``model_name``), ``GET /stats`` (sliding-window
  latency percentiles, JSON), ``GET /version``, ``POST /tokenize``, ``POST /detokenize``
  (vLLM's).

The engine client (``engine/engine_client.py``: one in-process ``AsyncEngine``, or a Ray
``ClusterEngine``) runs the model work; routes only validate, tokenize (in a worker
thread) and wait on their request's stream. ``inflight serve`` itself is
``lifecycle.run_serve``, its flags ``serve_args.py``. See docs/server.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from inflight.engine.engine_client import EngineClient
from inflight.server.embeddings_serving import POOLING_CHOICES
from inflight.server.error_responses import install_error_handlers
from inflight.server.generation import ServerContext
from inflight.server.logprobs import TokenTexts
from inflight.server.lora_routes import install_lora
from inflight.server.metrics import ServerMetrics
from inflight.server.middleware import (AdmissionMiddleware, ApiKeyMiddleware,
                                        BodySizeLimitMiddleware)
from inflight.server.openapi import GENERATION_PATHS, openapi_document
from inflight.server.routes import admin_router, needs_key, ops_router, v1_router
from inflight.server.tenants import DEFAULT_TENANT, TenantKeys, TenantLimits, TenantSettings
from inflight.server.tool_parsers import check_tool_choice_flags

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class AppOptions:
    """How the app serves, beyond the engine (``inflight serve``'s server flags).

    Attributes:
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
        pooling: how ``/v1/embeddings`` pools a prompt's final hidden states, ``"last"``
            token or ``"mean"`` (``--pooling``; ``embeddings_serving.Embedder``).
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    stats_window_s: float = 60.0
    manage_engine: bool = True
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tenants: TenantSettings = field(default_factory=TenantSettings)
    max_tokens_default: int | None = None
    pooling: str = "last"


def build_app(engine: EngineClient, *, model_names: Sequence[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, stats_window_s: float = 60.0,
              manage_engine: bool = True, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, tenants: TenantSettings | None = None,
              max_tokens_default: int | None = None, pooling: str = "last") -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: the engine client; started by the app's lifespan (and shut down with it
            when ``manage_engine``).
        model_names: names clients may use in ``model``; the first is reported.
        api_key, max_body_bytes, stats_window_s, manage_engine, tool_call_parser,
            enable_auto_tool_choice, tenants, max_tokens_default, pooling: ``AppOptions``.

    Raises:
        ValueError: no model name, an unknown tool parser, auto tool choice without one,
            or an unknown pooling.
    """
    opts = AppOptions(api_key, max_body_bytes, stats_window_s, manage_engine,
                      tool_call_parser, enable_auto_tool_choice, tenants or TenantSettings(),
                      max_tokens_default, pooling)
    check_tool_choice_flags(opts.tool_call_parser, opts.enable_auto_tool_choice)
    if opts.pooling not in POOLING_CHOICES:
        raise ValueError(f"pooling: must be one of {POOLING_CHOICES}, got {opts.pooling!r}")
    if not model_names:
        raise ValueError("model_names: at least one name is required")
    metrics = ServerMetrics.for_client(engine, model_names[0], opts.stats_window_s)
    engine.listeners.append(metrics.on_step)
    keys = dict(opts.tenants.keys)
    if opts.api_key:
        keys.setdefault(opts.api_key, DEFAULT_TENANT)
    tenant_keys = TenantKeys(keys)
    ctx = _server_context(engine, model_names, opts, metrics, tenant_keys)
    app = FastAPI(title="inflight", summary="OpenAI-compatible LLM server",
                  lifespan=_lifespan(engine, opts.manage_engine))
    doc_names = [*model_names, *(m.name for m in ctx.lora_modules())]  # adapters at start
    app.openapi = lambda: openapi_document(  # type: ignore[method-assign]  # FastAPI's documented override
        app, engine, doc_names, rate_limited=ctx.tenants.limited)
    app.state.ctx = ctx
    install_error_handlers(app)
    # Starlette runs the middleware added last first: the key, then admission, then size.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=opts.max_body_bytes)
    app.add_middleware(AdmissionMiddleware, refusal=engine.refusal, paths=GENERATION_PATHS)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=tenant_keys, protected=needs_key)
    app.include_router(v1_router(ctx, opts.pooling))
    app.include_router(ops_router(ctx, metrics))
    app.include_router(admin_router(ctx))
    install_lora(app, ctx)
    return app


def _server_context(engine: EngineClient, model_names: Sequence[str], opts: AppOptions,
                    metrics: ServerMetrics, tenant_keys: TenantKeys) -> ServerContext:
    limits = TenantLimits(opts.tenants.max_concurrent_requests, opts.tenants.tokens_per_minute,
                          tenant_keys.names, metrics.registry, model_name=model_names[0])
    return ServerContext(engine, list(model_names), metrics, TokenTexts(engine.tokenizer),
                         opts.tool_call_parser, opts.enable_auto_tool_choice,
                         opts.max_tokens_default,
                         isolate_prefix_cache=not opts.tenants.shared_prefix_cache,
                         tenants=limits)


def _lifespan(engine: EngineClient, manage_engine: bool) -> Any:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(engine.shutdown)
    return lifespan
