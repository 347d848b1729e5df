"""One benchmark run: what stays fixed across its points, and what a point returns.

A :class:`Session` holds what stays fixed across the points of a sweep or a capacity search
(target, model, request mix, token counter); :func:`run_point` runs the mix on an arrival
schedule on the session's :class:`PointTarget` (the HTTP server, ``http_target``, or a
simulator standing in for it) and returns a :class:`PointResult`: the records, the summary
and the server's metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import aiohttp
import numpy as np

from inflight.bench.client import RequestRecord, auth_headers
from inflight.bench.datasets import DatasetConfig, RequestSpec, build_dataset, summarize_specs, trace_length
from inflight.bench.looks import goes_on, look_summary
from inflight.bench.lora_modules import adapter_counts
from inflight.bench.metrics_scrape import Snapshot, counter_deltas
from inflight.bench.prompts import TokenCounter
from inflight.bench.queue_trend import in_flight_at
from inflight.bench.summary import SLO
from inflight.bench.sustain import Thresholds, Verdict, Window, judge
from inflight.bench.user_figures import session_figures


@dataclass(frozen=True)
class LoadConfig:
    """How requests are sent (not when: see :class:`ArrivalConfig`). Times in seconds."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str | None = None  # completions | chat; None: chat for the chat dataset
    api_key: str | None = None
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float = 600.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    reset_prefix_cache: bool = False  # POST /reset_prefix_cache before each measured point
    scrape_metrics: bool = True
    metrics_interval: float = 1.0
    tokenize: str = "auto"  # auto | server | local | approx
    tokenizer: str | None = None
    progress: bool = True


@dataclass(frozen=True)
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
    # Closed loop (``bench.users``): this many concurrent sessions instead of an arrival
    # process (``rate`` and ``process`` unused); each turn is sent ``think_time`` s (mean,
    # ``think_distribution``: constant | exponential) after the previous answer ended; the
    # users start evenly over ``ramp_duration`` s (None: half the warm-up).
    users: int | None = None
    think_time: float = 0.0
    think_distribution: str = "constant"
    ramp_duration: float | None = None

    def describe(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["rate"] = "inf" if math.isinf(self.rate) else self.rate
        if self.users is None:
            for k in ("users", "think_time", "think_distribution", "ramp_duration"):
                d.pop(k)
        if self.duration is not None:
            d["warmup_duration"], d["drain_timeout"] = self.phases()
        return d

    def phases(self) -> tuple[float, float]:
        """(warm-up seconds, drain timeout seconds) of a windowed point. With users, the
        warm-up lasts at least the ramp and half a warm-up after it."""
        assert self.duration is not None
        warm = self.duration / 6 if self.warmup_duration is None else self.warmup_duration
        drain = self.duration / 2 if self.drain_timeout is None else self.drain_timeout
        if self.users is not None:
            warm = max(warm, self.ramp() + warm / 2)
        return warm, drain

    def ramp(self) -> float:
        """Seconds over which the users start: ``ramp_duration``, else half the warm-up."""
        if self.ramp_duration is not None:
            return self.ramp_duration
        warm = (self.duration or 0.0) / 6 if self.warmup_duration is None else self.warmup_duration
        return warm / 2


class PointTarget(Protocol):
    """What a session's points run on: the server over HTTP (``http_target.HttpTarget``) or
    a simulator standing in for it (``inflight.sim`` implements this; bench imports no
    simulator)."""

    def describe(self) -> dict[str, Any] | None:
        """The simulation's settings (profile, replicas, router, engine); None for a server."""

    def banner(self, session: Session) -> str:
        """The line said once the session is open: what runs the points, the mix prepared."""

    async def run_point(self, session: Session, arrival: ArrivalConfig, slo: SLO | None,
                        thresholds: Thresholds | None) -> PointResult:
        """The point ``arrival`` on this target (see :func:`run_point`)."""


@dataclass
class Session:
    """What stays fixed across a run's points. ``client``: the HTTP client of a server
    target; None for a simulated one."""

    target: PointTarget
    client: aiohttp.ClientSession | None
    load: LoadConfig
    dataset: DatasetConfig
    model: str
    endpoint: str
    tokenizer_mode: str
    specs: list[RequestSpec]
    warmups: list[RequestSpec]
    server_models: list[dict[str, Any]]
    server_info: dict[str, Any]
    prepare_seconds: float
    counter: TokenCounter | None = None
    warmed_up: bool = False
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

    @property
    def simulation(self) -> dict[str, Any] | None:
        """The simulation's settings, or None where a server runs the points."""
        return self.target.describe()

    def fixed(self) -> dict[str, Any]:
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
            # Requests of the mix per LoRA adapter (--lora-modules); None: all for the model.
            "lora_modules": adapter_counts(self.specs),
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
    summary: dict[str, Any]  # over the sample (the window's arrivals, or the whole mix)
    metrics_samples: list[dict[str, Any]]
    metrics_before: Snapshot | None
    metrics_after: Snapshot | None
    started_at: float  # time.time() at t = 0
    window: Window | None = None  # the look that decided the point (the last one run)
    looks: list[dict[str, Any]] = field(default_factory=list)  # the earlier looks' verdicts (look_summary)

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

    def rejudged(self, slo: SLO, thresholds: Thresholds) -> Verdict | None:
        """This point's verdict under another ``slo`` (``--slo-tiers``) where its looks
        suffice: it ran every look, or its last look decides ``slo``, so a point run for
        ``slo`` would have stopped there too; else None (measure it again)."""
        if len(self.looks) < self.arrival.max_extensions:
            assert self.window is not None
            view = judge(self.records, self.window, slo, self.preemptions, thresholds, self.metrics_samples,
                         final=False)
            if goes_on(view, self.arrival):
                return None
        return self.verdict(slo, thresholds)

    def timeline(self, samples: int = 400) -> dict[str, Any]:
        """The in-flight count (client side, at ``samples`` times) and scraped gauges."""
        end = max((r.end_time for r in self.records), default=0.0)
        step = max(end / samples, 0.01)
        ts = np.arange(0.0, end + step, step)
        q = in_flight_at(self.records, ts) if self.records else np.zeros_like(ts)
        w = self.window
        return {"t": [round(float(t), 3) for t in ts], "in_flight": [int(v) for v in q],
                "server": self.metrics_samples,
                "output_tokens": [r.output_tokens for r in self.records if r.phase == "sample" and r.success],
                "window": None if w is None else {"start": w.start, "end": w.end, "deadline": w.deadline}}

    def finish_summary(self) -> None:
        """Add what the server's metrics say to the summary: preemptions, and the growth of
        every server counter (prefix-cache hits, tokens, ...): the cache state a point ran
        under, recorded next to its latencies."""
        self.summary["preemptions"] = self.preemptions
        self.summary["server_counters"] = self.counters
        if any(r.user is not None for r in self.records):
            self.summary["users"] = session_figures(self.records, self.counters)


async def run_point(session: Session, arrival: ArrivalConfig, slo: SLO | None = None,
                    thresholds: Thresholds | None = None) -> PointResult:
    """Send the session's mix on ``arrival``'s schedule (``schedule.plan_point``) to its
    target; return every record, the summary over the sample, and the server's metrics.

    With ``arrival.max_extensions`` and aggregate SLOs, each window is judged as it ends
    (``sustain.judge(final=False)``, with ``thresholds``): an undecided point goes on to
    the next, longer window while arrivals continue (``http_target`` for how a server's
    point runs; a simulator replays the same schedule).
    """
    return await session.target.run_point(session, arrival, slo, thresholds)


def records_json(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    return [r.to_json() for r in records]
