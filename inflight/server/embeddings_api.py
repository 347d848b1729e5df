"""``POST /v1/embeddings``: the request body, and the response body for the OpenAPI document.

Fields follow OpenAI's embeddings reference
(https://platform.openai.com/docs/api-reference/embeddings/create) and vLLM's
``EmbeddingCompletionRequest`` (``vllm/entrypoints/openai/protocol.py``: the extra
``truncate_prompt_tokens`` and ``add_special_tokens``). ``embeddings_serving`` runs it.

Validation is strict, as for the other routes (``protocol.py``); unknown fields are ignored,
as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from inflight.server.protocol import NonEmptyStr, TokenId

# OpenAI's limit on the inputs of one call; each is one engine sequence.
MAX_INPUTS = 2048

TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: one embedding per input.

    ``input`` is a string, a list of strings, a list of token ids, or a list of token-id
    lists (none empty; at most ``MAX_INPUTS``). ``encoding_format`` ``float`` returns each
    vector as numbers, ``base64`` as its little-endian float32 bytes in base64 (what the
    ``openai`` client asks for and decodes). ``dimensions`` is taken only when it equals the
    model's hidden size: the vectors are not Matryoshka-trained, so truncating them would
    not give a usable embedding (400 otherwise). ``truncate_prompt_tokens`` (vLLM's) keeps
    each input's last k tokens (-1: as many as the context takes).
    """

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, description="a served model name; None: the first one")
    input: (NonEmptyStr
            | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_INPUTS)]
            | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, description="only the model's hidden size")] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None
    add_special_tokens: bool = True


# --- the response body, for the OpenAPI document (the route builds plain dicts) ----------
class Embedding(BaseModel):
    """One input's vector: numbers, or base64 of its little-endian float32 bytes."""

    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """The answer: ``data[i]`` is ``input[i]``'s embedding (unit L2 norm)."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
