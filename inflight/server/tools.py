"""Tool calling on chat completions, as OpenAI defines it
(https://platform.openai.com/docs/guides/function-calling) and vLLM serves it
(https://docs.vllm.ai/en/latest/features/tool_calling.html).

``tools`` are rendered into the prompt by the chat template (``--chat-template`` supplies
one that knows tools). What comes back depends on ``tool_choice``:

- ``none``: plain text.
- ``auto`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as vLLM): the
  model decides; its text is parsed (``tool_parsers``) and calls found become
  ``tool_calls`` with ``finish_reason: "tool_calls"``.
- ``required``: structured output forces a JSON array of ``{"name", "parameters"}`` over
  the given tools (vLLM's schema), so at least one call is made and its arguments parse.
- a named function: structured output forces that function's ``parameters`` schema; the
  whole output is its arguments.

Streamed, a forced call's arguments stream as ``tool_calls[].function.arguments`` deltas
(the first carrying ``id``, ``type`` and ``name``); an ``auto`` reply streams its text until
it opens a tool call, then the calls come whole when the choice ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inflight.server.error_responses import bad_request
from inflight.server.tool_parsers import CALL_OPENINGS, TOOL_PARSERS
from inflight.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from inflight.server.generation import ServerContext
    from inflight.server.protocol import ChatCompletionRequest

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": _call_id(), "type": "function",
                           "function": {"name": name, "arguments": arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


@dataclass(frozen=True)
class ToolPlan:
    """One chat request's tools and how its output becomes tool calls.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        tools: the request's tools as the chat template takes them (OpenAI's shape).
        name: the forced function (``named``).
        parser: the ``--tool-call-parser`` (``auto``).
        structured: the grammar that forces the call (``required``, ``named``).
        source: the field that grammar comes from, named in a compile error's 400.
    """

    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None
    parser: str | None = None
    structured: StructuredOutputsParams | None = field(default=None)
    source: str = "tools"

    # --- non-streamed ----------------------------------------------------------------
    def calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """``(content, [(name, arguments JSON)])`` of a finished choice's text."""
        if self.mode == "named":
            return None, [(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                              for c in items]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # cut by max_tokens: the grammar never finished
        if self.mode == "auto" and self.parser is not None:
            return TOOL_PARSERS[self.parser](text)
        return text, []

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The choice's ``message`` and its ``finish_reason``."""
        content, calls = self.calls(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return msg, finish_reason
        msg["tool_calls"] = [_call(n, a) for n, a in calls]
        if finish_reason == "stop" and self.mode != "named":
            finish_reason = "tool_calls"  # a forced named call ends as "stop" (OpenAI)
        return msg, finish_reason

    def streamer(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """One streamed choice's text turned into chat deltas (see the module docstring)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.call_id: str | None = None

    def _held_from(self) -> int:
        """Where the text that may be a tool call starts (``len(text)``: nothing held)."""
        text, parser = self.text, self.plan.parser
        if parser == "hermes":
            opening = CALL_OPENINGS[parser][0]
            at = text.find(opening)
            if at >= 0:
                return at
            for k in range(min(len(opening) - 1, len(text)), 0, -1):
                if opening.startswith(text[-k:]):
                    return len(text) - k
            return len(text)
        stripped = text.lstrip()
        if parser is not None and (not stripped or any(
                stripped.startswith(o) or o.startswith(stripped)
                for o in CALL_OPENINGS[parser])):
            return 0
        return len(text)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The delta for ``text`` (new since the last call) and the finish reason to send;
        None when there is nothing to show yet."""
        self.text += text
        mode = self.plan.mode
        if mode == "named":
            if self.call_id is None:
                call = _call(self.plan.name or "", text, index=0)
                self.call_id = call["id"]
                return {"tool_calls": [call]}, finish_reason
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
                    if text else None), finish_reason
        if mode == "none" or (mode == "auto" and self.plan.parser is None):
            return {"content": text} if text else None, finish_reason
        if finish_reason is None:
            if mode == "required":
                return None, None
            upto = self._held_from()
            if upto > self.sent:
                content = self.text[self.sent:upto]
                self.sent = upto
                return {"content": content}, None
            return None, None
        _, calls = self.plan.calls(self.text)
        if not calls:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return {"content": rest}, finish_reason
        if finish_reason == "stop":
            finish_reason = "tool_calls"
        return {"tool_calls": [_call(n, a, index=i) for i, (n, a) in enumerate(calls)]}, \
            finish_reason


def _required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of calls, each
    ``{"name": one tool's name, "parameters": that tool's parameters}``; with ``parallel``
    False (OpenAI's ``parallel_tool_calls: false``) exactly one call."""
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [{
        "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                       "parameters": t["function"].get("parameters") or _EMPTY_PARAMETERS},
        "required": ["name", "parameters"]} for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(ctx: ServerContext, req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ``ToolPlan``; None without tools.

    Raises:
        OpenAIError: 400 for ``tool_choice`` without tools, a named function not among
            them, duplicate tool names, ``auto`` on a server started without a tool
            parser, or a forced call together with another structured output.
    """
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice is None or choice == "auto":
        if not ctx.enable_auto_tool_choice or ctx.tool_call_parser is None:
            if choice is None:  # OpenAI's default with tools is auto; without a parser: text
                return ToolPlan("none", tools)
            raise bad_request('tool_choice: "auto" needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser",
                              param="tool_choice")
        return ToolPlan("auto", tools, parser=ctx.tool_call_parser)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        plan = ToolPlan("required", tools,
                        structured=StructuredOutputsParams(
                            json=_required_schema(tools, req.parallel_tool_calls)))
    else:
        name = choice.function.name
        if name not in names:
            raise bad_request(f"tool_choice: function {name!r} is not among tools",
                              param="tool_choice")
        i = names.index(name)
        params = tools[i]["function"].get("parameters") or _EMPTY_PARAMETERS
        plan = ToolPlan("named", tools, name=name, structured=StructuredOutputsParams(json=params),
                        source=f"tools[{i}].function.parameters")
    return plan


def template_tool_call(call: Any) -> dict[str, Any]:
    """A history message's tool call as chat templates read it: ``function.arguments`` a
    dict where it is a JSON object (HF's convention; templates ``tojson`` it), else the
    text as sent."""
    try:
        args: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        args = call.function.arguments
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}
