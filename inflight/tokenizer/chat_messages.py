"""OpenAI-style chat messages checked and rebuilt from plain JSON types before a chat
template sees them (:mod:`inflight.tokenizer.chat`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["plain_json", "validate_messages"]


def plain_json(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (dicts, lists, str, int, float, bool, None);
    pydantic models through ``model_dump()``, any other object as ``"<TypeName>"``."""
    # So that no caller object (with methods the sandbox does not know to be dangerous) is
    # reachable from the template.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {plain_json(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    # Subclasses (str enums, numpy scalars) carry extra methods: keep only the base value.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain_json(value.model_dump())
    return f"<{type(value).__name__}>"


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI-style message list and return plain-dict copies with ``None`` values dropped.

    Each message needs a string ``role`` and a ``content`` (str, list of parts, or ``None`` only when
    the message carries ``tool_calls``). Keys whose value is ``None`` are dropped, as transformers
    does, because templates handle a missing key but render ``None`` literally.
    Raises ``ValueError`` naming the first offending message.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role' (a non-empty string is required)")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise ValueError(
                f"messages[{i}] content must be a string or a list of parts, "
                f"got {type(content).__name__}")
        out.append({k: v for k, v in plain_json(message).items() if v is not None})
    return out

