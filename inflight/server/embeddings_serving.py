"""``POST /v1/embeddings``: a validated body -> one prefill-only engine request per input ->
OpenAI's ``list`` of ``embedding`` objects.

Each input runs as ``SamplingParams(max_tokens=0, pooling=...)``: the engine prefills it
and pools its final (normed) hidden states, the last token's or the mean over every prompt
token (``--pooling``), L2-normalized (vLLM's pooling runner for a decoder model, its
default ``LAST`` with ``normalize``). The inputs of one call are queued together into one
``Generation``, so the scheduler batches them; the call reserves one sequence per input.

``dimensions`` (OpenAI's Matryoshka truncation) is taken only when it equals the model's
hidden size. The engine client does not report that size, so it is learned from the first
vector the server computes: until then a call with ``dimensions`` runs and is refused
afterwards if the size differs, later ones are refused before they run.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Any

from inflight.errors import EngineError
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from inflight.server.embeddings_api import EmbeddingRequest
from inflight.server.error_responses import OpenAIError, bad_request, to_openai
from inflight.server.generation import (Generation, ServerContext, check_prompt_len,
                                        check_token_ids)
from inflight.server.tenants import TenantLease

POOLING_CHOICES = ("last", "mean")
# The engine's field names -> this route's, for error bodies.
_NAMES = {"prompt": "input", "max_tokens": "input", "n": "input"}


class Embedder:
    """The embeddings route's state: the server's pooling, and the hidden size once seen.

    Args:
        pooling: ``"last"`` (the last prompt token's hidden state) or ``"mean"`` (the mean
            over every prompt token), the ``--pooling`` flag.

    Raises:
        ValueError: another ``pooling``.
    """

    def __init__(self, pooling: str = "last") -> None:
        if pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling: must be one of {POOLING_CHOICES}, got {pooling!r}")
        self.pooling = pooling
        self.hidden_size: int | None = None  # learned from the first vector

    async def prepare(self, ctx: ServerContext, req: EmbeddingRequest, arrival_time: float,
                      tenant: TenantLease | None = None) -> Generation:
        """Validate and tokenize a body into its ``Generation`` (one request per input, not
        started); ``tenant`` as in ``serving.prepare_completion``.

        Raises:
            OpenAIError: 404 for an unknown model; 400 naming the field for ``dimensions``
                other than the hidden size, an empty input, a token id outside the
                vocabulary, an input longer than the context; 503 when the engine has no
                room for the inputs now.
        """
        lora_name = ctx.check_model(req.model)  # the LoRA adapter ``model`` names, or None
        if req.dimensions is not None and self.hidden_size is not None:
            self.check_dimensions(req.dimensions, self.hidden_size)
        raw = _inputs(req)
        try:  # generation.reserve, with the refusal naming ``input``
            reservation = ctx.engine.reserve(len(raw))
        except EngineError as e:
            raise to_openai(e, _NAMES) from None
        try:
            prompts = await _tokenize(ctx, req, raw)
            params = [SamplingParams(max_tokens=check_prompt_len(ctx.engine, len(ids), 0, _NAMES),
                                     pooling=self.pooling) for ids in prompts]
            return Generation(ctx, f"embd-{uuid.uuid4().hex}", prompts, params, arrival_time,
                              reservation, _options(ctx, tenant, lora_name), _NAMES, stream=False,
                              tenant=tenant)
        except BaseException:  # a 400 after admission, or the client gone: free the places
            reservation.release()
            raise

    @staticmethod
    def check_dimensions(dimensions: int, hidden_size: int) -> None:
        """400 naming ``dimensions`` unless it is the hidden size."""
        if dimensions != hidden_size:
            raise bad_request(
                f"dimensions: {dimensions} is not supported: this model's embeddings have "
                f"{hidden_size} dimensions and are not trained to be truncated (Matryoshka); "
                f"send {hidden_size} or leave it out", param="dimensions")

    def response(self, gen: Generation, req: EmbeddingRequest,
                 finals: list[RequestOutput]) -> dict[str, Any]:
        """OpenAI's ``list`` of ``embedding`` objects, ``data[i]`` for input ``i``.

        Raises:
            OpenAIError: 400 for ``dimensions`` other than the vectors' size (learned here
                when not yet known); 500 when the engine returned no embedding.
        """
        vectors = [_embedding(out) for out in finals]
        if self.hidden_size is None:
            self.hidden_size = len(vectors[0])
        if req.dimensions is not None:
            self.check_dimensions(req.dimensions, len(vectors[0]))
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_base64(v) if req.encoding_format == "base64" else v}
                for i, v in enumerate(vectors)]
        n = gen.num_prompt_tokens
        return {"id": gen.request_id, "object": "list", "created": gen.created,
                "model": gen.model_name, "data": data,
                "usage": {"prompt_tokens": n, "total_tokens": n}}


def encode_base64(vector: list[float]) -> str:
    """``vector`` as little-endian float32 bytes in base64: what OpenAI sends for
    ``encoding_format: "base64"`` and its client decodes (``np.frombuffer(..., float32)``)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _inputs(req: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The body's inputs as a list: texts, or token-id lists."""
    inp = req.input
    if isinstance(inp, str):
        return [inp]
    if isinstance(inp[0], int):
        return [[int(t) for t in inp]]
    return inp


async def _tokenize(ctx: ServerContext, req: EmbeddingRequest,
                    raw: list[str] | list[list[int]]) -> list[list[int]]:
    """Token ids per input (texts in one worker-thread call), truncated to the last
    ``truncate_prompt_tokens``; 400 naming ``input`` for an id outside the vocabulary,
    text the tokenizer refuses, or an input that comes out empty."""
    texts = [p for p in raw if isinstance(p, str)]
    encoded = iter(await asyncio.to_thread(_encode_all, ctx, texts, req.add_special_tokens)
                   if texts else [])
    prompts = []
    for p in raw:
        if isinstance(p, str):
            ids = next(encoded)
        else:
            check_token_ids(ctx, p, "input")
            ids = list(p)
        k = req.truncate_prompt_tokens
        if k is not None:
            ids = ids[-(ctx.engine.max_model_len - 1 if k == -1 else k):]
        if not ids:
            raise bad_request("input: must not be empty (it has no tokens)", param="input")
        prompts.append(ids)
    return prompts


def _encode_all(ctx: ServerContext, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    tok = ctx.engine.tokenizer
    out = []
    for text in texts:
        try:
            out.append(tok.encode(text, add_special_tokens))
        except ValueError as e:
            raise bad_request(f"input: {e}", param="input") from None
    return out


def _options(ctx: ServerContext, tenant: TenantLease | None,
             lora_name: str | None = None) -> RequestOptions:
    """The call's tenant, and its prefix-cache salt when tenants are isolated (the rule of
    ``ServerContext.options``, for a body without scheduling fields)."""
    name = tenant.name if tenant is not None else None
    salt = f"tenant={name}" if ctx.isolate_prefix_cache and name is not None else None
    return RequestOptions(tenant=name, cache_salt=salt, lora_name=lora_name)


def _embedding(out: RequestOutput) -> list[float]:
    if out.embedding is None:
        raise OpenAIError(500, f"the engine returned no embedding for {out.request_id}",
                          code="engine_error")
    return out.embedding
