"""The server-sent events of a streamed ``/v1/responses`` call, in OpenAI's order.

Each event is ``event: <type>`` plus ``data: {"type": <type>, "sequence_number": k, ...}``
(numbered from 0; no ``[DONE]``, as OpenAI and vLLM send none):

    response.created, response.in_progress              (status in_progress, no output)
    response.output_item.added                          (a message, status in_progress)
      response.content_part.added                       (output_text, text "")
      response.output_text.delta ...                    (the text as it comes)
      response.output_text.done, response.content_part.done
    response.output_item.done                           (the message, whole)
    response.output_item.added                          (a function_call, arguments "")
      response.function_call_arguments.delta ...
      response.function_call_arguments.done
    response.output_item.done
    response.completed | response.incomplete            (the whole response with usage)

The message is opened by its first text and left out when the model only called tools;
function calls follow chat's streamed tool calls (``ToolStream``): a forced call's
arguments stream as they come, ``auto`` calls come whole when the output ends. An engine
failure after the 200 is an ``error`` event (``code``, ``message``, ``param``) and then
``response.failed``, as OpenAI sends them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from inflight.server.error_responses import OpenAIError
from inflight.server.generation import Generation
from inflight.server.responses_serving import (ResponsesCall, function_call_item,
                                               item_status, message_item, output_text,
                                               response_object, status_of, usage)


class _Events:
    """One stream's events and the output items they have built so far."""

    def __init__(self, gen: Generation, call: ResponsesCall) -> None:
        self.gen, self.call = gen, call
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # closed items, in output order
        self.msg: dict[str, Any] | None = None  # the open message item
        self.call_item: dict[str, Any] | None = None  # the open function_call item
        self.call_index: int | None = None  # its index among chat's streamed tool calls

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event of type ``kind``, numbered in this stream's sequence."""
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _at(self) -> dict[str, Any]:
        return {"output_index": len(self.output)}

    def text(self, delta: str) -> Iterator[str]:
        """``delta`` as ``response.output_text.delta``, opening the message first."""
        yield from self._close_call("completed")
        if self.msg is None:
            yield from self._open_message()
        assert self.msg is not None
        self.msg["content"][0]["text"] += delta
        yield self.event("response.output_text.delta", item_id=self.msg["id"], **self._at(),
                         content_index=0, delta=delta, logprobs=[])

    def _open_message(self) -> Iterator[str]:
        msg = {**message_item("", "in_progress"), "content": []}
        yield self.event("response.output_item.added", **self._at(), item=msg)
        yield self.event("response.content_part.added", item_id=msg["id"], **self._at(),
                         content_index=0, part=output_text(""))
        self.msg = {**msg, "content": [output_text("")]}

    def tool_call(self, entry: dict[str, Any]) -> Iterator[str]:
        """One of chat's streamed ``tool_calls`` entries: a new call (it carries ``id``)
        opens a ``function_call`` item, a later entry adds to its arguments."""
        arguments = entry.get("function", {}).get("arguments") or ""
        if "id" in entry or entry.get("index") != self.call_index:
            yield from self._close_message("completed")
            yield from self._close_call("completed")
            self.call_index = entry.get("index")
            self.call_item = function_call_item(entry["function"]["name"], "", "in_progress")
            yield self.event("response.output_item.added", **self._at(), item=self.call_item)
        assert self.call_item is not None
        if arguments:
            self.call_item["arguments"] += arguments
            yield self.event("response.function_call_arguments.delta",
                             item_id=self.call_item["id"], **self._at(), delta=arguments)

    def close(self, status: str) -> Iterator[str]:
        """Close whatever item is open, with the output's final ``status``; an output
        with no text and no call still gets its (empty) message, as non-streamed."""
        if self.msg is None and self.call_item is None and not self.output:
            yield from self._open_message()
        yield from self._close_message(status)
        yield from self._close_call(status)

    def _close_message(self, status: str) -> Iterator[str]:
        msg, self.msg = self.msg, None
        if msg is None:
            return
        text = msg["content"][0]["text"]
        ident = msg["id"]
        yield self.event("response.output_text.done", item_id=ident, **self._at(),
                         content_index=0, text=text, logprobs=[])
        yield self.event("response.content_part.done", item_id=ident, **self._at(),
                         content_index=0, part=output_text(text))
        done = message_item(text, item_status(status), ident)
        yield self.event("response.output_item.done", **self._at(), item=done)
        self.output.append(done)

    def _close_call(self, status: str) -> Iterator[str]:
        item, self.call_item = self.call_item, None
        if item is None:
            return
        yield self.event("response.function_call_arguments.done", item_id=item["id"],
                         **self._at(), name=item["name"], arguments=item["arguments"])
        done = {**item, "status": item_status(status)}
        yield self.event("response.output_item.done", **self._at(), item=done)
        self.output.append(done)


async def stream_response(gen: Generation, call: ResponsesCall) -> AsyncIterator[str]:
    """The events of a started call (``Generation.first_delta`` has run), as SSE text."""
    ev = _Events(gen, call)
    opening = response_object(gen, call, "in_progress", [], None)
    yield ev.event("response.created", response=opening)
    yield ev.event("response.in_progress", response=opening)
    tools = call.plan.streamer() if call.plan is not None else None
    output_tokens = cached_tokens = 0
    finish_reason: str | None = None
    try:
        async for _, out in gen.deltas():
            cached_tokens = max(cached_tokens, out.num_cached_tokens or 0)
            for c in out.outputs:
                output_tokens += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                delta: dict[str, Any] | None = {"content": c.text}
                if tools is not None:
                    delta, _ = tools.delta(c.text, c.finish_reason)
                for chunk in _events(ev, delta or {}):
                    yield chunk
    except OpenAIError as e:  # the 200 is sent: the failure goes as events
        yield ev.event("error", code=e.code or e.type, message=e.message, param=e.param)
        failed = response_object(gen, call, "failed", ev.output, None)
        failed["error"] = {"code": "server_error", "message": e.message}
        yield ev.event("response.failed", response=failed)
        return
    status = status_of(finish_reason)
    for chunk in ev.close(status):
        yield chunk
    final = response_object(gen, call, status, ev.output, usage(gen, output_tokens, cached_tokens))
    yield ev.event("response.completed" if status == "completed" else "response.incomplete",
                   response=final)


def _events(ev: _Events, delta: dict[str, Any]) -> Iterator[str]:
    if delta.get("content"):
        yield from ev.text(delta["content"])
    for entry in delta.get("tool_calls") or ():
        yield from ev.tool_call(entry)
