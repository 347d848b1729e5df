"""A point's looks: its records as they stand at a look, and whether the point goes on.

Shared by the server's points (``http_target``) and a simulator's, which judges a finished
run as it stood at each look.
"""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any, Sequence

from inflight.bench.client import RequestRecord
from inflight.bench.sustain import PASS, UNDECIDED, Verdict, Window

if TYPE_CHECKING:
    from inflight.bench.session import ArrivalConfig


def mark_cancelled(record: RequestRecord, now: float) -> None:
    """End ``record`` at ``now`` (s) unsent or unfinished: ``unfinished`` for a sample
    request, else ``cancelled``."""
    record.end_time, record.success = now, False
    record.unfinished = record.phase == "sample"
    record.cancelled = not record.unfinished
    record.error = ("unfinished when the point ended" if record.unfinished
                    else "cancelled after the sample ended")
    if record.send_time == 0.0 and not record.chunk_times:
        record.send_time = record.end_time


def settle(task: asyncio.Task[Any], record: RequestRecord, now: float) -> None:
    """Give an ended request task's record its outcome: cancelled at the point's end
    (``now``), whether or not it had started (a cool-down request created just as the point
    ends never runs a line), or ended by an unexpected exception."""
    if task.cancelled():
        mark_cancelled(record, now)
    elif (e := task.exception()) is not None and record.error is None:
        record.success, record.end_time = False, record.end_time or now
        record.error = f"{type(e).__name__}: {e}"


def view_at(records: Sequence[RequestRecord], done: Sequence[bool], tasks: Sequence[asyncio.Task[Any]] | None,
            window: Window, now: float) -> list[RequestRecord]:
    """Copies of ``records`` as they stand at ``now``, phased by ``window``: a request not
    ``done`` is cut there (its chunks after ``now`` dropped; ``unfinished`` if a sample
    request, else ``cancelled``), so a look can be judged while the point goes on, or a
    finished run judged as it stood at an earlier look (the simulator). ``tasks``: the
    requests' tasks, to settle a done one that raised."""
    out = []
    for i, (r, is_done) in enumerate(zip(records, done)):
        c = copy.copy(r)
        c.chunk_times = [t for t in r.chunk_times if t <= now]
        c.phase = window.phase(r.scheduled_time)
        c.warmup = c.phase != "sample"
        if not is_done:
            mark_cancelled(c, now)
        elif tasks is not None:
            settle(tasks[i], c, now)
        out.append(c)
    return out


def goes_on(verdict: Verdict, arrival: ArrivalConfig) -> bool:
    """Whether a point judged ``verdict`` at a look that is not its last goes on to the
    next: when undecided, or passing where only a failure may end it (``extend_on_pass``)."""
    return verdict.state == UNDECIDED or (verdict.state == PASS and arrival.extend_on_pass)


def look_summary(verdict: Verdict, window: Window) -> dict[str, Any]:
    """One look of a point: its window, state, what was undecided and why it failed."""
    return {"window_end": window.end, "seconds": window.seconds, "state": verdict.state,
            "undecided": verdict.evidence.get("undecided", []), "reasons": verdict.reasons}
