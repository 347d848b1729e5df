"""Users on the simulator's clock: a closed-loop point (``bench.users``' rules) simulated.

The simulator asks a :class:`ClosedLoop` for the users' first requests, tells it when each
request is sent and when it ends, and gets the user's next request back: the conversation's
next turn (its history made of stand-in answers, as ``conversations.with_stand_in_answers``
makes them, so prompts grow by shared prefix) or the next conversation's first, sent a
think time after the answer ended. The point's looks are resolved as a live point's are
(``users.first_look_end``); the run is done once the last look's sample requests have ended
or its deadline passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from inflight.bench.conversations import with_stand_in_answers
from inflight.bench.datasets import RequestSpec
from inflight.bench.session import ArrivalConfig
from inflight.bench.sustain import Window
from inflight.bench.users import (Conversation, ConversationSupply, first_look_end, resolved_looks, start_offset,
                                  think_seconds)
from inflight.sim.simulator import SimRequest

# (index, the turn's own spec, the spec as sent with its history, send time) -> the request
MakeRequest = Callable[[int, RequestSpec, RequestSpec, float], SimRequest]


@dataclass
class Sent:
    """One closed-loop request: who sent it, from which conversation and turn."""

    user: int
    conversation: Conversation
    turn: int
    spec: RequestSpec
    send_time: float | None = None
    ended: bool = False


class ClosedLoop:
    """``arrival.users`` users drawing conversations from ``supply`` (``take_now``: it
    raises ``users.MixExhausted`` when the mix is too short; extend it and run again)."""

    def __init__(self, arrival: ArrivalConfig, supply: ConversationSupply, window: Window, need: int,
                 make: MakeRequest) -> None:
        assert arrival.users
        self.arrival, self.supply, self.make, self.need = arrival, supply, make, max(1, need)
        self.window = window  # as planned; ``looks`` once resolved
        self.looks: list[Window] | None = None
        self.requests: list[Sent] = []
        self._sample_sends: list[float] = []
        self._sent_by: dict[int, list[RequestSpec]] = {}  # user -> its conversation's turns as sent
        self._count = [0] * arrival.users  # requests each user has sent
        self._open: set[int] = set()  # once resolved: the last look's sample requests not yet ended

    def start(self) -> list[SimRequest]:
        """Each user's first request, at its place on the ramp."""
        return [self._request(u, self.supply.take_now(), 0, start_offset(self.arrival, u))
                for u in range(self.arrival.users or 0)]

    def _request(self, user: int, conv: Conversation, turn: int, at: float) -> SimRequest:
        if turn == 0:  # a user holds one conversation at a time: its turns as sent, made once
            self._sent_by[user] = with_stand_in_answers(list(conv.turns))
        self.requests.append(Sent(user, conv, turn, conv.turns[turn]))
        return self.make(len(self.requests) - 1, conv.turns[turn], self._sent_by[user][turn], at)

    def on_send(self, index: int, t: float) -> None:
        self.requests[index].send_time = t
        if t >= self.window.start:
            self._sample_sends.append(t)
        if self.looks is None:
            self._resolve()
        elif self.looks[-1].phase(t) == "sample":
            self._open.add(index)

    def _resolve(self) -> None:
        end = first_look_end(self.window, self.need, self._sample_sends)
        if end is None:
            return
        self.looks = resolved_looks(self.window, end, len(self.window.looks()))
        last = self.looks[-1]
        self._open = {i for i, r in enumerate(self.requests)
                      if r.send_time is not None and not r.ended and last.phase(r.send_time) == "sample"}

    def after(self, index: int, t: float) -> SimRequest | None:
        """Request ``index`` ended at ``t``: its user's next request, after a think time;
        None once the point is past its last deadline."""
        ended = self.requests[index]
        ended.ended = True
        self._open.discard(index)
        user = ended.user
        at = t + think_seconds(self.arrival, user, self._count[user])
        self._count[user] += 1
        if self.looks is not None and at >= self.looks[-1].deadline:
            return None
        if ended.turn + 1 < len(ended.conversation.turns):
            return self._request(user, ended.conversation, ended.turn + 1, at)
        return self._request(user, self.supply.take_now(), 0, at)

    def done(self, t: float) -> bool:
        """The last look's sample requests have all ended, or its deadline passed."""
        if self.looks is None:
            return False
        last = self.looks[-1]
        return t >= last.deadline or (t >= last.end and not self._open)

    def resolved_window(self) -> Window:
        """The looks as one window with its extensions (``sustain.Window``); the planned
        window where the run never resolved them."""
        if self.looks is None:
            return self.window
        first = self.looks[0]
        return Window(first.start, first.end, first.deadline, tuple(w.end for w in self.looks[1:]))
