"""The server as a session's target: a session opened over HTTP, and a point measured on it.

:func:`open_session` asks the server what it serves and builds the request mix;
:class:`HttpTarget` runs a point: every request of its schedule streamed at its offset,
the server's ``/metrics`` scraped meanwhile, and, with a measurement window, its looks
judged as they end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Sequence

import aiohttp

from inflight.bench.client import RequestRecord, auth_headers
from inflight.bench.conversations import ConversationLog
from inflight.bench.datasets import DatasetConfig, RequestSpec, build_dataset
from inflight.bench.looks import goes_on, look_summary, settle, view_at
from inflight.bench.metrics_scrape import Scraper
from inflight.bench.prompts import make_counter
from inflight.bench.schedule import Slot, plan_point, plan_users
from inflight.bench.server_routes import (http_client, reset_prefix_cache, send_request, server_models, wait_idle,
                                          warm_up)
from inflight.bench.session import ArrivalConfig, LoadConfig, PointResult, Session
from inflight.bench.summary import SLO, summarize
from inflight.bench.sustain import UNDECIDED, Thresholds, Window, judge
from inflight.bench.user_load import UserLoad
from inflight.bench.users import ConversationSupply

logger = logging.getLogger(__name__)


class HttpTarget:
    """A server reached over HTTP at the session's ``--base-url``."""

    def describe(self) -> dict[str, Any] | None:
        return None

    def banner(self, session: Session) -> str:
        lora = session.dataset.lora_modules
        adapters = f", LoRA adapters {', '.join(lora)}" if lora else ""
        return (f"model {session.model}{adapters} at {session.load.base_url} ({session.endpoint}); "
                f"{len(session.specs)} requests prepared in {session.prepare_seconds:.1f} s "
                f"(tokenizer: {session.tokenizer_mode})")

    async def run_point(self, session: Session, arrival: ArrivalConfig, slo: SLO | None,
                        thresholds: Thresholds | None) -> PointResult:
        """Requests are sent at their offsets (the first at t = 0) and wait for a slot under
        ``max_concurrency``; each is bounded by ``request_timeout``. Without a window every
        request runs to its end. With one, cool-down arrivals keep the load on until every
        sample request has ended; then the cool-down requests still running are cancelled
        (``cancelled``: the client disconnects, so the server aborts them). Sample requests
        still running at the window's deadline are cancelled too and marked ``unfinished``.
        An undecided look goes on to the next, longer window; the point ends at the first
        decided look or the last, its records phased by that look's window
        (``PointResult.looks`` has every earlier look's verdict)."""
        await warm_up(session)
        await wait_idle(session)
        if session.load.reset_prefix_cache:
            await reset_prefix_cache(session)
        if arrival.users:
            return await _PointRun(session, [], plan_users(arrival), slo, thresholds, arrival).run()
        slots, window = await plan_point(session, arrival)
        return await _PointRun(session, slots, window, slo, thresholds, arrival).run()


async def open_session(load: LoadConfig, dataset: DatasetConfig, client: aiohttp.ClientSession) -> Session:
    """Ask the server what it serves, pick the token counter, build the request mix.

    Routes beyond the OpenAI API are optional: a server without ``/tokenize`` (or with
    another body than vLLM's and llama.cpp's) gets prompts counted by ``--tokenizer``, else
    approximately (whitespace words); without ``/metrics``, no server gauges. What was
    skipped goes in ``Session.skipped`` (and ``fixed()``), said in one warning line.
    (``/reset_prefix_cache`` is found missing at the first point: ``reset_prefix_cache``.)
    ``client`` (see :func:`inflight.bench.client.make_client`) stays the caller's to close.
    RuntimeError: no connection, or no model to send.
    """
    t = time.perf_counter()
    headers = auth_headers(load.api_key)
    models = await server_models(client, load.base_url, headers)
    model = load.model or (models[0].get("id") if models else None)
    if not model:
        raise RuntimeError(f"no --model given and {load.base_url}/v1/models lists none")
    endpoint = load.endpoint or ("chat" if dataset.name == "chat" else "completions")
    skipped: list[str] = []
    counter = await make_counter(load.tokenize if dataset.name != "chat" else "approx", client,
                                 load.base_url, model, load.tokenizer, headers, skipped)
    all_specs = await build_dataset(dataset, counter, dataset.num_prompts + load.num_warmups)
    scraper = Scraper(client, load.base_url, headers)
    info = (await scraper.scrape()) if load.scrape_metrics else None
    if load.scrape_metrics and info is None:
        skipped.append(f"metrics: {scraper.why_not}")
    session = Session(target=HttpTarget(), client=client, load=load, dataset=dataset, model=model,
                      endpoint=endpoint, tokenizer_mode="none" if dataset.name == "chat" else counter.mode,
                      specs=all_specs[load.num_warmups:], warmups=all_specs[: load.num_warmups],
                      server_models=models, server_info=info.info if info else {},
                      prepare_seconds=time.perf_counter() - t, counter=counter, skipped=skipped)
    if session.skipped:
        logger.warning("%s lacks routes beyond the OpenAI API; skipped: %s", load.base_url,
                       "; ".join(_skip_note(s, session) for s in session.skipped))
    return session


def _skip_note(skipped: str, session: Session) -> str:
    """One ``Session.skipped`` entry, and what the run does without the route."""
    if skipped.startswith("tokenize:"):
        how = ("prompt lengths counted by --tokenizer" if session.tokenizer_mode == "local"
               else "prompt lengths approximate (whitespace words; --tokenizer PATH makes them exact)")
    else:
        how = ("no server-side queue, KV-cache or preemption figures, and no wait for the server to be idle "
               "before a point")
    return f"/{skipped} ({how})"


class _PointRun:
    """One measured point in flight: its sender, its requests' tasks, its looks."""

    def __init__(self, session: Session, slots: list[Slot], window: Window | None, slo: SLO | None,
                 thresholds: Thresholds | None, arrival: ArrivalConfig) -> None:
        self.session, self.slots, self.window = session, slots, window
        self.slo, self.thresholds, self.arrival = slo, thresholds, arrival
        load = session.load
        self.scraper = Scraper(http_client(session), load.base_url, session.headers)
        self.sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        self.first_end = window.end if window is not None else math.inf
        self.looks = window.looks() if window is not None else []
        self.sent_past = [asyncio.Event() for _ in self.looks]  # every arrival before look k's end was sent
        self.records: list[RequestRecord] = []
        self.tasks: list[asyncio.Task[RequestRecord]] = []  # every request's, in step with records
        self.conversations = ConversationLog()
        self.bar: Any = None
        self.t0 = time.perf_counter()
        # Closed loop: users send, each turn after the last answer, carrying its history.
        self.users = (UserLoad(arrival, ConversationSupply(session), self.looks, arrival.min_requests, self.clock,
                               self.launch) if arrival.users else None)

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self) -> PointResult:
        load = self.session.load
        before = await self.scraper.scrape() if load.scrape_metrics else None
        total = sum(1 for s in self.slots if s.phase == "sample" and s.offset < self.first_end)
        self.bar = _progress(None if self.users else total, load.progress)
        stop = asyncio.Event()
        started_at, self.t0 = time.time(), time.perf_counter()
        scrape_task = (asyncio.create_task(self.scraper.run(stop, load.metrics_interval, self.t0))
                       if before is not None else None)
        send_task = asyncio.create_task(self.sender())
        history: list[dict[str, Any]] = []
        if self.window is None:
            await send_task
            await asyncio.gather(*self.tasks)
            ended = self.clock()
        else:
            ended = await self.watch(send_task, history)
        for task, record in zip(self.tasks, self.records):
            settle(task, record, ended)
        stop.set()
        if scrape_task is not None:
            await scrape_task
        after = await self.scraper.scrape() if before is not None else None
        if self.bar is not None:
            self.bar.close()
        self.records.sort(key=lambda r: r.index)
        result = PointResult(self.arrival, self.records, summarize(self.records, self.slo), self.scraper.samples,
                             before, after, started_at, self.window, history)
        result.finish_summary()
        return result

    def launch(self, record: RequestRecord, spec: RequestSpec) -> asyncio.Task[RequestRecord]:
        """Send ``spec`` now as ``record`` (a user's turn, its history in it)."""
        self.records.append(record)
        self.tasks.append(asyncio.create_task(self.one(record, spec)))
        return self.tasks[-1]

    async def one(self, record: RequestRecord, spec: RequestSpec) -> RequestRecord:
        # Cancelled by the point's end (ours, not the caller's), a task just stops: settle
        # gives its record the outcome. A follow-up turn of an open-loop replay first waits
        # for its previous turn's answer, holding no concurrency slot (users wait themselves).
        sent, turn = (spec, None) if self.users else await self.conversations.prepare(spec)
        try:
            if self.sem is None:
                await send_request(self.session, sent, record, self.clock)
            else:
                async with self.sem:
                    await send_request(self.session, sent, record, self.clock)
        finally:
            self.conversations.finish(turn, record.generated_text)
        if self.bar is not None and record.phase == "sample" and record.scheduled_time < self.first_end:
            self.bar.update(1)
        return record

    async def sender(self) -> None:
        if self.users is not None:
            return await self.users.run(self.sent_past)
        longest = self.looks[-1] if self.looks else None
        try:
            for i, slot in enumerate(self.slots):
                for k, w in enumerate(self.looks):
                    if slot.offset >= w.end:
                        self.sent_past[k].set()
                delay = slot.offset - self.clock()
                if slot.phase == "cooldown" and _all_done(self.tasks, self.records, longest):
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                record = RequestRecord(i, slot.offset, warmup=slot.phase != "sample", phase=slot.phase)
                self.records.append(record)
                self.tasks.append(asyncio.create_task(self.one(record, slot.spec)))
        finally:
            for e in self.sent_past:  # whatever ends the sender, no look may wait forever
                e.set()

    async def watch(self, send_task: asyncio.Task[None], history: list[dict[str, Any]]) -> float:
        """Take the looks in turn until one decides the point (or the last); cancel what is
        still running; phase the records by that look's window. Returns the end time (s)."""
        for k in range(len(self.looks)):
            waiter = asyncio.create_task(self.sent_past[k].wait())
            await asyncio.wait({waiter, send_task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if send_task.done() and not send_task.cancelled() and send_task.exception() is not None:
                break  # raised below
            w = self.looks[k]  # users resolve the looks as the point runs
            sample = [t for t, r in zip(self.tasks, self.records) if w.start <= r.scheduled_time < w.end]
            left = w.deadline - self.clock()
            if sample and left > 0:
                await asyncio.wait(sample, timeout=left)
            self.window = w
            if k == len(self.looks) - 1 or self.slo is None or not self.slo.aggregate:
                break
            view = view_at(self.records, [t.done() for t in self.tasks], self.tasks, w, self.clock())
            verdict = judge(view, w, self.slo, None, self.thresholds, self.scraper.samples, final=False)
            if not goes_on(verdict, self.arrival):
                break
            history.append(look_summary(verdict, w))
            if verdict.state == UNDECIDED:
                logger.info("undecided after a %.0f s window (%s): extending", w.seconds,
                            ", ".join(verdict.evidence["undecided"]))
        ended = self.clock()
        send_task.cancel()
        for t in self.tasks:
            t.cancel()  # a no-op on finished tasks; cancels the unfinished and the cool-down
        sent = await asyncio.gather(send_task, *self.tasks, return_exceptions=True)
        if isinstance(sent[0], Exception):  # the sender failed (a user's turn could not be built): say so
            raise sent[0]
        assert self.window is not None
        for r in self.records:
            r.phase = self.window.phase(r.scheduled_time)
            r.warmup = r.phase != "sample"
        return ended


def _all_done(tasks: Sequence[asyncio.Task[RequestRecord]], records: Sequence[RequestRecord],
              window: Window | None) -> bool:
    """Every sample request of ``window`` has been sent and has ended."""
    sample = [t for t, r in zip(tasks, records) if window is not None and window.phase(r.scheduled_time) == "sample"]
    return bool(sample) and all(t.done() for t in sample)


def _progress(total: int | None, enabled: bool) -> Any:
    """The requests' progress bar, on a terminal only: ``disable=None`` is tqdm's "off
    where stderr is not a TTY", so a log file gets no thousands of bar updates."""
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req", leave=False, disable=None)
