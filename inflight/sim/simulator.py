"""The discrete-event simulator: real engines on a virtual clock. Torch-free.

Each replica (:mod:`inflight.sim.virtual_replica`) is a real :class:`inflight.engine.Engine`
(its ``Scheduler``, ``KVCacheManager`` and ``OutputProcessor``) whose runner computes nothing: it advances the
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

With ``speculative_config`` each replica's scheduler speculates as serving would; how many
drafts a verification keeps is drawn from an acceptance profile (``acceptance``, else the
profile's ``speculation``: :mod:`inflight.sim.acceptance`), from its own seeded stream.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from inflight.config import DEFAULT_MAX_NUM_WAITING, EngineConfig
from inflight.engine.engine_thread import IDLE_POLL_S
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.routing import Router, RoundRobinRouter
from inflight.sampling_params import SamplingParams
from inflight.sim.acceptance import AcceptanceProfile, stats_json
from inflight.sim.profile import StepProfile
from inflight.sim.virtual_replica import SimReplica


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


@dataclass
class _RunState:
    """Where one run stands: each request's outcome so far and what is left to send and end."""

    outcomes: dict[int, SimOutcome]
    watched: set[int]  # watched requests not yet ended
    has_watched: bool
    unsent: int
    in_flight: int = 0
    blocked: list[SimRequest] = field(default_factory=list)  # waiting for a --max-concurrency slot
    samples: list[dict[str, Any]] = field(default_factory=list)
    users: Users | None = None  # closed loop: who sends next, and when the run is done
    now: float = 0.0
    last_end: float = 0.0  # when the latest request ended at its client

    @classmethod
    def of(cls, requests: Sequence[SimRequest]) -> _RunState:
        watched = {r.index for r in requests if r.watched}
        return cls({r.index: SimOutcome(r.index) for r in requests}, watched, bool(watched), len(requests))

    def done(self) -> bool:
        """Every watched request has ended (when any are watched), else every request;
        closed loop: as the users say."""
        if self.users is not None:
            return self.users.done(self.now)
        return not self.watched if self.has_watched else self.unsent == 0 and self.in_flight == 0


class Users(Protocol):
    """A closed loop's users (``sim.closed_loop.ClosedLoop``): they send a request's
    successor once it ends, and say when the run is done."""

    def start(self) -> list[SimRequest]: ...
    def on_send(self, index: int, t: float) -> None: ...
    def after(self, index: int, t: float) -> SimRequest | None: ...
    def done(self, t: float) -> bool: ...


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
        seed: the noise's and the accepted drafts' seed; the same seed gives the same run.
        acceptance: how often drafts are accepted (``config.speculative_config``); None:
            the profile's ``acceptance``.

    Raises:
        ValueError: no replica, or a speculating ``config`` without acceptance rates.
    """

    def __init__(self, config: EngineConfig, profile: StepProfile, *, num_blocks: int, max_model_len: int,
                 eos_token_ids: Sequence[int], replicas: int = 1, router: Router | None = None,
                 max_num_waiting: int | None = DEFAULT_MAX_NUM_WAITING, max_concurrency: int | None = None,
                 metrics_interval: float = 1.0, noise: bool = True, seed: int = 0,
                 acceptance: AcceptanceProfile | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {replicas}")
        self.profile = profile
        self.replicas = [SimReplica(i, config, profile, num_blocks, max_model_len, eos_token_ids, max_num_waiting,
                                    np.random.default_rng([seed, i]) if noise else None, acceptance,
                                    np.random.default_rng([seed, i, 1]))
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

    def run(self, requests: Sequence[SimRequest], until: float | None = None, users: Users | None = None) -> SimRun:
        """Simulate ``requests`` (arrival times ascending not required). Stops when every
        request has ended, or when every ``watched`` one has (if any are), or at ``until``.
        ``users``: a closed loop instead: ``requests`` are theirs (``users.start()``) and
        each ending request may send its user's next; the outcomes are in index order."""
        state = _RunState.of(requests)
        state.users = users
        for r in requests:
            self._push(r.arrival, "arrive", r)
        self._push(0.0, "sample", None)
        end = self._play(state, until)
        outcomes = ([state.outcomes[i] for i in sorted(state.outcomes)] if users is not None
                    else [state.outcomes[r.index] for r in requests])
        return SimRun(outcomes, end, state.samples, self._counters(),
                      [self._replica_stats(r) for r in self.replicas], self._router_stats())

    def _play(self, state: _RunState, until: float | None) -> float:
        """Handle the events in time order until the run is done, no event is left or the
        next is past ``until``; returns the simulated time it stopped at."""
        handlers: dict[str, Callable[[_RunState, float, Any], bool]] = {
            "arrive": self._arrive, "enqueue": self._enqueue, "step": self._step,
            "step_end": self._step_end, "sample": self._sample}
        now = 0.0
        while self._events:
            t, _, _, kind, payload = heapq.heappop(self._events)
            if until is not None and t > until:
                return until
            now = state.now = t
            # Only an event that ran through can end the run: after one dropped, held back or
            # refused, the run goes on to the next event (its end time is that event's).
            if handlers[kind](state, t, payload) and state.done():
                # A step's last tokens reach their clients after it ends: the run ends then.
                return max(now, state.last_end)
        return now

    def _arrive(self, state: _RunState, t: float, req: SimRequest) -> bool:
        """The client sends ``req``, unless the cool-down is over (``not_after_done``) or
        ``max_concurrency`` holds it back; the router picks a replica, whose admission bound
        may refuse it with a 503. Returns whether it went on to a replica's queue."""
        if req.not_after_done and state.has_watched and not state.watched:
            state.unsent -= 1
            return False
        if self.max_concurrency is not None and state.in_flight >= self.max_concurrency:
            state.blocked.append(req)
            return False
        state.unsent -= 1
        state.in_flight += 1
        o = state.outcomes[req.index]
        o.sent, o.send_time = True, t
        if state.users is not None:
            state.users.on_send(req.index, t)
        o.prompt_tokens = len(req.prompt_token_ids)
        i = self.router.route(req.prompt_token_ids, [r.load for r in self.replicas])
        rep = self.replicas[i]
        o.replica = i
        if not rep.admits():
            o.status, o.error = 503, "503: the server is overloaded (max_num_waiting)"
            self._finish(state, o, t + self.profile.request_overhead_s / 2)
            return False
        rep.pending += 1
        rep.publish()
        self._push(t + self.profile.request_overhead_s, "enqueue", (rep, req))
        return True

    def _enqueue(self, state: _RunState, t: float, to: tuple[SimReplica, SimRequest]) -> bool:
        """The request reaches its replica's engine queue (a 400 if the engine refuses it);
        an idle replica starts stepping. Returns whether the engine took it."""
        rep, req = to
        rep.pending -= 1
        rid = str(req.index)
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=req.ignore_eos, temperature=0.0)
        if not req.ignore_eos:
            rep.runner.targets[rid] = req.output_len
        try:
            rep.engine.add_request(rid, req.prompt_token_ids, params, stream=True,
                                   arrival_time=state.outcomes[req.index].send_time,
                                   options=RequestOptions(tenant=req.tenant))
        except ValueError as e:
            o = state.outcomes[req.index]
            o.status, o.error = 400, f"400: {e}"
            self._finish(state, o, t)
            return False
        if not rep.busy:
            rep.busy = True
            self._push(t, "step", rep)
        return True

    def _step(self, state: _RunState, t: float, rep: SimReplica) -> bool:
        """``rep``'s engine runs one step from ``t``; its outputs exist when it ends."""
        rep.clock.now = t
        outputs = rep.engine.step()
        if rep.runner.error is not None:
            raise RuntimeError(f"the step-time profile failed: {rep.runner.error}") from rep.runner.error
        end = rep.clock.now
        if end == t and not outputs:
            end = t + IDLE_POLL_S  # nothing ran (a batching policy waits): poll
        self._push(end, "step_end", (rep, outputs))
        return True

    def _step_end(self, state: _RunState, t: float, ended: tuple[SimReplica, list[RequestOutput]]) -> bool:
        """A step ended: its outputs go to their clients, the replica reports its load and
        steps again while it has work."""
        rep, outputs = ended
        for out in outputs:
            self._deliver(state, t + self.profile.delivery_s, out)
        rep.publish()
        if rep.engine.has_unfinished_requests():
            self._push(t, "step", rep)
        else:
            rep.busy = False
        return True

    def _deliver(self, state: _RunState, at: float, out: RequestOutput) -> None:
        """One request's output of a step reaches its client at ``at`` (one SSE chunk)."""
        o = state.outcomes[int(out.request_id)]
        c = out.outputs[0]
        if c.token_ids:
            o.token_times.append(at)
            o.output_tokens += len(c.token_ids)
        if out.finished:
            o.cached_tokens = out.num_cached_tokens or 0
            o.finish_reason = c.finish_reason
            failure = out.failure()
            o.status = 200 if failure is None else 503
            o.error = None if failure is None else str(failure)
            self._finish(state, o, at)

    def _sample(self, state: _RunState, t: float, _: None) -> bool:
        """The scraper reads the gauges, every ``metrics_interval`` until the run is done."""
        state.samples.append(self._gauges(t))
        if not state.done():
            self._push(t + self.metrics_interval, "sample", None)
        return True

    def _finish(self, state: _RunState, o: SimOutcome, t: float) -> None:
        """``o``'s request ended at ``t`` (its client has it all); a held-back one may go."""
        o.end_time = t
        state.last_end = max(state.last_end, t)
        state.in_flight -= 1
        state.watched.discard(o.index)
        nxt = state.users.after(o.index, t) if state.users is not None else None
        if nxt is not None:
            state.outcomes[nxt.index] = SimOutcome(nxt.index)
            state.unsent += 1
            self._push(nxt.arrival, "arrive", nxt)
        if state.blocked:
            self._push(t, "arrive", state.blocked.pop(0))

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
        out: dict[str, Any] = {"replica": r.index, "steps": r.runner.num_steps, "busy_s": r.runner.busy_s,
               "extrapolated_steps": r.runner.num_extrapolated,
               "preemptions": s.num_preemptions, "prefix_cache_queries": s.prefix_cache_queries,
               "prefix_cache_hits": s.prefix_cache_hits, "generation_tokens": s.generation_tokens}
        spec = r.engine.scheduler.speculation
        if spec is not None:
            out["spec_decode"] = stats_json(spec.stats)
        return out

    def _router_stats(self) -> dict[str, Any]:
        return {k: getattr(self.router, k) for k in ("hits", "overrides") if hasattr(self.router, k)}
