"""LoRA adapters at the HTTP edge: their ``/v1/models`` cards, vLLM's runtime
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, and their metrics gauge.

A request picks an adapter by naming it as its ``model`` (``ServerContext.check_model``
resolves the name into ``RequestOptions.lora_name`` on every route); the adapters are read
from the engine client at request time, so a runtime load shows up at once. Shapes and
rules follow vLLM's OpenAI server (``vllm/entrypoints/openai/serving_models.py``,
https://docs.vllm.ai/en/latest/features/lora.html):

- ``/v1/models`` lists each adapter after the served names, ``root`` its path and
  ``parent`` its ``base_model_name`` or the first served name.
- The load and unload routes exist only when LoRA is on (``--enable-lora``) and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or ``INFLIGHT_ALLOW_RUNTIME_LORA_UPDATING`` is
  ``1`` / ``true`` when the app is built; they are under ``/v1``, so behind ``--api-key``.
  Success is vLLM's plain text; a bad adapter or a taken name is 400, unloading an
  unknown name 404.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from inflight.errors import EngineError
from inflight.server import responses as R
from inflight.server.error_responses import OpenAIError, bad_request, to_openai
from inflight.server.generation import ServerContext, model_not_found
from inflight.server.lora_metrics import LoRAInfoCollector
from inflight.server.protocol import NonEmptyStr

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "INFLIGHT_ALLOW_RUNTIME_LORA_UPDATING")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body: the adapter's name and PEFT directory."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (its ``lora_int_id`` is ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: NonEmptyStr


def runtime_lora_updating() -> bool:
    """Whether an env var of ``RUNTIME_LORA_ENV`` is ``1`` or ``true`` (any case), vLLM's
    reading of ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""
    return any(os.environ.get(v, "0").strip().lower() in ("1", "true") for v in RUNTIME_LORA_ENV)


def model_cards(ctx: ServerContext) -> list[dict[str, Any]]:
    """``/v1/models``' ``data``: each served name (``parent`` None), then each adapter
    served now (``root`` its path, ``parent`` its base model or the first served name)."""
    created = int(time.time())

    def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "inflight",
                "root": root, "parent": parent, "max_model_len": ctx.engine.max_model_len}
    return ([card(name, ctx.model_name, None) for name in ctx.model_names]
            + [card(m.name, m.path, m.base_model_name or ctx.model_name)
               for m in ctx.lora_modules()])


def model_card(ctx: ServerContext, model_id: str) -> dict[str, Any]:
    """``/v1/models/{model_id}``: the card of a served name or adapter, else 404
    ``model_not_found``."""
    card = next((c for c in model_cards(ctx) if c["id"] == model_id), None)
    if card is None:
        raise model_not_found(model_id)
    return card


def install_lora(app: FastAPI, ctx: ServerContext) -> None:
    """With LoRA on: the ``inflight:lora_requests_info`` gauge, and the runtime load and
    unload routes when ``runtime_lora_updating()``. Nothing with LoRA off.

    Raises:
        ValueError: an adapter named like a served model (it could never be reached).
    """
    lora = ctx.engine.config.lora_config
    if lora is None:
        return
    shadowed = sorted({m.name for m in ctx.lora_modules()} & set(ctx.model_names))
    if shadowed:  # a request could never reach the adapter
        raise ValueError(f"lora_modules: adapter name(s) {', '.join(shadowed)} are also "
                         "served model names (--served-model-name); rename the adapter")
    ctx.metrics.registry.register(LoRAInfoCollector(ctx.engine, ctx.metrics.model_name))
    if runtime_lora_updating():
        logger.warning("runtime LoRA loading is on (%s): any client allowed on /v1 (one "
                       "holding the key, with --api-key) can make the server read adapter "
                       "files from its disk",
                       " / ".join(RUNTIME_LORA_ENV))
        app.include_router(lora_admin_router(ctx))


_TEXT_200: dict[int | str, dict[str, Any]] = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                   "description": "vLLM's plain-text success message"}}


def lora_admin_router(ctx: ServerContext) -> APIRouter:
    """vLLM's runtime adapter routes; under ``/v1``, so behind ``--api-key``."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter", operation_id="load_lora_adapter",
                 response_class=PlainTextResponse, responses={**_TEXT_200,
                                                              **R.errors(400, 401, 503)})
    async def load(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load the PEFT adapter at ``lora_path`` (a directory on the server) as
        ``lora_name``; requests may name it as their ``model`` at once."""
        name = body.lora_name
        if name in ctx.model_names:
            raise bad_request(f"lora_name: {name!r} is a served model name; pick another",
                              param="lora_name")
        taken = any(m.name == name for m in ctx.lora_modules())
        try:
            await ctx.engine.add_lora(name, body.lora_path)
        except EngineError as e:
            raise to_openai(e) from None
        except ValueError as e:  # LoRAError: the message names the adapter and the problem
            raise bad_request(str(e), param="lora_name" if taken else "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/unload_lora_adapter", operation_id="unload_lora_adapter",
                 response_class=PlainTextResponse, responses={**_TEXT_200,
                                                              **R.errors(400, 401, 404, 503)})
    async def unload(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Unload adapter ``lora_name``: new requests naming it get 404, those in flight
        finish with it."""
        try:
            removed = await ctx.engine.remove_lora(body.lora_name)
        except EngineError as e:
            raise to_openai(e) from None
        if not removed:
            raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                              param="lora_name", code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
