"""``POST /v1/responses`` served by the chat-completions path.

A Responses body becomes a ``ChatCompletionRequest`` (``to_chat_request``): ``instructions``
a system message first, ``input`` items chat messages (consecutive ``function_call`` items
one assistant message's ``tool_calls``, a ``function_call_output`` a ``tool`` message),
``max_output_tokens`` ``max_completion_tokens``, ``text.format`` ``response_format``, the
flat function tools chat's nested ones. ``serving.prepare_chat`` then templates, tokenizes
and checks it, so sampling, structured output, tool plans and the engine's rules are
chat's; its errors are renamed to the Responses fields (``messages`` -> ``input``).

The answer is OpenAI's ``response`` object: output items (a ``message`` with one
``output_text`` part, then ``function_call`` items), ``status`` ``completed``, or
``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` when the output ran
out, ``usage`` as ``input_tokens`` / ``output_tokens`` / ``total_tokens``. Nothing is
stored (``store: false``), as vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from inflight.outputs import RequestOutput
from inflight.server import serving
from inflight.server.error_responses import OpenAIError, bad_request
from inflight.server.generation import Generation, ServerContext
from inflight.server.protocol import (ChatCompletionRequest, ChatMessage, FunctionCall,
                                      FunctionDefinition, JsonSchemaFormat, NamedFunction,
                                      NamedToolChoice, ResponseFormat, Tool, ToolCall)
from inflight.server.responses_api import (FormatJsonObject, FormatJsonSchema,
                                           FunctionCallItem, FunctionCallOutputItem,
                                           ResponsesRequest, ToolChoiceFunction)
from inflight.server.tenants import TenantLease
from inflight.server.tools import ToolPlan, plan_tools


@dataclass
class ResponsesCall:
    """One ``/v1/responses`` call: its body, and once prepared the chat request it runs
    as and that request's tool plan (None: no tools)."""

    body: ResponsesRequest
    chat: ChatCompletionRequest | None = None
    plan: ToolPlan | None = None
    stream: bool = field(init=False)

    def __post_init__(self) -> None:
        self.stream = self.body.stream


# --- the body as a chat request -----------------------------------------------------------
def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` asks for.

    Raises:
        OpenAIError: 400 for ``previous_response_id`` (code ``previous_response_not_found``:
            nothing is stored), a field of ``REFUSED_FIELDS`` that is not inert, or a
            ``function_call`` item in a position chat cannot hold.
    """
    if req.previous_response_id is not None:
        raise bad_request(
            f"previous_response_id: response {req.previous_response_id!r} not found: this "
            "server stores no responses (store is answered as false); send the whole "
            "conversation in input", param="previous_response_id",
            code="previous_response_not_found")
    for name in req.refused_fields():
        raise bad_request(f"{name} is not supported", param=name)
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if isinstance(fmt, FormatJsonSchema):
        response_format = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
    elif isinstance(fmt, FormatJsonObject):
        response_format = ResponseFormat(type="json_object")
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in req.tools] if req.tools is not None else None
    choice = req.tool_choice
    return ChatCompletionRequest(
        model=req.model, messages=to_messages(req), max_tokens=None,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, stream=req.stream,
        user=req.user, response_format=response_format, tools=tools,
        tool_choice=(NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
                     if isinstance(choice, ToolChoiceFunction) else choice),
        parallel_tool_calls=req.parallel_tool_calls)


def to_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` (a system message) then ``input`` as chat messages: consecutive
    ``function_call`` items join the assistant turn before them (or a new one without
    content), a ``function_call_output`` is a ``tool`` message answering ``call_id``."""
    messages: list[ChatMessage] = []
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
    items = [] if isinstance(req.input, str) else req.input
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(
                name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = ChatMessage(role="assistant", content=last.content,
                                           tool_calls=[*(last.tool_calls or []), call])
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.text()))
        else:
            messages.append(ChatMessage(role=item.role, content=item.text()))
    return messages


# Chat's field names in errors -> the Responses body's.
_RENAMES = ((re.compile(r"\bmessages\b"), "input"),
            (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\]\.function\.parameters\b"), "].parameters"))


def _renamed(text: str) -> str:
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text


def renamed(e: OpenAIError) -> OpenAIError:
    """``e`` (raised for the chat request) naming the Responses body's fields."""
    return OpenAIError(e.status, _renamed(e.message),
                       param=_renamed(e.param) if e.param is not None else None,
                       code=e.code, type=e.type, headers=e.headers)


async def prepare_responses(ctx: ServerContext, call: ResponsesCall, arrival_time: float,
                            tenant: TenantLease | None = None) -> Generation:
    """Validate, template and tokenize a Responses call as chat does
    (``serving.prepare_chat``); fills ``call.chat`` and ``call.plan``.

    Raises:
        OpenAIError: as ``to_chat_request`` and ``prepare_chat``, fields named as the body
            names them.
    """
    call.chat = to_chat_request(call.body)
    try:
        gen = await serving.prepare_chat(ctx, call.chat, arrival_time, tenant)
    except OpenAIError as e:
        raise renamed(e) from None
    call.plan = plan_tools(ctx, call.chat)  # already validated by prepare_chat
    gen.request_id = f"resp_{uuid.uuid4().hex}"
    return gen


# --- the response object ------------------------------------------------------------------
def item_id(prefix: str) -> str:
    """A new output item id (``msg_...``, ``fc_...``, ``call_...``, OpenAI's prefixes)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str, ident: str | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part."""
    return {"id": ident or item_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    """A message's ``output_text`` content part (no annotations, no logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(name: str, arguments: str, status: str,
                       ident: str | None = None, call_id: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item; its ``call_id`` is what ``function_call_output``
    answers."""
    return {"id": ident or item_id("fc"), "type": "function_call",
            "call_id": call_id or item_id("call"), "name": name, "arguments": arguments,
            "status": status}


def usage(gen: Generation, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's Responses usage (no reasoning tokens: no reasoning parser)."""
    return {"input_tokens": gen.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.num_prompt_tokens + output_tokens}


def status_of(finish_reason: str | None) -> str:
    """A finished output's ``status``: ``incomplete`` when ``max_output_tokens`` (or the
    context) ran out, ``cancelled`` when the server aborted it (vLLM's), else ``completed``."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


def item_status(status: str) -> str:
    """An output item's status in a response of ``status`` (items are never cancelled)."""
    return "completed" if status == "completed" else "incomplete"


def response_object(gen: Generation, call: ResponsesCall, status: str,
                    output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's ``response`` object: the body's settings echoed, ``output`` and ``usage``
    as given (``in_progress`` with an empty output opens a stream)."""
    body = call.body
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": gen.request_id, "object": "response", "created_at": gen.created,
        "status": status, "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": gen.model_name, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
        "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True)
                            if fmt is not None else {"type": "text"})},
        "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice,
                        ToolChoiceFunction) else body.tool_choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "truncation": "disabled", "usage": usage_, "metadata": body.metadata or {},
        "user": body.user}


def output_items(call: ResponsesCall, text: str, status: str) -> list[dict[str, Any]]:
    """A finished output's items: the message (unless the model only called tools), then
    one ``function_call`` per call the tool plan found in ``text``."""
    content, calls = call.plan.calls(text) if call.plan is not None else (text, [])
    items = [] if content is None or (not content and calls) else [message_item(content, status)]
    return items + [function_call_item(name, args, status) for name, args in calls]


def response_body(gen: Generation, call: ResponsesCall,
                  finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed ``response`` object of a finished call."""
    out = finals[0]
    c = out.outputs[0]
    status = status_of(c.finish_reason)
    return response_object(gen, call, status, output_items(call, c.text, item_status(status)),
                           usage(gen, len(c.token_ids), out.num_cached_tokens or 0))
