"""Multi-turn chat replay: each follow-up turn carries its conversation's history.

A turn of a multi-turn mix (``datasets.build_chat`` with ``conversation_turns`` > 1) holds
only its own user message; the history is known only as the replay runs: turn ``k`` is sent
with turn ``k - 1``'s messages, the answer the server streamed back for it, and then its
own message, and not before that answer has ended (a user reads before typing the next
question). So a conversation's prompts grow by prefix, as real chat sessions do, and a
server with prefix caching (or a router with prefix affinity) can reuse them.

Follows the shape of vLLM's multi-turn serving benchmark (conversations whose requests
carry the previous answers) and AIPerf's multi-turn sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from inflight.bench.datasets import RequestSpec


def is_follow_up(spec: RequestSpec) -> bool:
    """Whether ``spec`` is a second or later turn of a conversation."""
    turn: int = spec.meta.get("turn", 0)
    return turn > 0


def _sent_as(spec: RequestSpec, messages: list[dict[str, Any]]) -> RequestSpec:
    # The client counted only the turn's own message: the length is the server's to report.
    return dataclasses.replace(spec, messages=messages, prompt="\n".join(m["content"] for m in messages),
                               prompt_len=None, exact=False)


def with_history(spec: RequestSpec, history: list[dict[str, Any]]) -> RequestSpec:
    """``spec`` sent after ``history`` (earlier messages, answers included): its messages
    appended to them; ``spec`` itself where there is no history."""
    return _sent_as(spec, [*history, *spec.as_messages()]) if history else spec


@dataclass
class _Turn:
    messages: list[dict[str, Any]] | None = None  # what this turn sent (history + its message); None: not sent
    done: asyncio.Event = field(default_factory=asyncio.Event)
    answer: str = ""


class ConversationLog:
    """The conversations of one replay (one point): what each turn sent and got back.

    ``await prepare(spec)`` returns the spec to send and a handle: the spec unchanged for a
    first turn or a single-turn mix; for a follow-up, after its previous turn has ended, a
    copy whose messages are that turn's messages, its answer (``role: assistant``, the
    streamed text, partial or empty where it failed) and this turn's own message.
    ``finish(handle, text)`` records the answer and releases the next turn; call it however
    the turn ended (a cancelled turn releases its follow-up with what it had).

    A follow-up whose previous turn was never sent in this replay carries no history.
    """

    def __init__(self) -> None:
        self._last: dict[int, _Turn] = {}  # conversation -> its latest prepared turn

    async def prepare(self, spec: RequestSpec) -> tuple[RequestSpec, _Turn | None]:
        if "turn" not in spec.meta:
            return spec, None
        conv = spec.meta["conversation"]
        prev = self._last.get(conv) if is_follow_up(spec) else None
        # Registered before waiting: the turn after this one waits for this one, not for ours.
        turn = self._last[conv] = _Turn()
        own = spec.as_messages()
        messages = list(own)
        if prev is not None:
            try:
                await prev.done.wait()
            except asyncio.CancelledError:
                turn.done.set()  # never sent: the next turn carries the history without it
                raise
            if prev.messages is not None:
                messages = [*prev.messages, {"role": "assistant", "content": prev.answer}, *own]
        turn.messages = messages
        return _sent_as(spec, messages), turn

    @staticmethod
    def finish(turn: _Turn | None, answer: str) -> None:
        if turn is not None and not turn.done.is_set():
            turn.answer = answer
            turn.done.set()


def with_stand_in_answers(specs: list[RequestSpec]) -> list[RequestSpec]:
    """The specs with each follow-up's history filled in before any answer exists, for the
    simulator (``--simulate``), which generates token counts, not text: each earlier answer
    is a stand-in of ``output_len`` words (about that many tokens) that every later turn of
    the conversation repeats, so the prompts grow by shared prefix as in a live replay.
    Specs must be in mix order (a conversation's turns in turn order)."""
    log: dict[int, list[dict[str, Any]]] = {}
    out = []
    for spec in specs:
        if "turn" not in spec.meta:
            out.append(spec)
            continue
        conv = spec.meta["conversation"]
        prev = log.get(conv) if is_follow_up(spec) else None
        messages = list(spec.as_messages()) if prev is None else [*prev, *spec.as_messages()]
        log[conv] = [*messages, {"role": "assistant", "content": " ".join(["answer"] * spec.output_len)}]
        out.append(_sent_as(spec, messages))
    return out
