"""The OpenAPI document as this server behaves, and the package version it reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from inflight.engine.engine_client import EngineClient
from inflight.request import RequestOptions
from inflight.server import responses as R
from inflight.server.protocol import MAX_TOKENS_MARK, PROMPT_TEXT_MARK, TOKEN_ID_MARK

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/embeddings"})

# Per-request scheduling fields: the document keeps those the server acts on
# (RequestOptions.fields_used); the others are refused (check_policy) and left out.
_POLICY_FIELDS = ("priority", "ttft_slo", "itl_slo")
_REQUEST_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "TokenizeRequest",
                    "DetokenizeRequest", "EmbeddingRequest")


def package_version() -> str:
    """This package's version (``/version``, the document's), "0" when not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("inflight-serve")
    except PackageNotFoundError:
        return "0"


def openapi_document(app: FastAPI, client: EngineClient, model_names: Sequence[str],
                     rate_limited: bool = False) -> dict[str, Any]:
    """The OpenAPI document as this server behaves: validation failures are 400 (FastAPI
    documents 422); token ids and ``max_tokens`` carry this model's bounds, a completions
    text prompt ``minLength`` 1 where ``""`` has no token (no BOS added), ``model`` the
    served names, and only the scheduling fields this server's policy acts on are listed;
    so a client, or a fuzzer, learns from it what will be accepted. Built once, cached on
    ``app``."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=package_version(), summary=app.summary,
                      routes=app.routes)
    for ops in doc["paths"].values():
        for op in ops.values():
            op["responses"].pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _bound(schemas, {TOKEN_ID_MARK: ("maximum", client.tokenizer.vocab_size - 1),
                     MAX_TOKENS_MARK: ("maximum", client.max_model_len - 1),
                     PROMPT_TEXT_MARK: ("minLength", 0 if client.tokenizer.encode("") else 1)})
    _name_models(doc, schemas, model_names)
    used = RequestOptions.fields_used(client.config.scheduling_policy,
                                      client.config.overload_ttft is not None)
    for field in [f for f in _POLICY_FIELDS if f not in used]:
        for name in _REQUEST_SCHEMAS:
            schemas.get(name, {}).get("properties", {}).pop(field, None)
    if rate_limited:  # per-tenant limits: the generation routes may answer 429
        for path in GENERATION_PATHS:
            op = doc["paths"][path]["post"]
            op["responses"]["429"] = {
                "description": R.errors(429)[429]["description"],
                "content": op["responses"]["400"]["content"]}
    app.openapi_schema = doc
    return doc


def _bound(node: Any, bounds: dict[str, tuple[str, int]]) -> None:
    """Replace each bound mark (``protocol.TOKEN_ID_MARK``...) under ``node`` by its
    keyword and value (``maximum``, ``minLength``)."""
    if isinstance(node, dict):
        for mark, (keyword, limit) in bounds.items():
            if node.pop(mark, False):
                node[keyword] = limit
        for v in node.values():
            _bound(v, bounds)
    elif isinstance(node, list):
        for v in node:
            _bound(v, bounds)


def _name_models(doc: dict[str, Any], schemas: dict[str, Any],
                 model_names: Sequence[str]) -> None:
    """``model`` fields and ``model_id`` parameters: one of the served names."""
    for ops in doc["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", []):
                if param.get("name") == "model_id":
                    param["schema"] = {"type": "string", "enum": list(model_names)}
    for name in _REQUEST_SCHEMAS:
        props = schemas.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"]["anyOf"] = [{"type": "string", "enum": list(model_names)},
                                       {"type": "null"}]
