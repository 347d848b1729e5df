"""Users as a load: N concurrent sessions replaying conversations, a closed loop.

A user takes the next conversation of the mix (``ConversationSupply``: a multi-turn chat
mix's conversations, a trace's conversations as its prefix blocks chain them, or one
request each for any other dataset), sends its first turn, and sends turn k + 1 with the
whole history ``think_time`` after turn k's answer ended: a chat's history is its earlier
messages and the server's own answers; a trace turn's prompt holds the history the trace
recorded (its earlier turns' blocks). Either way the server sees a growing shared prefix. After
the last turn it thinks once more and starts the next conversation. User ``u`` of ``N``
starts at ``u x ramp / N``. The arrival rate is the users' own: it falls as the server
slows down, unlike an open-loop rate (AIPerf's multi-turn sessions with
``--conversation-turn-delay-mean``; the closed-loop users of AA-AgentPerf).

A point's window is judged as an open-loop one is (``sustain.judge``); only its length is
found as the point runs: the first look ends ``duration`` after the warm-up, or later, at
the send of its ``min_requests``-th sample request (``first_look_end``: a few slow users
send few requests a minute), and each extension is as long again.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from inflight.bench.datasets import RequestSpec
from inflight.bench.sustain import Window

if TYPE_CHECKING:
    from inflight.bench.session import ArrivalConfig, Session

THINK_DISTRIBUTIONS = ("constant", "exponential")


def think_seconds(arrival: ArrivalConfig, user: int, k: int) -> float:
    """The think time (s) before user ``user``'s request ``k + 1`` (``k`` counts its
    requests from 0): ``think_time``, or an exponential draw of that mean from the seed."""
    if arrival.think_time <= 0:
        return 0.0
    if arrival.think_distribution == "exponential":
        return float(np.random.default_rng([arrival.seed, user, k, 29]).exponential(arrival.think_time))
    if arrival.think_distribution != "constant":
        raise ValueError(f"think time distribution {arrival.think_distribution!r}: "
                         f"one of {', '.join(THINK_DISTRIBUTIONS)}")
    return arrival.think_time


def start_offset(arrival: ArrivalConfig, user: int) -> float:
    """When user ``user`` sends its first request (s after the point's start)."""
    assert arrival.users
    return arrival.ramp() * user / arrival.users


def first_look_end(window: Window, need: int, sample_sends: Sequence[float]) -> float | None:
    """The first look's end: ``window.end`` once ``need`` sample requests were sent by then,
    else just after the send of the ``need``-th (``sample_sends``: sample send times in
    order). None while neither is known yet."""
    if len(sample_sends) >= need:
        return max(window.end, sample_sends[need - 1] + 1e-6)
    return None


def resolved_looks(window: Window, first_end: float, looks: int) -> list[Window]:
    """``looks`` windows from ``window.start``: the first ends at ``first_end``, each next
    one a span later, each with ``window``'s drain after it."""
    drain, span = window.deadline - window.end, first_end - window.start
    return [Window(window.start, window.start + k * span, window.start + k * span + drain)
            for k in range(1, looks + 1)]


@dataclass(frozen=True)
class Conversation:
    """One session's turns, in order: each turn's own spec, without its history, or, with
    ``history_in_prompt`` (a trace's conversations), with it, to be sent as it is."""

    key: int
    turns: tuple[RequestSpec, ...]
    history_in_prompt: bool = False


class MixExhausted(Exception):
    """The mix holds no further complete conversation (``ConversationSupply.take_now``)."""


class ConversationSupply:
    """The mix's conversations, handed to users in order; the mix grows as users need more.

    A multi-turn chat mix interleaves its conversations in groups (``conversation_slot``),
    so a conversation is handed out only when the mix holds its group entirely; a trace mix
    in sessions (``DatasetConfig.sessions``) holds each conversation's turns one after the
    other, and one is handed out once the mix holds all its turns; any other mix is
    one-request conversations.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.taken = 0
        self._lock = asyncio.Lock()
        ds = session.dataset
        self._turns = ds.conversation_turns if ds.name == "chat" else 1
        self._trace_sessions = ds.name == "trace" and ds.sessions
        self._group = self._turns * ds.active_conversations if self._turns > 1 else 1
        self._grouped: tuple[int, list[Conversation]] = (-1, [])  # (mix length, its conversations)

    def complete(self) -> list[Conversation]:
        """Every conversation the mix holds entirely, in order (grouped again only when
        the mix has grown: a user takes one at every conversation it starts)."""
        specs = self.session.specs
        if self._grouped[0] == len(specs):
            return self._grouped[1]
        if self._trace_sessions:
            convs = _trace_conversations(specs)
        elif self._turns == 1:
            convs = [Conversation(i, (s,)) for i, s in enumerate(specs)]
        else:
            whole = len(specs) // self._group * self._group
            by_key: dict[int, list[RequestSpec]] = defaultdict(list)
            for s in specs[:whole]:
                by_key[s.meta["conversation"]].append(s)
            convs = [Conversation(k, tuple(sorted(v, key=lambda s: s.meta["turn"])))
                     for k, v in sorted(by_key.items())]
        self._grouped = (len(specs), convs)
        return convs

    def take_now(self) -> Conversation:
        """The next conversation. MixExhausted when the mix has none left (extend it)."""
        convs = self.complete()
        if self.taken >= len(convs):
            raise MixExhausted(f"the mix holds {len(convs)} conversations")
        self.taken += 1
        return convs[self.taken - 1]

    async def take(self) -> Conversation:
        """The next conversation, the mix extended where it has none left. RuntimeError
        when it cannot grow (a trace's rows ran out)."""
        async with self._lock:
            while True:
                try:
                    return self.take_now()
                except MixExhausted:
                    have = len(self.session.specs)
                    if await self.session.ensure_specs(self._whole_groups(2 * have)) == have:
                        raise RuntimeError(f"the mix ran out of conversations after {self.taken}") from None

    async def reserve(self, n: int) -> None:
        """Grow the mix to at least ``n`` complete conversations (a simulation takes them
        synchronously)."""
        while len(self.complete()) < n:
            have = len(self.session.specs)
            if await self.session.ensure_specs(self._whole_groups(max(2 * have, n * self._turns))) == have:
                return

    def _whole_groups(self, n: int) -> int:
        """``n`` requests rounded up to whole conversation groups, at least one more group."""
        have = len(self.session.specs)
        return max(-(-n // self._group), have // self._group + 1) * self._group


def _trace_conversations(specs: Sequence[RequestSpec]) -> list[Conversation]:
    """The complete conversations of a trace mix in sessions: runs of ``trace_turns`` specs."""
    convs, i = [], 0
    while i < len(specs) and i + (n := specs[i].meta["trace_turns"]) <= len(specs):
        convs.append(Conversation(specs[i].meta["trace_session"], tuple(specs[i: i + n]), history_in_prompt=True))
        i += n
    return convs
