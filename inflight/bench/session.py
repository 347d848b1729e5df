"""One benchmark run: prepare a request mix once, then replay it at a given load.

A :class:`Session` holds what stays fixed across the points of a sweep or a capacity search
(server, model, request mix, token counter); :func:`run_point` sends the mix on an arrival
schedule and returns the records, the summary and the scraped server metrics.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp

from inflight.bench.client import (HTTP_ERRORS, RequestRecord, auth_headers, build_payload, endpoint_path,
                                   post_json, stream_request)
from inflight.bench.conversations import ConversationLog
from inflight.bench.datasets import DatasetConfig, RequestSpec, build_dataset, summarize_specs, trace_length
from inflight.bench.metrics_scrape import Scraper, Snapshot, counter_deltas
from inflight.bench.prompts import MISSING_ROUTE, TokenCounter, make_counter
from inflight.bench.summary import SLO, summarize
from inflight.bench.schedule import plan_point
from inflight.bench.sustain import PASS, UNDECIDED, Thresholds, Verdict, Window, judge

logger = logging.getLogger(__name__)


@dataclass
class LoadConfig:
    """How requests are sent (not when: see :class:`ArrivalConfig`). Times in seconds."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str | None = None  # completions | chat; None: chat for the chat dataset
    api_key: str | None = None
    temperature: float | None = 0.0
    extra_body: dict = field(default_factory=dict)
    request_timeout: float = 600.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    reset_prefix_cache: bool = False  # POST /reset_prefix_cache before each measured point
    scrape_metrics: bool = True
    metrics_interval: float = 1.0
    tokenize: str = "auto"  # auto | server | local | approx
    tokenizer: str | None = None
    progress: bool = True


@dataclass
class ArrivalConfig:
    """When requests are sent: a process and its rate, or the trace's times scaled; and,
    with ``duration``, the measurement window of a steady-state point (see ``run_point``)."""

    process: str = "poisson"  # poisson | gamma | constant | trace
    rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    time_scale: float = 1.0  # trace only
    seed: int = 0
    duration: float | None = None  # window (s); None: the mix's requests, sent once, are the sample
    warmup_duration: float | None = None  # s of uncounted arrivals before the window; None: duration / 6
    drain_timeout: float | None = None  # s after the window for the sample to end; None: duration / 2
    min_requests: int = 0  # the window stretches until at least this many requests arrived in it
    max_extensions: int = 0  # an undecided point's window grows by its span up to this many times
    extend_on_pass: bool = False  # a passing look goes on too: only a failure ends it early (a hold)

    def describe(self) -> dict:
        d = dict(self.__dict__)
        d["rate"] = "inf" if math.isinf(self.rate) else self.rate
        if self.duration is not None:
            d["warmup_duration"], d["drain_timeout"] = self.phases()
        return d

    def phases(self) -> tuple[float, float]:
        """(warm-up seconds, drain timeout seconds) of a windowed point."""
        assert self.duration is not None
        warm = self.duration / 6 if self.warmup_duration is None else self.warmup_duration
        drain = self.duration / 2 if self.drain_timeout is None else self.drain_timeout
        return warm, drain


@dataclass
class Session:
    """What stays fixed across a run's points. ``simulation``: a ``sim.bench.SimSetup``
    when the points are simulated (``--simulate``; ``client`` is then None)."""

    client: aiohttp.ClientSession
    load: LoadConfig
    dataset: DatasetConfig
    model: str
    endpoint: str
    tokenizer_mode: str
    specs: list[RequestSpec]
    warmups: list[RequestSpec]
    server_models: list[dict]
    server_info: dict
    prepare_seconds: float
    counter: TokenCounter | None = None
    warmed_up: bool = False
    simulation: Any = None
    # Optional routes the server lacks, skipped ("tokenize: HTTP 404", "reset_prefix_cache:
    # HTTP 404", "metrics: HTTP 501"): the run goes on without them (open_session).
    skipped: list[str] = field(default_factory=list)

    async def ensure_specs(self, n: int) -> int:
        """Extend the mix to at least ``n`` requests (new ones continue the dataset's
        stream); returns how many there are, fewer only where a trace runs out."""
        have = len(self.specs)
        if n <= have:
            return have
        start = len(self.warmups) + have
        room = trace_length(self.dataset)
        want = n - have if room is None else min(n - have, room - start)
        if want > 0:
            if self.counter is None:
                raise RuntimeError("this session cannot extend its request mix (no token counter)")
            self.specs += await build_dataset(self.dataset, self.counter, want, start=start)
        return len(self.specs)

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.load.api_key)

    def fixed(self) -> dict:
        """What must stay the same for two results to be compared fairly."""
        return {
            "model": self.model,
            "simulated": self.simulation is not None,
            "endpoint": self.endpoint,
            "server_models": self.server_models,
            "server_info": self.server_info,
            "dataset": self.dataset.describe(),
            "lengths": summarize_specs(self.specs),
            "tokenizer": self.tokenizer_mode,
            "skipped": list(self.skipped),
            "temperature": self.load.temperature,
            "extra_body": self.load.extra_body,
            "length_samples": {"prompt_len": [s.prompt_len for s in self.specs],
                               "max_tokens": [s.output_len for s in self.specs]},
            "cache_state": {"warmup_requests": len(self.warmups),
                            "reset_prefix_cache": self.load.reset_prefix_cache,
                            "shared_prefix_tokens": self.dataset.prefix_len
                            if self.dataset.name in ("random", "sonnet") else None,
                            "trace_prefix_blocks": self.dataset.prefix_blocks
                            if self.dataset.name == "trace" else None},
        }


@dataclass
class PointResult:
    arrival: ArrivalConfig
    records: list[RequestRecord]  # every request sent in the point, all phases
    summary: dict  # over the sample (the window's arrivals, or the whole mix)
    metrics_samples: list[dict]
    metrics_before: Snapshot | None
    metrics_after: Snapshot | None
    started_at: float  # time.time() at t = 0
    window: Window | None = None  # the look that decided the point (the last one run)
    looks: list[dict] = field(default_factory=list)  # the earlier looks' verdicts (look_summary)

    @property
    def counters(self) -> dict[str, float]:
        return counter_deltas(self.metrics_before, self.metrics_after)

    @property
    def preemptions(self) -> float | None:
        if self.metrics_before is None or self.metrics_after is None:
            return None
        b, a = self.metrics_before.get("preemptions"), self.metrics_after.get("preemptions")
        return None if a is None or b is None else a - b

    def verdict(self, slo: SLO, thresholds: Thresholds | None = None) -> Verdict:
        """Whether this windowed point's load was sustained within ``slo`` (sustain.judge)."""
        if self.window is None:
            raise ValueError("a point without a measurement window (--duration) has no verdict")
        verdict = judge(self.records, self.window, slo, self.preemptions, thresholds, self.metrics_samples)
        verdict.evidence["looks"] = [*self.looks, look_summary(verdict, self.window)]
        return verdict


async def _server_models(client: aiohttp.ClientSession, base_url: str, headers: dict) -> list[dict]:
    try:
        async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers,
                              timeout=aiohttp.ClientTimeout(total=30.0)) as resp:
            resp.raise_for_status()
            return list((await resp.json(content_type=None)).get("data") or [])
    except aiohttp.ClientConnectorError as e:
        raise RuntimeError(f"cannot connect to {base_url}: {e}; is the server running "
                           f"(see --base-url)?") from None
    except (*HTTP_ERRORS, ValueError, AttributeError):
        return []


async def open_session(load: LoadConfig, dataset: DatasetConfig, client: aiohttp.ClientSession) -> Session:
    """Ask the server what it serves, pick the token counter, build the request mix.

    Routes beyond the OpenAI API are optional: a server without ``/tokenize`` (or with
    another body than vLLM's and llama.cpp's) gets prompts counted by ``--tokenizer``, else
    approximately (whitespace words); without ``/metrics``, no server gauges. What was
    skipped goes in ``Session.skipped`` (and ``fixed()``), said in one warning line.
    (``/reset_prefix_cache`` is found missing at the first point: ``reset_prefix_cache``.)
    ``client`` (see :func:`inflight.bench.client.make_client`) stays the caller's to close.
    """
    t = time.perf_counter()
    headers = auth_headers(load.api_key)
    models = await _server_models(client, load.base_url, headers)
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
    session = Session(client=client, load=load, dataset=dataset, model=model, endpoint=endpoint,
                      tokenizer_mode="none" if dataset.name == "chat" else counter.mode,
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


async def _send(session: Session, spec: RequestSpec, record: RequestRecord, clock) -> RequestRecord:
    url = session.load.base_url.rstrip("/") + endpoint_path(session.endpoint)
    payload = build_payload(spec, session.endpoint, session.model, session.load.temperature,
                            session.load.extra_body)
    record.prompt_len, record.output_len = spec.prompt_len, spec.output_len
    await stream_request(session.client, url, payload, record, session.headers,
                         session.load.request_timeout, clock)
    if record.connection_retries:
        # Counted (summary "connection_retries"), not a failure; said as it happens too.
        logger.warning("request %d sent again on a new connection: the first failed before the server "
                       "answered%s", record.index, f" (then: {record.error})" if record.error else "")
    return record


async def warm_up(session: Session) -> None:
    """Send the warm-up requests (not counted) once per session, all at once."""
    if session.warmed_up or not session.warmups:
        session.warmed_up = True
        return
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    await asyncio.gather(*(_send(session, s, RequestRecord(i, 0.0, warmup=True, phase="session-warmup"), clock)
                           for i, s in enumerate(session.warmups)))
    session.warmed_up = True


async def reset_prefix_cache(session: Session) -> bool:
    """``POST /reset_prefix_cache`` (inflight's and vLLM's route) so the point starts with a
    cold prefix cache. Returns False where it was not reset. A server without the route
    (404, 405, 501, or no connection for it) has it skipped from then on: recorded in
    ``session.skipped`` and said in one warning. Another failure warns each time."""
    entry = "reset_prefix_cache:"
    if any(s.startswith(entry) for s in session.skipped):
        return False
    url = session.load.base_url.rstrip("/") + "/reset_prefix_cache"
    try:
        status, _ = await post_json(session.client, url, None, session.headers)
    except HTTP_ERRORS as e:
        # No connection for the route (refused, or closed twice before an answer) is a
        # missing route; a timeout is a busy server.
        why = f"{type(e).__name__}: {e}"
        missing = isinstance(e, aiohttp.ClientConnectionError) and not isinstance(e, TimeoutError)
    else:
        if status == 200:
            return True
        why, missing = f"HTTP {status}", status in MISSING_ROUTE
    if not missing:
        logger.warning("reset_prefix_cache: the server answered %s; the prefix cache was not reset", why)
        return False
    session.skipped.append(f"{entry} {why}")
    logger.warning("%s lacks /reset_prefix_cache (%s); skipped from now on: the prefix cache is not reset "
                   "between points", session.load.base_url, why)
    return False


async def wait_idle(session: Session, timeout: float = 30.0) -> None:
    """Wait (bounded) until the server reports nothing running or waiting: from its
    Prometheus gauges, else from llama-server's ``GET /slots`` (a slot ``is_processing``),
    else not at all."""
    deadline = time.perf_counter() + timeout
    scraper = Scraper(session.client, session.load.base_url, session.headers)
    while time.perf_counter() < deadline:
        snap = await scraper.scrape() if session.load.scrape_metrics else None
        if snap is not None:
            busy = bool(snap.get("running") or snap.get("waiting"))
        else:
            slots = await _slots_busy(session)
            if slots is None:
                return
            busy = slots
        if not busy:
            return
        await asyncio.sleep(0.2)


async def _slots_busy(session: Session) -> bool | None:
    """Whether any of llama-server's slots is processing (``GET /slots``); None where the
    server has no such route."""
    try:
        async with session.client.get(session.load.base_url.rstrip("/") + "/slots", headers=session.headers,
                                      timeout=aiohttp.ClientTimeout(total=10.0)) as r:
            if r.status != 200:
                return None
            slots = await r.json(content_type=None)
    except (*HTTP_ERRORS, ValueError):
        return None
    if not isinstance(slots, list):
        return None
    return any(isinstance(s, dict) and s.get("is_processing") for s in slots)


def mark_cancelled(record: RequestRecord, now: float) -> None:
    record.end_time, record.success = now, False
    record.unfinished = record.phase == "sample"
    record.cancelled = not record.unfinished
    record.error = ("unfinished when the point ended" if record.unfinished
                    else "cancelled after the sample ended")
    if record.send_time == 0.0 and not record.chunk_times:
        record.send_time = record.end_time


def _settle(task: asyncio.Task, record: RequestRecord, now: float) -> None:
    """Give an ended request task's record its outcome: cancelled at the point's end
    (``now``), whether or not it had started (a cool-down request created just as the point
    ends never runs a line), or ended by an unexpected exception."""
    if task.cancelled():
        mark_cancelled(record, now)
    elif task.exception() is not None and record.error is None:
        e = task.exception()
        record.success, record.end_time = False, record.end_time or now
        record.error = f"{type(e).__name__}: {e}"


async def run_point(session: Session, arrival: ArrivalConfig, slo: SLO | None = None,
                    thresholds: Thresholds | None = None) -> PointResult:
    """Send the session's mix on ``arrival``'s schedule (``plan_point``); return every
    record, the summary over the sample, and the scraped server metrics.

    Requests are sent at their offsets (the first at t = 0) and wait for a slot under
    ``max_concurrency``; each is bounded by ``request_timeout``. Without a window every
    request runs to its end. With one, cool-down arrivals keep the load on until every
    sample request has ended; then the cool-down requests still running are cancelled
    (``cancelled``: the client disconnects, so the server aborts them). Sample requests
    still running at the window's deadline are cancelled too and marked ``unfinished``.
    With ``arrival.max_extensions`` and aggregate SLOs, each window is judged as it ends
    (``sustain.judge(final=False)``, with ``thresholds``): an undecided point goes on to
    the next, longer window while arrivals continue; the point ends at the first decided
    look or the last, and its records are phased by that look's window
    (``PointResult.looks`` has every look's verdict).
    A simulated session (``--simulate``) replays the same schedule on the simulator.
    """
    if session.simulation is not None:
        from inflight.sim.bench import simulate_point
        return await simulate_point(session, arrival, slo, thresholds)
    await warm_up(session)
    await wait_idle(session)
    if session.load.reset_prefix_cache:
        await reset_prefix_cache(session)
    slots, window = await plan_point(session, arrival)
    scraper = Scraper(session.client, session.load.base_url, session.headers)
    before = await scraper.scrape() if session.load.scrape_metrics else None
    sem = asyncio.Semaphore(session.load.max_concurrency) if session.load.max_concurrency else None
    first_end = window.end if window is not None else math.inf
    bar = _progress(sum(1 for s in slots if s.phase == "sample" and s.offset < first_end), session.load.progress)
    stop = asyncio.Event()
    started_at, t0 = time.time(), time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    scrape_task = (asyncio.create_task(scraper.run(stop, session.load.metrics_interval, t0))
                   if before is not None else None)

    conversations = ConversationLog()

    async def one(record: RequestRecord, spec: RequestSpec) -> RequestRecord:
        # Cancelled by the point's end (ours, not the caller's), a task just stops: _settle
        # gives its record the outcome. A follow-up turn first waits for its previous
        # turn's answer, holding no concurrency slot.
        sent, turn = await conversations.prepare(spec)
        try:
            if sem is None:
                await _send(session, sent, record, clock)
            else:
                async with sem:
                    await _send(session, sent, record, clock)
        finally:
            conversations.finish(turn, record.generated_text)
        if bar is not None and record.phase == "sample" and record.scheduled_time < first_end:
            bar.update(1)
        return record

    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []  # every request's, in step with records
    looks = window.looks() if window is not None else []
    longest = looks[-1] if looks else None
    sent_past = [asyncio.Event() for _ in looks]  # every arrival before look k's end was sent

    async def sender() -> None:
        try:
            for i, slot in enumerate(slots):
                for k, w in enumerate(looks):
                    if slot.offset >= w.end:
                        sent_past[k].set()
                delay = slot.offset - clock()
                if slot.phase == "cooldown" and _all_done(tasks, records, longest):
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                record = RequestRecord(i, slot.offset, warmup=slot.phase != "sample", phase=slot.phase)
                records.append(record)
                tasks.append(asyncio.create_task(one(record, slot.spec)))
        finally:
            for e in sent_past:  # whatever ends the sender, no look may wait forever
                e.set()

    send_task = asyncio.create_task(sender())
    history: list[dict] = []
    if window is None:
        await send_task
        await asyncio.gather(*tasks)
        ended = clock()
    else:
        for k, w in enumerate(looks):
            await sent_past[k].wait()
            sample = [t for t, r in zip(tasks, records) if w.start <= r.scheduled_time < w.end]
            left = w.deadline - clock()
            if sample and left > 0:
                await asyncio.wait(sample, timeout=left)
            window = w
            if k == len(looks) - 1 or slo is None or not slo.aggregate:
                break
            now = clock()
            view = view_at(records, [t.done() for t in tasks], tasks, w, now)
            verdict = judge(view, w, slo, None, thresholds, scraper.samples, final=False)
            if not goes_on(verdict, arrival):
                break
            history.append(look_summary(verdict, w))
            if verdict.state == UNDECIDED:
                logger.info("undecided after a %.0f s window (%s): extending", w.seconds,
                            ", ".join(verdict.evidence["undecided"]))
        ended = clock()
        send_task.cancel()
        for t in tasks:
            t.cancel()  # a no-op on finished tasks; cancels the unfinished and the cool-down
        await asyncio.gather(send_task, *tasks, return_exceptions=True)
        for r in records:
            r.phase = window.phase(r.scheduled_time)
            r.warmup = r.phase != "sample"
    for task, record in zip(tasks, records):
        _settle(task, record, ended)
    stop.set()
    if scrape_task is not None:
        await scrape_task
    after = await scraper.scrape() if before is not None else None
    if bar is not None:
        bar.close()
    records.sort(key=lambda r: r.index)
    summary = summarize(records, slo)
    result = PointResult(arrival, records, summary, scraper.samples, before, after, started_at, window,
                         history)
    summary["preemptions"] = result.preemptions
    # Growth of every server counter (prefix-cache hits, tokens, ...): the cache state a
    # point ran under, recorded next to its latencies.
    summary["server_counters"] = result.counters
    return result


def view_at(records: Sequence[RequestRecord], done: Sequence[bool], tasks: Sequence[asyncio.Task] | None,
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
            _settle(tasks[i], c, now)
        out.append(c)
    return out


def goes_on(verdict: Verdict, arrival: ArrivalConfig) -> bool:
    """Whether a point judged ``verdict`` at a look that is not its last goes on to the
    next: when undecided, or passing where only a failure may end it (``extend_on_pass``)."""
    return verdict.state == UNDECIDED or (verdict.state == PASS and arrival.extend_on_pass)


def look_summary(verdict: Verdict, window: Window) -> dict:
    """One look of a point: its window, state, what was undecided and why it failed."""
    return {"window_end": window.end, "seconds": window.seconds, "state": verdict.state,
            "undecided": verdict.evidence.get("undecided", []), "reasons": verdict.reasons}


def _all_done(tasks: Sequence[asyncio.Task], records: Sequence[RequestRecord], window: Window | None) -> bool:
    """Every sample request of ``window`` has been sent and has ended."""
    sample = [t for t, r in zip(tasks, records) if window is not None and window.phase(r.scheduled_time) == "sample"]
    return bool(sample) and all(t.done() for t in sample)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="requests", unit="req", leave=False)


def records_json(records: Sequence[RequestRecord]) -> list[dict]:
    return [r.to_json() for r in records]
