"""Chat prompt files: JSONL, one conversation a line, checked as they are read.

A line is MT-Bench's ``{"turns": ["first user message", "second", ...], ...}`` (FastChat's
``question.jsonl``), or vLLM's custom dataset ``{"prompt": "..."}``: a conversation of one
turn. ``question_id`` and ``category`` are kept where present.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatLine:
    """One line of a chat file: its user turns (non-empty strings, at least one)."""

    turns: tuple[str, ...]
    question_id: Any = None
    category: Any = None


def load_chat_file(path: pathlib.Path) -> list[ChatLine]:
    """The conversations of ``path``, blank lines skipped. ValueError naming the file and
    line where a line is not JSON, holds neither ``turns`` nor ``prompt``, or a turn is
    not a non-empty string, or where the file holds no conversation."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                out.append(_line(text, f"{path}, line {number}"))
    if not out:
        raise ValueError(f"{path}: no conversations (JSONL: one {{\"turns\": [...]}} or {{\"prompt\": ...}} a line)")
    return out


def _line(text: str, where: str) -> ChatLine:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or ("turns" not in obj and "prompt" not in obj):
        raise ValueError(f'{where}: expected an object with "turns" (a list of user messages) or "prompt"')
    turns = obj["turns"] if "turns" in obj else [obj["prompt"]]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f'{where}: "turns" must be a non-empty list of non-empty strings '
                         f'("prompt" a non-empty string)')
    return ChatLine(tuple(turns), obj.get("question_id"), obj.get("category"))
