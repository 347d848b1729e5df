"""The engine requests behind one API call, and the checks they pass first.

Everything the engine would refuse is refused here, with a 400 naming the API field:
token ids outside the vocabulary, sampling values ``SamplingParams`` rejects, and what the
engine's one prompt-fit rule refuses (``EngineClient.check_prompt_fits``:
``prompt + max_tokens > max_model_len``, vLLM's rule, an absent ``max_tokens`` becoming
``max_model_len - prompt_len``; prompts the KV cache or the step budget can never hold).
Engine errors become responses in one place, ``errors.to_openai``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry

from inflight.engine import inputs
from inflight.engine.admission import Reservation
from inflight.engine.engine_client import EngineClient
from inflight.engine.stream import RequestStream, merge_outputs
from inflight.errors import EngineError
from inflight.lora.lora_config import LoRAModule
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from inflight.server.error_responses import OpenAIError, bad_request, from_value_error, to_openai
from inflight.server.logprobs import TokenTexts
from inflight.server.metrics import ServerMetrics
from inflight.server.protocol import SamplingRequest
from inflight.server.tenants import DEFAULT_TENANT, TenantLease, TenantLimits
from inflight.structured_output import StructuredOutputsParams


@dataclass
class ServerContext:
    """What the routes share: the engine, the served names, metrics, token texts."""

    engine: EngineClient
    model_names: list[str]
    metrics: ServerMetrics
    token_texts: TokenTexts
    tool_call_parser: str | None = None  # --tool-call-parser (server/tool_parsers.py)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    max_tokens_default: int | None = None  # --max-tokens-default
    # Per-tenant prefix caches (server/tenants.py): each tenant's requests are salted.
    isolate_prefix_cache: bool = False
    # Per-tenant limits and series (build_app passes the server's; this default: none).
    tenants: TenantLimits = field(
        default_factory=lambda: TenantLimits(None, None, (), CollectorRegistry()))

    def admit_tenant(self, request: Any) -> TenantLease:
        """A place for one call of the tenant the API key middleware found for ``request``
        (a Starlette request; no key: ``default``), else 429 (``TenantLimits.admit``)."""
        return self.tenants.admit(request.scope.get("state", {}).get("tenant", DEFAULT_TENANT))

    def default_max_tokens(self, max_tokens: int | None, prompt_len: int) -> int | None:
        """``max_tokens`` as the body gave it, or ``--max-tokens-default`` when it gave none
        (lowered to what ``max_model_len`` leaves; None: that room, as vLLM)."""
        if max_tokens is not None or self.max_tokens_default is None:
            return max_tokens
        return max(1, min(self.max_tokens_default, self.engine.max_model_len - prompt_len))

    def options(self, req: SamplingRequest, tenant: TenantLease | None) -> RequestOptions:
        """The scheduler's fields of ``req`` with its tenant; the prefix-cache salt is the
        body's ``cache_salt``, joined to the tenant's name when tenants are isolated."""
        name = tenant.name if tenant is not None else None
        salt = req.cache_salt
        if self.isolate_prefix_cache and name is not None:
            salt = f"tenant={name}" + ("" if salt is None else f"\0{salt}")
        return replace(req.options(), tenant=name, cache_salt=salt,
                       lora_name=self.check_model(req.model))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def lora_modules(self) -> list[LoRAModule]:
        """The LoRA adapters the engine serves now (runtime loads included); none with
        LoRA off."""
        return [] if self.engine.config.lora_config is None else self.engine.lora_modules()

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` picks (its ``RequestOptions.lora_name``):
        None for None or a served name (which wins over an adapter of the same name, as in
        vLLM), else the adapter's name. Raises 404 ``model_not_found`` for another name."""
        if name is None or name in self.model_names:
            return None
        if any(m.name == name for m in self.lora_modules()):
            return name
        raise model_not_found(name)


def model_not_found(name: str) -> OpenAIError:
    """OpenAI's 404 for a ``model`` that is neither a served name nor an adapter."""
    return OpenAIError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")


def check_prompt_len(engine: EngineClient, n: int, max_tokens: int | None,
                     param_names: dict[str, str] | None = None) -> int:
    """The engine's prompt-fit rule for ``n`` prompt tokens and ``max_tokens``; returns
    ``max_tokens`` (defaulted to ``max_model_len - n``), else a 400 naming the API field
    (``param_names`` maps ``prompt`` / ``max_tokens`` to the route's names)."""
    try:
        return engine.check_prompt_fits(n, max_tokens)
    except EngineError as e:
        raise to_openai(e, param_names) from None


def build_sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                          param_names: dict[str, str] | None = None, *, n: int | None = None,
                          prompt_logprobs: int | None = None,
                          structured_outputs: StructuredOutputsParams | None = None
                          ) -> SamplingParams:
    """``SamplingParams`` from the body; a bad value is a 400 naming the API field.
    ``n`` (sequences to generate: ``best_of``) and ``prompt_logprobs`` (``echo``) default
    to the body's."""
    try:
        return SamplingParams(
            n=req.n if n is None else n,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logit_bias=({int(t): b for t, b in req.logit_bias.items()}
                        if req.logit_bias else None),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, structured_outputs=structured_outputs)
    except ValueError as e:
        raise from_value_error(e, param_names) from None


def check_common(ctx: ServerContext, req: SamplingRequest) -> None:
    ctx.check_model(req.model)
    for name in req.unsupported_fields():
        raise bad_request(f"{name} is not supported", param=name)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true",
                          param="stream_options")
    if req.stop_token_ids:
        check_token_ids(ctx, req.stop_token_ids, "stop_token_ids")
    if req.logit_bias:
        check_logit_bias(ctx, req.logit_bias)
    if req.stream and req.prompt_logprobs:  # vLLM's rule: a stream has no place for them
        raise bad_request("prompt_logprobs are not available when stream=true",
                          param="prompt_logprobs")
    try:
        cfg = ctx.engine.config
        req.options().check_policy(cfg.scheduling_policy, cfg.overload_ttft is not None)
    except ValueError as e:
        raise from_value_error(e) from None


def check_logit_bias(ctx: ServerContext, bias: dict[str, float]) -> None:
    """400 for a ``logit_bias`` key that is not a token id of the vocabulary (OpenAI's
    keys are token ids as decimal strings; the bias range is the model's check)."""
    ids = []
    for key in bias:
        if not key.isascii() or not key.isdecimal():
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}",
                              param="logit_bias")
        ids.append(int(key))
    check_token_ids(ctx, ids, "logit_bias")


def reserve(ctx: ServerContext, num_seqs: int) -> Reservation:
    """Admit ``num_seqs`` sequences now (``EngineClient.reserve``), else 503 (400 for a call
    that could never fit): asked after the body's cheap checks and before templating and
    tokenizing, so a refused request never waits behind accepted ones' work. The caller
    releases the reservation if it gives up before ``Generation.start``."""
    try:
        return ctx.engine.reserve(num_seqs)
    except EngineError as e:
        raise to_openai(e) from None


async def encode(ctx: ServerContext, text: str, param: str,
                 add_special_tokens: bool = True) -> list[int]:
    """Tokenize off the event loop; text the tokenizer refuses (a lone surrogate) is a 400."""
    try:
        return await asyncio.to_thread(ctx.engine.tokenizer.encode, text, add_special_tokens)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


def check_token_ids(ctx: ServerContext, ids: Sequence[int], param: str) -> None:
    """400 naming ``param`` for an id outside the vocabulary (the engine's own check)."""
    try:
        inputs.check_token_ids(ids, ctx.engine.tokenizer.vocab_size, param)
    except EngineError as e:
        raise to_openai(e) from None


# --- one HTTP request's engine requests ---------------------------------------------------
class Generation:
    """The engine requests behind one API call (one per prompt), and their lifecycle.

    Args:
        ctx: the server context.
        request_id: the response ``id``; engine requests are ``{request_id}-{i}``.
        prompts: token ids per prompt.
        params: sampling parameters per prompt.
        arrival_time: ``time.monotonic()`` when the HTTP request arrived.
        reservation: the places ``reserve`` took for this call's sequences.
        options: priority and latency targets for every prompt's request.
        param_names: engine field names -> this route's, for error bodies.
        stream: whether the call streams; a non-streamed one asks the engine for final
            outputs only (``EngineClient.add_request(final_only=True)``).
        tenant: the call's place under its tenant's limits: charged with the prompt tokens
            at ``start`` and the generated ones as they come, released when the call ends.
    """

    def __init__(self, ctx: ServerContext, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], arrival_time: float, reservation: Reservation,
                 options: RequestOptions | None = None,
                 param_names: dict[str, str] | None = None, stream: bool = True,
                 tenant: TenantLease | None = None) -> None:
        self.ctx = ctx
        self.tenant = tenant
        self.stream = stream
        self.reservation = reservation
        self.options = options
        self.param_names = param_names
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.arrival_time = arrival_time
        self.created = int(time.time())
        self.n = params[0].n
        self.prompt_texts: list[str] = []  # per prompt, for completions' ``echo``
        self.streams: list[RequestStream] = []
        self._deltas: AsyncIterator[tuple[int, RequestOutput]] | None = None
        self._first: tuple[int, RequestOutput] | None = None

    def start(self) -> None:
        """Queue every prompt into the places ``reserve`` took for the whole call (prompts x
        ``n``); whatever fails, nothing of it stays queued and the places go back."""
        try:
            for i, (ids, p) in enumerate(zip(self.prompts, self.params)):
                self.streams.append(self.ctx.engine.add_request(
                    f"{self.request_id}-{i}", ids, p, arrival_time=self.arrival_time,
                    options=self.options, reservation=self.reservation,
                    final_only=not self.stream))
        except EngineError as e:
            self.abort()
            raise to_openai(e, self.param_names) from None
        finally:
            self.reservation.release()
        if self.tenant is not None:
            self.tenant.charge(self.num_prompt_tokens * self.n, "prompt")

    def abort(self) -> None:
        """Abort every unfinished engine request of this call, and give back its tenant's
        place (idempotent)."""
        for s in self.streams:
            s.abort()
        if self.tenant is not None:
            self.tenant.release()

    @property
    def model_name(self) -> str:
        """The answer's ``model``: the adapter the call runs with, else the first served
        name (vLLM's rule)."""
        lora = self.options.lora_name if self.options is not None else None
        return lora or self.ctx.model_name

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    async def first_delta(self) -> bool:
        """Wait for the first delta and keep it for ``deltas()``; returns True, which a
        disconnect watcher's None is told apart from.

        A stream commits to HTTP 200 with its first byte; waiting for the first delta
        first lets a request the engine sheds or refuses before its first token get a
        real status (503 + ``Retry-After``, 400, 500) instead of an error event.

        Raises:
            OpenAIError: as ``deltas()``.
        """
        self._deltas = self._produce()
        try:
            self._first = await self._deltas.__anext__()
        except StopAsyncIteration:
            self._first = None
        return True

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt_index, delta)`` as they come, all prompts interleaved.

        Raises ``OpenAIError`` when the engine refuses or fails a request (the others
        are aborted); leaving early aborts them all.
        """
        if self._first is not None:
            yield self._first
        async for item in self._deltas or self._produce():
            yield item

    async def _produce(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            if len(self.streams) == 1:
                async for out in self.streams[0]:
                    yield 0, self._charged(_checked(out))
                return
            async for item in _interleave(self.streams):
                yield item[0], self._charged(_checked(item[1]))
        except EngineError as e:
            raise to_openai(e, self.param_names) from None
        finally:
            self.abort()

    def _charged(self, out: RequestOutput) -> RequestOutput:
        if self.tenant is not None:
            self.tenant.charge(sum(len(c.token_ids) for c in out.outputs))
        return out

    async def collect(self) -> list[RequestOutput]:
        """Run to the end; the cumulative final output per prompt."""
        deltas: dict[int, list[RequestOutput]] = {}
        async for i, out in self.deltas():
            deltas.setdefault(i, []).append(out)
        return [merge_outputs(*deltas[i]) for i in range(len(self.streams))]


def _checked(out: RequestOutput) -> RequestOutput:
    failure = out.failure()
    if failure is not None:
        raise failure
    return out


async def _interleave(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    # Per stream: its outputs, then the exception that ended it or None (it ended).
    q: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:  # handed to the consumer, which raises it
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
