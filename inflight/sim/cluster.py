"""The discrete-event simulator: real engines on a virtual clock. Torch-free.

Each replica is a real :class:`inflight.engine.Engine` (its ``Scheduler``,
``KVCacheManager`` and ``OutputProcessor``) whose runner computes nothing: it advances the
replica's virtual clock by the profile's step time (:mod:`inflight.sim.profile`) and
returns a token per sampling row, the end-of-sequence token once a request reaches its
dataset length (unless it ignores EOS, then ``max_tokens`` ends it). So every scheduling
decision is the engine's own (admission, chunking, preemption, prefix hits, shedding,
priorities, batching policy) and only durations are modelled.

Events, in time order: a request arrives (the server's admission bound may refuse it with
a 503 at once), reaches its replica's queue ``request_overhead_s`` later (HTTP, template,
tokenizer), and each replica steps back to back while it has work, as the server's engine
thread does (a step that schedules nothing waits the thread's idle poll). A step's tokens
reach the client ``delivery_s`` after it ends. Requests arriving during a step join the
next one. The router sees what each replica reported at its last step's end.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inflight.config import EngineConfig
from inflight.core.output import SampleResult, SchedulerOutput
from inflight.engine.async_engine import IDLE_POLL_S, has_room
from inflight.engine.engine import Engine
from inflight.routing import ReplicaLoad, Router, RoundRobinRouter
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from inflight.sim.profile import StepProfile, StepShape


class VirtualClock:
    """A clock the simulation sets; ``clock()`` reads it (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimRunner:
    """The ``Runner`` of a simulated replica: each ``execute`` advances ``clock`` by the
    profile's time for the step's shape and samples placeholder tokens.

    Args:
        profile: the step-time profile.
        clock: the replica's clock.
        eos_token_id: returned when a request reaches its target length.
        filler_token_id: every other sampled token (not an EOS or stop id).
        rng: draws the measured steps' variation (``FittedCostModel.sample``); None: every
            step takes the predicted time.
    """

    def __init__(self, profile: StepProfile, clock: VirtualClock, eos_token_id: int,
                 filler_token_id: int, rng: np.random.Generator | None = None) -> None:
        self.profile, self.clock, self.rng = profile, clock, rng
        sample = getattr(profile.cost, "sample", None)
        self._sample = sample if rng is not None and sample is not None else None
        self.eos_token_id, self.filler_token_id = eos_token_id, filler_token_id
        self.targets: dict[str, int] = {}  # request id -> output length ended by EOS
        self.error: Exception | None = None
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_extrapolated = 0  # steps larger than any the profile measured
        self._in_range = getattr(profile.cost, "in_range", None)

    def execute(self, out: SchedulerOutput) -> list[SampleResult]:
        shape = StepShape.of(out.scheduled)
        try:
            seconds = self._sample(shape, self.rng) if self._sample else self.profile.predict(shape)
        except Exception as e:  # the engine would fail the step's requests: a bad profile is ours
            self.error = e
            raise
        self.clock.now += seconds
        self.num_steps += 1
        if self._in_range is not None and not self._in_range(shape):
            self.num_extrapolated += 1
        self.busy_s += seconds
        results = []
        for s in out.scheduled:
            if not s.samples:
                continue
            req = s.request
            target = self.targets.get(req.request_id)
            eos = target is not None and req.num_output_tokens + 1 >= target
            results.append(SampleResult(req, self.eos_token_id if eos else self.filler_token_id, None))
        return results

    def release(self, request_id: str) -> None:
        self.targets.pop(request_id, None)


@dataclass
class SimRequest:
    """One request to simulate. Times in seconds on the simulation's clock.

    Attributes:
        output_len: tokens it generates: EOS after this many (``max_tokens`` caps it), or
            exactly ``max_tokens`` with ``ignore_eos``.
        not_after: it is not sent if every watched request has ended by its arrival (a
            windowed point's cool-down arrivals).
        tenant: who sends it (``RequestOptions.tenant``: the ``fair`` policy's tenant).
    """

    index: int
    arrival: float
    prompt_token_ids: list[int]
    max_tokens: int
    output_len: int
    ignore_eos: bool = True
    watched: bool = False
    not_after_done: bool = False
    tenant: str | None = None


@dataclass
class SimOutcome:
    """What happened to one request (times on the simulation's clock)."""

    index: int
    sent: bool = False
    send_time: float = 0.0
    replica: int | None = None
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    status: int | None = None  # HTTP status: 200, or 503 when admission refused it
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class SimRun:
    outcomes: list[SimOutcome]
    end_time: float  # when the simulation stopped
    samples: list[dict[str, Any]]  # {"t", waiting, running, kv_cache_usage, preemptions}, every interval
    counters: dict[str, float]  # the servers' counters (Prometheus names), summed over replicas
    replicas: list[dict[str, Any]]
    router: dict[str, Any]


class SimReplica:
    """One engine on its own virtual clock."""

    def __init__(self, index: int, config: EngineConfig, profile: StepProfile, num_blocks: int,
                 max_model_len: int, eos_token_ids: Sequence[int], max_num_waiting: int | None,
                 rng: np.random.Generator | None = None) -> None:
        self.index = index
        self.clock = VirtualClock()
        eos = sorted(eos_token_ids) or [0]
        filler = next(t for t in itertools.count() if t not in eos)
        self.runner = SimRunner(profile, self.clock, eos[0], filler, rng)
        self.engine = Engine(config, runner=self.runner, tokenizer=None, num_blocks=num_blocks,
                             max_model_len=max_model_len, eos_token_ids=eos, clock=self.clock)
        self.max_num_waiting = max_num_waiting
        self.busy = False
        self.pending = 0  # arrived and admitted, not yet in the engine's queue
        self.load = ReplicaLoad()

    def publish(self) -> None:
        s = self.engine.get_stats()
        self.load = ReplicaLoad(s.num_running, s.num_waiting + self.pending, s.kv_cache_usage)

    def admits(self, n: int = 1) -> bool:
        """The server's admission bound (``async_engine.has_room``) on the last report."""
        return has_room(n, self.load.num_waiting, self.load.num_running, self.engine.config.max_num_seqs,
                        self.max_num_waiting)


class Simulator:
    """N simulated replicas behind a router.

    Args:
        config: the engine settings of every replica.
        profile: the step-time profile.
        num_blocks: KV blocks per replica.
        max_model_len: context length.
        eos_token_ids: the model's end-of-sequence ids.
        replicas: engine replicas.
        router: routing policy (``inflight.routing``); round robin when None.
        max_num_waiting: the server's admission bound per replica (None: unbounded).
        max_concurrency: the client's bound on requests in flight (None: unbounded).
        metrics_interval: seconds between gauge samples (as ``bench``'s scraper).
        noise: replay the profile's measured step-time variation, drawn from ``seed``
            (False: every step takes its predicted time).
        seed: the noise's seed; the same seed gives the same run.
    """

    def __init__(self, config: EngineConfig, profile: StepProfile, *, num_blocks: int, max_model_len: int,
                 eos_token_ids: Sequence[int], replicas: int = 1, router: Router | None = None,
                 max_num_waiting: int | None = 512, max_concurrency: int | None = None,
                 metrics_interval: float = 1.0, noise: bool = True, seed: int = 0) -> None:
        if replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {replicas}")
        self.profile = profile
        self.replicas = [SimReplica(i, config, profile, num_blocks, max_model_len, eos_token_ids, max_num_waiting,
                                    np.random.default_rng([seed, i]) if noise else None)
                         for i in range(replicas)]
        self.router = router or RoundRobinRouter()
        self.max_concurrency = max_concurrency
        self.metrics_interval = metrics_interval
        self._events: list[tuple[float, int, int, str, Any]] = []
        self._seq = itertools.count()

    # Same-time order: arrivals and queueing before steps start, so a request arriving as a
    # step would start joins it; step ends before both (their tokens exist first).
    _ORDER = {"step_end": 0, "arrive": 1, "enqueue": 2, "step": 3, "sample": 4}

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (t, self._ORDER[kind], next(self._seq), kind, payload))

    def run(self, requests: Sequence[SimRequest], until: float | None = None) -> SimRun:
        """Simulate ``requests`` (arrival times ascending not required). Stops when every
        request has ended, or when every ``watched`` one has (if any are), or at ``until``."""
        outcomes = {r.index: SimOutcome(r.index) for r in requests}
        watched = {r.index for r in requests if r.watched}
        unsent = len(requests)
        in_flight = 0
        blocked: list[SimRequest] = []  # waiting for a --max-concurrency slot
        samples: list[dict[str, Any]] = []
        for r in requests:
            self._push(r.arrival, "arrive", r)
        self._push(0.0, "sample", None)
        now = 0.0

        def finish(o: SimOutcome, t: float) -> None:
            nonlocal in_flight
            o.end_time = t
            in_flight -= 1
            watched.discard(o.index)
            if blocked:
                self._push(t, "arrive", blocked.pop(0))

        has_watched = bool(watched)

        def done() -> bool:
            return not watched if has_watched else unsent == 0 and in_flight == 0

        while self._events:
            t, _, _, kind, payload = heapq.heappop(self._events)
            if until is not None and t > until:
                now = until
                break
            now = t
            if kind == "arrive":
                req: SimRequest = payload
                if req.not_after_done and has_watched and not watched:
                    unsent -= 1
                    continue
                if self.max_concurrency is not None and in_flight >= self.max_concurrency:
                    blocked.append(req)
                    continue
                unsent -= 1
                in_flight += 1
                o = outcomes[req.index]
                o.sent, o.send_time = True, t
                o.prompt_tokens = len(req.prompt_token_ids)
                i = self.router.route(req.prompt_token_ids, [r.load for r in self.replicas])
                rep = self.replicas[i]
                o.replica = i
                if not rep.admits():
                    o.status, o.error = 503, "503: the server is overloaded (max_num_waiting)"
                    finish(o, t + self.profile.request_overhead_s / 2)
                    continue
                rep.pending += 1
                rep.publish()
                self._push(t + self.profile.request_overhead_s, "enqueue", (rep, req))
            elif kind == "enqueue":
                rep, req = payload
                rep.pending -= 1
                rid = str(req.index)
                params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos, temperature=0.0)
                if not req.ignore_eos:
                    rep.runner.targets[rid] = req.output_len
                try:
                    rep.engine.add_request(rid, req.prompt_token_ids, params, stream=True,
                                           arrival_time=outcomes[req.index].send_time,
                                           options=RequestOptions(tenant=req.tenant))
                except ValueError as e:
                    o = outcomes[req.index]
                    o.status, o.error = 400, f"400: {e}"
                    finish(o, t)
                    continue
                if not rep.busy:
                    rep.busy = True
                    self._push(t, "step", rep)
            elif kind == "step":
                rep = payload
                rep.clock.now = t
                outputs = rep.engine.step()
                if rep.runner.error is not None:
                    raise RuntimeError(f"the step-time profile failed: {rep.runner.error}") from rep.runner.error
                end = rep.clock.now
                if end == t and not outputs:
                    end = t + IDLE_POLL_S  # nothing ran (a batching policy waits): poll
                self._push(end, "step_end", (rep, outputs))
            elif kind == "step_end":
                rep, outputs = payload
                for out in outputs:
                    o = outcomes[int(out.request_id)]
                    c = out.outputs[0]
                    if c.token_ids:
                        o.token_times.append(t + self.profile.delivery_s)  # one SSE chunk
                        o.output_tokens += len(c.token_ids)
                    if out.finished:
                        o.cached_tokens = out.num_cached_tokens or 0
                        o.finish_reason = c.finish_reason
                        failure = out.failure()
                        o.status = 200 if failure is None else 503
                        o.error = None if failure is None else str(failure)
                        finish(o, t + self.profile.delivery_s)
                rep.publish()
                if rep.engine.has_unfinished_requests():
                    self._push(t, "step", rep)
                else:
                    rep.busy = False
            elif kind == "sample":
                samples.append(self._gauges(t))
                if not done():
                    self._push(t + self.metrics_interval, "sample", None)
            if done():
                break
        return SimRun([outcomes[r.index] for r in requests], now, samples, self._counters(),
                      [self._replica_stats(r) for r in self.replicas], self._router_stats())

    def _gauges(self, t: float) -> dict[str, Any]:
        loads = [r.load for r in self.replicas]
        return {"t": t, "waiting": float(sum(x.num_waiting for x in loads)),
                "running": float(sum(x.num_running for x in loads)),
                "kv_cache_usage": sum(x.kv_cache_usage for x in loads) / len(loads),
                "preemptions": float(sum(r.engine.scheduler.num_preemptions for r in self.replicas))}

    def _counters(self) -> dict[str, float]:
        stats = [r.engine.get_stats() for r in self.replicas]
        return {"inflight:num_preemptions_total": float(sum(s.num_preemptions for s in stats)),
                "inflight:prompt_tokens_total": float(sum(s.prompt_tokens for s in stats)),
                "inflight:generation_tokens_total": float(sum(s.generation_tokens for s in stats)),
                "inflight:prefix_cache_queries_total": float(sum(s.prefix_cache_queries for s in stats)),
                "inflight:prefix_cache_hits_total": float(sum(s.prefix_cache_hits for s in stats))}

    @staticmethod
    def _replica_stats(r: SimReplica) -> dict[str, Any]:
        s = r.engine.get_stats()
        return {"replica": r.index, "steps": r.runner.num_steps, "busy_s": r.runner.busy_s,
                "extrapolated_steps": r.runner.num_extrapolated,
                "preemptions": s.num_preemptions, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "generation_tokens": s.generation_tokens}

    def _router_stats(self) -> dict[str, Any]:
        return {k: getattr(self.router, k) for k in ("hits", "overrides") if hasattr(self.router, k)}
