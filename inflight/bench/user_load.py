"""Users on a live server: the sender of a closed-loop point (``bench.users`` for the model).

:class:`UserLoad` runs ``arrival.users`` user tasks and resolves the point's looks as its
sample grows; ``http_target`` hands it the point's clock, a way to launch one request,
and the list of looks it judges (resolved in place).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from inflight.bench.client import RequestRecord
from inflight.bench.conversations import with_history
from inflight.bench.datasets import RequestSpec
from inflight.bench.session import ArrivalConfig
from inflight.bench.sustain import Window
from inflight.bench.users import ConversationSupply, first_look_end, resolved_looks, start_offset, think_seconds

Launch = Callable[[RequestRecord, RequestSpec], "asyncio.Task[RequestRecord]"]


class UserLoad:
    """``arrival.users`` users sending conversations from ``supply`` through ``launch``.

    ``looks``: the point's looks, provisional (``duration`` long); the first is resolved
    to end at ``users.first_look_end`` (at least ``need`` sample requests) and the others
    follow it, in place, before ``sent_past[k]`` says look ``k``'s sends are all made.
    The users run until cancelled (the point's end).
    """

    def __init__(self, arrival: ArrivalConfig, supply: ConversationSupply, looks: list[Window], need: int,
                 clock: Callable[[], float], launch: Launch) -> None:
        assert arrival.users
        self.arrival, self.supply, self.looks, self.need = arrival, supply, looks, max(1, need)
        self.clock, self.launch = clock, launch
        self.sample_sends: list[float] = []
        self._sent = asyncio.Event()
        self._next_index = 0

    async def run(self, sent_past: list[asyncio.Event]) -> None:
        """Run the users and resolve the looks until cancelled. A user stops only by an
        error (its mix ran out, a turn could not be built): that error is raised here, at
        once, rather than leaving the looks waiting for sends that will not come."""
        users = [asyncio.create_task(self._user(u)) for u in range(self.arrival.users or 0)]
        resolve = asyncio.create_task(self._resolve(sent_past))
        pending: set[asyncio.Task[None]] = {resolve, *users}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
        finally:
            for t in (resolve, *users):
                t.cancel()
            await asyncio.gather(resolve, *users, return_exceptions=True)
            for e in sent_past:  # whatever ends the users, no look may wait forever
                e.set()

    async def _sleep_until(self, t: float) -> None:
        delay = t - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _resolve(self, sent_past: list[asyncio.Event]) -> None:
        first = self.looks[0]
        await self._sleep_until(first.end)
        while (end := first_look_end(first, self.need, self.sample_sends)) is None:
            self._sent.clear()
            await self._sent.wait()
        self.looks[:] = resolved_looks(first, end, len(self.looks))
        for k, w in enumerate(self.looks):
            await self._sleep_until(w.end)
            sent_past[k].set()

    async def _user(self, user: int) -> None:
        await self._sleep_until(start_offset(self.arrival, user))
        k = 0
        while True:
            conv = await self.supply.take()
            history: list[dict[str, Any]] = []
            for turn, spec in enumerate(conv.turns):
                now = self.clock()
                phase = self.looks[-1].phase(now)
                record = RequestRecord(self._next_index, now, warmup=phase != "sample", phase=phase, user=user,
                                       conversation=conv.key, turn=turn, turns=len(conv.turns))
                self._next_index += 1
                if now >= self.looks[0].start:
                    self.sample_sends.append(now)
                    self._sent.set()
                sent = spec if conv.history_in_prompt else with_history(spec, history)
                await self.launch(record, sent)
                history = [*sent.as_messages(), {"role": "assistant", "content": record.generated_text}]
                await asyncio.sleep(think_seconds(self.arrival, user, k))
                k += 1
