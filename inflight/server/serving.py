"""Completions and chat completions: a validated body -> engine requests -> OpenAI responses.

Response shapes follow OpenAI's references (``text_completion``, ``chat.completion``,
``chat.completion.chunk``); streams are server-sent events ending with ``data: [DONE]``.
``finish_reason`` is ``stop``, ``length``, or (vLLM's) ``abort``; ``stop_reason`` (vLLM) is
the stop string or token id that ended a choice. An engine failure after the 200 headers
went out becomes an error event (``data: {"error": ...}``) before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from inflight.outputs import CompletionOutput, RequestOutput
from inflight.server.error_responses import OpenAIError, bad_request
from inflight.server.generation import (Generation, ServerContext, build_sampling_params,
                                        check_common, check_prompt_len, check_token_ids,
                                        encode, reserve)
from inflight.server.logprobs import (chat_logprobs, completion_logprobs, echo_logprobs,
                                      prompt_logprobs)
from inflight.server.protocol import (COMPLETION_DEFAULT_MAX_TOKENS, ChatCompletionRequest, ChatMessage,
                                      CompletionRequest)
from inflight.server.structured import check_structured_outputs
from inflight.server.tenants import TenantLease
from inflight.server.tools import plan_tools, template_tool_call
from inflight.tokenizer import ChatTemplateError


# --- completions --------------------------------------------------------------------------
def completion_max_tokens(ctx: ServerContext, req: CompletionRequest, prompt_len: int) -> int | None:
    """The tokens to generate for a ``prompt_len``-token prompt: the body's ``max_tokens``
    (0, scoring with ``echo``: the prompt is prefilled and nothing generated, so usage
    says ``completion_tokens: 0``; None: up to ``max_model_len``), or 16 when the body has none, fewer where the context
    has less room left, so that leaving the field out never turns a prompt that fits into
    a 400."""
    if "max_tokens" in req.model_fields_set:
        return 0 if req.max_tokens == 0 else ctx.default_max_tokens(req.max_tokens, prompt_len)
    if prompt_len + COMPLETION_DEFAULT_MAX_TOKENS <= ctx.engine.max_model_len:
        return COMPLETION_DEFAULT_MAX_TOKENS
    return None  # what is left of the context (a prompt too long for it is still a 400)


async def prepare_completion(ctx: ServerContext, req: CompletionRequest,
                             arrival_time: float, tenant: TenantLease | None = None) -> Generation:
    """Validate and tokenize a completions body (raises ``OpenAIError``); ``tenant``: the
    caller's place under its tenant's limits, charged with the call's tokens."""
    check_common(ctx, req)
    check_completion_fields(req)
    raw: list[str] | list[list[int]] | list[str | list[int]]
    if isinstance(req.prompt, str):
        raw = [req.prompt]
    elif req.prompt and isinstance(req.prompt[0], int):
        raw = [[int(t) for t in req.prompt]]
    else:  # a list of texts or of id lists (mypy cannot narrow a list by its elements)
        raw = req.prompt  # type: ignore[assignment]
    if not raw:
        raise bad_request("prompt: must not be empty", param="prompt")
    num_seqs = req.best_of or req.n  # best_of candidates are generated, n returned
    reservation = reserve(ctx, len(raw) * num_seqs)
    try:
        prompts: list[list[int]] = []
        for p in raw:
            if isinstance(p, str):
                # "" is a prompt where the tokenizer adds a BOS (Gemma: [2]), as in vLLM and
                # llama.cpp's server; without one it has no tokens and is refused below
                ids = await encode(ctx, p, "prompt")
            else:
                check_token_ids(ctx, p, "prompt")
                ids = list(p)
            if not ids:
                raise bad_request("prompt: must not be empty (it has no tokens)", param="prompt")
            prompts.append(ids)
        structured = await check_structured_outputs(ctx, req)
        prompt_lps = req.prompt_logprobs
        if prompt_lps is None and req.echo:
            prompt_lps = req.logprobs  # the echoed prompt's logprobs
        # best_of ranks candidates by cumulative logprob: the sampled tokens' are needed.
        logprobs = 0 if req.logprobs is None and num_seqs > req.n else req.logprobs
        params = [build_sampling_params(
            req, check_prompt_len(ctx.engine, len(ids), completion_max_tokens(ctx, req, len(ids))),
            logprobs,
            structured_outputs=structured, n=num_seqs, prompt_logprobs=prompt_lps)
            for ids in prompts]
        gen = Generation(ctx, f"cmpl-{uuid.uuid4().hex}", prompts, params, arrival_time,
                         reservation, ctx.options(req, tenant), stream=req.stream, tenant=tenant)
        if req.echo:
            tok = ctx.engine.tokenizer
            gen.prompt_texts = [p if isinstance(p, str) else await asyncio.to_thread(
                tok.decode, ids, skip_special_tokens=False) for p, ids in zip(raw, prompts)]
        return gen
    except BaseException:  # a 400 after admission, or the client gone: free the places
        reservation.release()
        raise


def check_completion_fields(req: CompletionRequest) -> None:
    """The completions-only fields' rules (vLLM's and OpenAI's), as 400s naming them."""
    if req.best_of is not None:
        if req.best_of < req.n:
            raise bad_request(f"best_of: must be >= n ({req.n}), got {req.best_of}",
                              param="best_of")
        if req.stream and req.best_of > req.n:
            raise bad_request("best_of: other than n is not supported with stream=true",
                              param="best_of")


def _cumulative_logprob(c: CompletionOutput) -> float:
    return sum(lp.get(t, 0.0) for t, lp in zip(c.token_ids, c.logprobs or []))


def completion_choices(gen: Generation, req: CompletionRequest, i: int,
                       out: RequestOutput) -> list[dict[str, Any]]:
    """The choices of prompt ``i``: with ``best_of`` the ``n`` candidates of highest
    cumulative logprob (the sampled tokens' raw logprobs; ties keep generation order),
    with ``echo`` the prompt text and its logprobs first, with ``max_tokens: 0`` nothing
    generated."""
    tt = gen.ctx.token_texts
    cands = sorted(out.outputs, key=lambda c: c.index)
    if len(cands) > req.n:
        cands = sorted(cands, key=lambda c: -_cumulative_logprob(c))[:req.n]
    choices: list[dict[str, Any]] = []
    for j, c in enumerate(cands):
        text, logprobs = c.text, None
        echo_offset = 0
        if req.echo:
            text = gen.prompt_texts[i] + text
        if req.logprobs is not None:
            if req.echo:
                logprobs = echo_logprobs(tt, gen.prompts[i], out.prompt_logprobs)
                echo_offset = sum(len(t) for t in logprobs["tokens"])
            gen_lps = completion_logprobs(tt, c, echo_offset)
            logprobs = gen_lps if logprobs is None else {
                k: logprobs[k] + gen_lps[k] for k in gen_lps}
        choices.append({
            "index": i * req.n + j, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "prompt_logprobs": (prompt_logprobs(tt, out.prompt_logprobs)
                                if req.prompt_logprobs is not None else None)})
    return choices


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(gen: Generation, req: CompletionRequest,
                        finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed ``text_completion`` object."""
    choices: list[dict[str, Any]] = []
    completion_tokens = 0  # every generated token, best_of's dropped candidates included
    for i, out in enumerate(finals):
        completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        choices += completion_choices(gen, req, i, out)
    return {"id": gen.request_id, "object": "text_completion", "created": gen.created,
            "model": gen.model_name, "choices": choices,
            "usage": _usage(gen.num_prompt_tokens, completion_tokens)}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``data`` (JSON unless already a string)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


# Builds one streamed choice from (prompt index, completion delta, output), or None.
ChoiceFn = Callable[[int, CompletionOutput, RequestOutput], "dict[str, Any] | None"]

async def _sse_stream(gen: Generation, req: CompletionRequest | ChatCompletionRequest,
                      obj: str, choice: ChoiceFn,
                      opening: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
    """The SSE loop both routes share: the ``opening`` choices (chat's role chunks), one
    event per visible choice delta, an error event if the engine fails mid-stream (the 200
    is sent), a usage chunk if asked, ``[DONE]``.

    ``choice(prompt_index, completion, output)`` builds one choice dict, or None for a
    delta a client could not see (a held-back partial character). Usage follows OpenAI's
    ``stream_options.include_usage`` (``"usage": null`` on every chunk but the last, which
    has no choices) and vLLM's ``continuous_usage_stats`` (the running usage on every chunk).
    """
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts is not None and opts.continuous_usage_stats
    completion_tokens = 0
    base = {"id": gen.request_id, "object": obj, "created": gen.created,
            "model": gen.model_name}

    def chunk(choices: list[dict[str, Any]]) -> str:
        body = {**base, "choices": choices}
        if include_usage:
            body["usage"] = _usage(gen.num_prompt_tokens, completion_tokens) if continuous else None
        return sse(body)

    for body in opening or ():
        yield chunk([body])
    async for i, out in _guard(gen):
        if isinstance(out, OpenAIError):
            yield sse(out.body())
            yield sse("[DONE]")
            return
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            delta = choice(i, c, out)
            if delta is not None:
                yield chunk([delta])
    if include_usage:
        yield sse({**base, "choices": [], "usage": _usage(gen.num_prompt_tokens, completion_tokens)})
    yield sse("[DONE]")


def stream_completion(gen: Generation, req: CompletionRequest) -> AsyncIterator[str]:
    """SSE ``text_completion`` chunks, then a usage chunk if asked, then ``[DONE]``."""
    tt = gen.ctx.token_texts
    offsets: dict[int, int] = {}
    prompt_lps: dict[int, list[Any]] = {}  # by prompt: the echoed prompt's logprobs

    def choice(i: int, c: CompletionOutput, out: RequestOutput) -> dict[str, Any] | None:
        index = i * gen.n + c.index
        if out.prompt_logprobs is not None:
            prompt_lps[i] = out.prompt_logprobs
        echo = req.echo and index not in offsets  # the choice's first chunk
        if not c.text and c.finish_reason is None and req.logprobs is None and not echo:
            return None
        text, logprobs = c.text, None
        if echo:
            text = gen.prompt_texts[i] + text
        if req.logprobs is not None:
            if echo:
                logprobs = echo_logprobs(tt, gen.prompts[i], prompt_lps.get(i))
                offsets[index] = sum(len(t) for t in logprobs["tokens"])
            gen_lps = completion_logprobs(tt, c, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in gen_lps["tokens"])
            logprobs = gen_lps if logprobs is None else {
                k: logprobs[k] + gen_lps[k] for k in gen_lps}
        offsets.setdefault(index, 0)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    return _sse_stream(gen, req, "text_completion", choice)


async def _guard(gen: Generation) -> AsyncIterator[tuple[int, RequestOutput | OpenAIError]]:
    # An engine failure mid-stream becomes an error event: the 200 headers are already sent.
    try:
        async for item in gen.deltas():
            yield item
    except OpenAIError as e:
        yield -1, e


# --- chat ---------------------------------------------------------------------------------
async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest,
                       arrival_time: float, tenant: TenantLease | None = None) -> Generation:
    """Validate a chat body, render the chat template and tokenize (raises ``OpenAIError``);
    ``tenant`` as in ``prepare_completion``."""
    check_common(ctx, req)
    messages = render_messages(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    reservation = reserve(ctx, req.n)
    try:
        tok = ctx.engine.tokenizer
        plan = plan_tools(ctx, req)
        text = await render_chat(ctx, messages, req.add_generation_prompt,
                                 tools=plan.tools if plan is not None else None)
        ids = await encode(ctx, text, "messages", add_special_tokens=False)
        if not ids:
            raise bad_request("messages: the rendered prompt is empty", param="messages")
        names = {"prompt": "messages", "max_tokens": max_param}
        mt = check_prompt_len(ctx.engine, len(ids), ctx.default_max_tokens(max_tokens, len(ids)),
                              names)
        forced = plan.structured if plan is not None else None
        structured = await check_structured_outputs(
            ctx, req, (forced, plan.source) if plan is not None and forced is not None else None)
        params = build_sampling_params(req, mt, logprobs,
                                       {"logprobs": "top_logprobs", "max_tokens": max_param},
                                       structured_outputs=structured)
        return Generation(ctx, f"chatcmpl-{uuid.uuid4().hex}", [ids], [params], arrival_time,
                          reservation, ctx.options(req, tenant), names, stream=req.stream,
                          tenant=tenant)
    except BaseException:  # a 400 after admission, or the client gone: free the places
        reservation.release()
        raise


async def render_chat(ctx: ServerContext, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of ``messages`` through the model's chat template, off the event loop.

    Raises:
        OpenAIError: 400 for a conversation the template refuses (its ``raise_exception``:
            the client's fault); 500 ``chat_template_error`` when the template itself fails
            (unsafe, too slow, too large, broken: the model's fault). The message is the
            tokenizer's fixed sentence; the sandbox's detail stays in the server's log.
    """
    try:
        return await asyncio.to_thread(ctx.engine.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt, tools=tools)
    except ChatTemplateError as e:
        raise OpenAIError(500, str(e), code="chat_template_error") from None
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None


def render_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [template_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def chat_response(gen: Generation, req: ChatCompletionRequest,
                  finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object."""
    tt = gen.ctx.token_texts
    out = finals[0]
    plan = plan_tools(gen.ctx, req)  # validated when the request was prepared
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        message, finish_reason = (plan.message(c.text, c.finish_reason) if plan is not None
                                  else ({"role": "assistant", "content": c.text},
                                        c.finish_reason))
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(tt, c, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": gen.request_id, "object": "chat.completion", "created": gen.created,
            "model": gen.model_name, "choices": choices,
            "usage": _usage(gen.num_prompt_tokens, completion_tokens)}
    if req.prompt_logprobs is not None:  # vLLM's: on the response, not on each choice
        body["prompt_logprobs"] = prompt_logprobs(tt, out.prompt_logprobs)
    return body


def stream_chat(gen: Generation, req: ChatCompletionRequest) -> AsyncIterator[str]:
    """SSE ``chat.completion.chunk`` events, usage chunk if asked, then ``[DONE]``.

    Each choice opens with a chunk carrying the role alone (``{"role": "assistant",
    "content": ""}``), as OpenAI and vLLM send it; text follows in ``content`` deltas."""
    tt = gen.ctx.token_texts
    plan = plan_tools(gen.ctx, req)  # validated when the request was prepared
    streams = {i: plan.streamer() for i in range(gen.n)} if plan is not None else {}

    def choice(_: int, c: CompletionOutput, __: RequestOutput) -> dict[str, Any] | None:
        delta: dict[str, Any] | None = {"content": c.text}
        finish_reason = c.finish_reason
        if plan is not None:
            delta, finish_reason = streams[c.index].delta(c.text, c.finish_reason)
        if delta is None and finish_reason is None and not req.logprobs:
            return None
        if not c.text and finish_reason is None and not req.logprobs:
            return None
        return {"index": c.index, "delta": delta or {},
                "logprobs": chat_logprobs(tt, c, req.top_logprobs or 0) if req.logprobs else None,
                "finish_reason": finish_reason, "stop_reason": c.stop_reason}
    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None} for i in range(gen.n)]
    return _sse_stream(gen, req, "chat.completion.chunk", choice, opening)
