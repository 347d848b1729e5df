"""Response bodies of the HTTP API, as pydantic models for the OpenAPI document.

The routes build plain dicts (cheaper per token than models); these classes say what those
dicts hold, so ``/openapi.json`` documents every status a route answers and the body it
sends, and a fuzzer (schemathesis, tests/reliability/test_fuzz.py) can hold the server to it.
Shapes follow OpenAI's references (``text_completion``, ``chat.completion``, ``model``,
https://platform.openai.com/docs/api-reference) and vLLM's ``/tokenize``, ``/detokenize``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every failure: ``{"error": {"message", "type", "param", "code"}}`` (errors.py)."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """With ``echo`` the prompt's tokens come first, the first one's entries null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's: one token's entry in ``prompt_logprobs`` (keyed by its id)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token null (the first) or {token id: entry}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs | None


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` without ``stream`` (with it: ``text/event-stream`` of
    ``text_completion`` chunks, ``data: [DONE]`` last)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    # null for a token with no context (the first prompt token): OpenAI's shape, wider than the parent's
    logprob: float | None  # type: ignore[assignment]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` without ``stream`` (with it: ``text/event-stream`` of
    ``chat.completion.chunk`` events, ``data: [DONE]`` last)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    # vLLM's: a LoRA adapter's base model (its ``--lora-modules`` base_model_name or the
    # first served name); None for a base model.
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ResetPrefixCacheResponse(BaseModel):
    num_dropped_blocks: int


class Health(BaseModel):
    """``{}`` while the engine takes requests."""


class Version(BaseModel):
    """``GET /version`` (vLLM's): the server package's version."""

    version: str


class Stats(BaseModel):
    """``GET /stats``: window percentiles (``{"count", "mean", "p50", "p95", "p99"}``) and
    engine gauges and counters; see ``ServerMetrics.stats``."""

    window_seconds: float
    time_to_first_token_seconds: dict[str, float | int | None]
    inter_token_latency_seconds: dict[str, float | int | None]
    e2e_request_latency_seconds: dict[str, float | int | None]
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route's error statuses, each with ``ErrorResponse``."""
    what = {400: "invalid request", 401: "missing or wrong API key (with --api-key)",
            404: "unknown model", 413: "request body too large",
            429: "the tenant's rate limit (with --tenant-max-concurrent-requests or "
                 "--tenant-tokens-per-minute)",
            500: "a fault inside the server", 503: "overloaded, shutting down, or shed"}
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


def streamed(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or server-sent events when ``stream`` is true."""
    return {200: {"model": model, "description": description,
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


# One server-sent event as the SSE format defines its fields (WHATWG HTML, "Server-sent
# events"): ``data`` a chunk's JSON, or ``[DONE]`` last; OpenAPI 3.2 documents a stream
# by its events, and schemathesis checks each event of a streamed response against it.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                             "id": {"type": "string"}, "retry": {"type": "integer"}}}
