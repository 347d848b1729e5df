"""Tool calls parsed out of a model's text (``--tool-call-parser``, vLLM's names).

- ``hermes``: Hermes 2 Pro / Qwen 2.5+ format, each call a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text
  before the first call is the message's content
  (https://github.com/NousResearch/Hermes-Function-Calling).
- ``llama3_json``: Llama 3.1+'s JSON tool calls: the whole message is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several
  separated by ``;`` (https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/).

A parser returns ``(content, calls)``: ``content`` is None when nothing but calls was
said, ``calls`` is ``[(name, arguments JSON text)]``. Text that does not parse as the
format's calls is content, never an error: the model may have chosen not to call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

ParsedCalls = tuple[str | None, list[tuple[str, str]]]

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _call(obj: object, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` from a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: object = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models emit the arguments already serialized
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_hermes(text: str) -> ParsedCalls:
    """``<tool_call>{...}</tool_call>`` blocks; the last may be unterminated (generation
    stopped at EOS right after the JSON)."""
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls: list[tuple[str, str]] = []
    pos = start
    decoder = json.JSONDecoder()
    while pos >= 0:
        body = text[pos + len(_HERMES_START):].lstrip()
        try:
            obj, _ = decoder.raw_decode(body)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, ("arguments", "parameters"))
        if call is None:
            return text, []
        calls.append(call)
        pos = text.find(_HERMES_START, pos + len(_HERMES_START))
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> ParsedCalls:
    """One or more ``{"name", "parameters"}`` objects making up the whole message."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        rest = re.match(r"\s*;?\s*", body[end:])
        pos = end + (rest.end() if rest else 0)
    return None, calls


TOOL_PARSERS: dict[str, Callable[[str], ParsedCalls]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}

# What a message opens with when it is (or may become) a tool call: a streamed reply is
# held back from the client while its text so far is a prefix of one of these.
CALL_OPENINGS: dict[str, tuple[str, ...]] = {
    "hermes": (_HERMES_START,),
    "llama3_json": ("{", _PYTHON_TAG),
}


def check_tool_choice_flags(tool_call_parser: str | None, enable_auto_tool_choice: bool) -> None:
    """``--tool-call-parser`` and ``--enable-auto-tool-choice`` together (vLLM's rule).

    Raises:
        ValueError: an unknown parser, or auto tool choice without one.
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: one of {sorted(TOOL_PARSERS)}, "
                         f"got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")
