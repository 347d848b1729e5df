"""``ClusterEngine``: N engine replicas (Ray actors) behind the surface of one ``AsyncEngine``.

The FastAPI app (``server/app.build_app``) talks to an ``AsyncEngine``: ``reserve`` /
``refusal`` / ``add_request`` returning a ``RequestStream``, ``abort``, ``drain``,
``abort_all``, ``get_stats``, the tokenizer and the prompt-fit rule. ``ClusterEngine``
offers the same, so the routes, SSE, disconnect aborts, admission (503) and the shutdown
drain run unchanged in the ingress process, while each request runs in one replica:

- **Routing.** ``add_request`` asks the router (``inflight.routing``: ``round_robin``,
  ``least_load``, ``prefix_affinity`` over the prompt's chained block hashes) with each
  replica's load: the sequences this ingress sent it and that have not finished (exact,
  known here at once) split into running / waiting by the replica's last report, and its
  reported KV usage. A replica that is down is never chosen.
- **Outputs.** One Ray streaming call per replica (``ReplicaServer.outputs``) carries
  batches of deltas for all its requests; a watcher task per replica hands each to its
  request's ``RequestStream`` and feeds ``listeners`` (the app's ``ServerMetrics``: the
  ``/stats`` windows across replicas).
- **Faults.** When a replica's process dies its output stream raises (Ray notices the lost
  connection, about 1.5 s here): every request in flight there ends at once with
  ``RequestFailedError`` (500, or an error event on a started stream), the replica stops
  being routed to, and the prefix router forgets what it held. Ray restarts the actor
  (``max_restarts``); once its engine is loaded again (``ready``) it rejoins. Requests on
  the other replicas are untouched.
- **Admission.** Sequences waiting across the live replicas plus places reserved here are
  bounded by ``max_num_waiting`` per live replica beyond their free running slots (the
  one-engine rule, ``async_engine.has_room``, summed), so an overloaded cluster answers 503
  before a body is read, as one engine does.

Everything on the event-loop side runs on the server's loop; ``shutdown`` may be called
from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

from inflight.cluster.replica import ReplicaServer
from inflight.cluster.runtime import import_ray
from inflight.config import EngineConfig
from inflight.engine.async_engine import Reservation, StepListener, has_room
from inflight.engine.stats import EngineStats
from inflight.engine.stream import RequestStream
from inflight.errors import (EngineDeadError, EngineError, EngineOverloadedError,
                             InvalidRequestError, RequestFailedError, RequestTooLargeError)
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.routing import ReplicaLoad, least_loaded, make_router
from inflight.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long replicas may take to load their engines at start (model load, kernels).
READY_TIMEOUT_S = 300.0
# A down replica's load as the router sees it: never the least loaded.
_DOWN_LOAD = ReplicaLoad(num_running=0, num_waiting=1 << 30, kv_cache_usage=1.0)
# Pause between checks whether a dead replica is back.
_RETRY_S = 0.2


def _zero_stats() -> EngineStats:
    return EngineStats(0, 0, 0.0, 0, 0, 0, 0)


@dataclass
class ReplicaState:
    """The ingress's view of one replica.

    Attributes:
        index: 0..N-1, its ``replica`` label.
        actor: the Ray actor handle.
        up: routed to; False from its death until its restart is ready.
        pid: its process id (last seen).
        stats: its ``EngineStats`` as last reported (with its last outputs).
        num_waiting: its waiting sequences as last reported (queued adds included).
        seqs: sequences in flight there per request id, as this ingress counts them.
        routed, lost, restarts: requests routed there; requests failed because it died;
            times it died and came back.
    """

    index: int
    actor: Any
    up: bool = False
    pid: int | None = None
    stats: EngineStats = field(default_factory=_zero_stats)
    num_waiting: int = 0
    seqs: dict[str, int] = field(default_factory=dict)
    routed: int = 0
    lost: int = 0
    restarts: int = 0

    def load(self) -> ReplicaLoad:
        """What the router sees: in-flight sequences (counted here), split into running
        and waiting by the last report, and the reported KV usage."""
        if not self.up:
            return _DOWN_LOAD
        outstanding = sum(self.seqs.values())
        running = min(outstanding, self.stats.num_running)
        return ReplicaLoad(running, outstanding - running, self.stats.kv_cache_usage)


def load_tokenizer(model: str | None) -> Any:
    """The model's tokenizer alone (the ingress templates and tokenizes; replicas hold the
    weights): a GGUF file's, or an HF directory's. Raises ``FileNotFoundError`` for no
    such model and ``UnsafeChatTemplateError`` for a template the server refuses."""
    from inflight.engine.loading import resolve_model_path
    from inflight.tokenizer import Tokenizer, check_chat_template

    path = resolve_model_path(model)
    tok = Tokenizer.from_pretrained(path) if path.is_dir() else Tokenizer.from_gguf(path)
    check_chat_template(tok, path)
    return tok


class ClusterEngine:
    """N replicas on Ray behind the ``AsyncEngine`` surface the HTTP server uses.

    Ray must be initialised (``runtime.RayRuntime``). The constructor starts the replica
    actors and waits until every engine is loaded.

    Args:
        config: every replica's engine settings (``num_threads`` each: set it, or each
            replica takes torch's default, all cores).
        num_replicas: N >= 1.
        model_name: the served name (metrics' ``model_name``).
        tokenizer: the model's tokenizer for the ingress (``load_tokenizer(config.model)``
            when None).
        router: ``inflight.routing`` policy name.
        router_threshold: ``prefix_affinity``'s imbalance threshold, sequences.
        max_num_waiting: per live replica, sequences allowed to wait beyond free running
            slots (the one-engine flag); None: unbounded.
        stats_window_s: latency window of each replica's ``/stats``.
        log_interval_s: replicas' stats log line period (0: none).
        watchdog_timeout_s: each replica's step watchdog (``AsyncEngine``); a stuck replica
            exits and is restarted like any dead one.
        max_restarts: times Ray restarts a dead replica (-1: always).
        num_cpus: Ray CPUs each replica reserves (scheduling only).
        listeners: called as ``listener(stats, outputs, now)`` with the summed stats after
            each batch of outputs (the app appends its metrics here).
        log_level: the replicas' logging level.

    Raises:
        RuntimeError: Ray is missing, or a replica failed to start (its error in the
            message); the replicas started are killed first.
        ValueError: ``num_replicas < 1`` or an unknown router.
    """

    def __init__(self, config: EngineConfig, *, num_replicas: int, model_name: str,
                 tokenizer: Any = None, router: str = "prefix_affinity",
                 router_threshold: int = 8, max_num_waiting: int | None = None,
                 stats_window_s: float = 60.0, log_interval_s: float = 10.0,
                 max_restarts: int = -1, num_cpus: float | None = None,
                 listeners: Sequence[StepListener] = (), log_level: str = "INFO",
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 watchdog_timeout_s: float | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size: must be >= 1, got {num_replicas}")
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting: must be >= 0 or None, got {max_num_waiting!r}")
        self._ray = ray = import_ray()
        self.config = config
        self.model_name = model_name
        self.router_name = router
        self.router = make_router(router, config.block_size, router_threshold)
        # For a router that learns from finished requests (prefix affinity): the prompt ids
        # plus the generated ids so far, per request in flight.
        self._kv_ids: dict[str, list[int]] = {}
        self.max_num_waiting = max_num_waiting
        self.listeners: list[StepListener] = list(listeners)
        self.engine = None  # no in-process Engine (server/app reads ``engine.engine``)
        self._lock = threading.Lock()  # guards _streams, _owner, _num_pending, seqs
        self._streams: dict[str, RequestStream] = {}
        self._owner: dict[str, int] = {}
        self._num_pending = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._draining = False
        self._started = False

        actor_cls = ray.remote(ReplicaServer).options(
            num_cpus=(config.num_threads or 1) if num_cpus is None else num_cpus,
            max_restarts=max_restarts, max_task_retries=0, max_concurrency=10_000)
        t0 = time.monotonic()
        self.replicas = [ReplicaState(i, actor_cls.remote(i, config, model_name, stats_window_s,
                                                          log_interval_s, log_level,
                                                          watchdog_timeout_s))
                         for i in range(num_replicas)]
        try:
            pids = ray.get([r.actor.ready.remote() for r in self.replicas],
                           timeout=ready_timeout_s)
            info = ray.get(self.replicas[0].actor.info.remote())
        except Exception as e:
            self._kill_all()
            raise RuntimeError(f"data parallel: a replica failed to start: {_cause(e)}") from None
        for r, pid in zip(self.replicas, pids):
            r.pid, r.up = pid, True
        logger.info("%d replicas ready in %.1f s (pids %s), router %s", num_replicas,
                    time.monotonic() - t0, pids, router)
        self.num_kv_blocks: int = info["num_kv_blocks"]
        self.max_model_len: int = info["max_model_len"]
        from inflight.engine import Engine
        # The prompt-fit rule and grammar compiler of one engine, without a model: the
        # same code the replicas run, so a request they would refuse gets its 400 here.
        self._checker = Engine(config, runner=cast(Any, _NoRunner()),
                               tokenizer=tokenizer if tokenizer is not None
                               else load_tokenizer(config.model),
                               num_blocks=self.num_kv_blocks, max_model_len=self.max_model_len,
                               eos_token_ids=info["eos_token_ids"])
        self.tokenizer = self._checker.tokenizer

    # --- what the HTTP layer reads ---------------------------------------------------------
    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The engines' prompt-fit rule (``Scheduler.check_prompt_fits``)."""
        return self._checker.check_prompt_fits(num_prompt_tokens, max_tokens)

    def compile_grammar(self, params: Any) -> Any:
        """Compile a structured-output spec here to refuse a bad one with a 400 (each
        replica compiles its own copy when the request arrives)."""
        return self._checker.compile_grammar(params)

    @property
    def num_up(self) -> int:
        """Replicas now routed to."""
        return sum(r.up for r in self.replicas)

    @property
    def is_running(self) -> bool:
        """Started and not shut down (some replicas may be restarting)."""
        return self._started and not self._stopping

    @property
    def is_accepting(self) -> bool:
        """Running, not draining, and at least one replica up."""
        return self.is_running and not self._draining and self.num_up > 0

    @property
    def num_in_flight(self) -> int:
        """API-level requests queued or running on any replica."""
        with self._lock:
            return len(self._streams)

    @property
    def num_pending(self) -> int:
        """Sequences reserved here and not yet sent to a replica."""
        return self._num_pending

    @property
    def num_waiting(self) -> int:
        """Sequences waiting across replicas, plus places reserved here."""
        with self._lock:
            return self._num_pending + sum(r.load().num_waiting for r in self.replicas if r.up)

    def get_stats(self) -> EngineStats:
        """The replicas' last reported stats, summed (KV usage: the mean over live ones)."""
        live = [r.stats for r in self.replicas if r.up] or [_zero_stats()]
        total = {f.name: sum(getattr(s, f.name) for s in live) for f in fields(EngineStats)}
        total["kv_cache_usage"] = total["kv_cache_usage"] / len(live)
        return EngineStats(**total)

    def drain(self) -> None:
        """Refuse new requests; those in flight run on (shutdown's first phase)."""
        self._draining = True

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start one output watcher per replica on the running event loop (idempotent)."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._started = True
        self._tasks = [self._loop.create_task(self._watch(r)) for r in self.replicas]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop routing, end requests still in flight (``EngineDeadError``), and kill every
        replica actor (no restart). Idempotent; callable from any thread."""
        if self._stopping:
            return
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for t in self._tasks:
                try:
                    loop.call_soon_threadsafe(t.cancel)
                except RuntimeError:
                    pass
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._owner.clear()
        for s in streams:
            s.put(EngineDeadError("the server is shutting down"))
        self._kill_all()

    def _kill_all(self) -> None:
        for r in self.replicas:
            r.up = False
            try:
                self._ray.kill(r.actor, no_restart=True)
            except Exception:
                logger.debug("kill of replica %d failed", r.index, exc_info=True)

    # --- admission -------------------------------------------------------------------------
    def _not_accepting(self) -> EngineDeadError | None:
        if not self.is_running:
            return EngineDeadError("the engine is not running")
        if self._draining:
            return EngineDeadError("the server is shutting down; retry on another replica")
        if self.num_up == 0:
            return EngineDeadError("no engine replica is up (restarting); retry shortly")
        return None

    def _overload(self, n: int) -> EngineOverloadedError | None:
        # Called with the lock held.
        live = [r.load() for r in self.replicas if r.up]
        waiting = self._num_pending + sum(x.num_waiting for x in live)
        running = sum(x.num_running for x in live)
        max_num_seqs = self.config.max_num_seqs * len(live)
        bound = None if self.max_num_waiting is None else self.max_num_waiting * len(live)
        if has_room(n, waiting, running, max_num_seqs, bound):
            return None
        return EngineOverloadedError(
            f"the server is overloaded: {waiting} sequences are queued for "
            f"{max(0, max_num_seqs - running)} free running slots on {len(live)} replicas and "
            f"max_num_waiting={self.max_num_waiting} more per replica; retry later")

    def check_num_seqs(self, num_seqs: int) -> None:
        """Raise ``RequestTooLargeError`` if ``num_seqs`` sequences could never be queued
        at once on all replicas together."""
        if self.max_num_waiting is None:
            return
        capacity = (self.config.max_num_seqs + self.max_num_waiting) * len(self.replicas)
        if num_seqs > capacity:
            raise RequestTooLargeError(
                f"n: {num_seqs} sequences (prompts x n) can never be queued at once; this server "
                f"runs at most (max_num_seqs + max_num_waiting) x replicas = {capacity}")

    def refusal(self, num_seqs: int = 1) -> EngineError | None:
        """The error ``reserve(num_seqs)`` would raise now, else None; takes nothing."""
        error = self._not_accepting()
        if error is not None:
            return error
        with self._lock:
            return self._overload(num_seqs)

    def reserve(self, num_seqs: int) -> Reservation:
        """Hold places for ``num_seqs`` sequences before templating and tokenizing, as
        ``AsyncEngine.reserve``. Raises ``EngineDeadError``, ``RequestTooLargeError``,
        ``EngineOverloadedError``."""
        error = self._not_accepting()
        if error is not None:
            raise error
        self.check_num_seqs(num_seqs)
        with self._lock:
            overload = self._overload(num_seqs)
            if overload is not None:
                raise overload
            self._num_pending += num_seqs
        return Reservation(self._unreserve, num_seqs)

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._num_pending -= n

    # --- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams, *, arrival_time: float | None = None,
                    options: RequestOptions | None = None,
                    reservation: Reservation | None = None, stream: bool = True,
                    ) -> RequestStream:
        """Route a request to a replica and queue it there; returns its stream at once.

        Must be called on the event loop ``start`` ran on. Arguments and errors as
        ``AsyncEngine.add_request``; the replica's refusals (and its death) arrive through
        the stream.
        """
        error = self._not_accepting()
        if error is not None:
            raise error
        loop = asyncio.get_running_loop()
        n = sampling_params.n
        held = reservation if reservation is not None and reservation.remaining >= n else None
        if held is None:
            self.check_num_seqs(n)
        ids = list(self.tokenizer.encode(prompt, True) if isinstance(prompt, str) else prompt)
        out = RequestStream(request_id, self.abort, loop, final_only=not stream)
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
            if held is not None:
                held.remaining -= n
                self._num_pending -= n  # the places move from reserved to the replica
            else:
                overload = self._overload(n)
                if overload is not None:
                    raise overload
            i = self._route(ids)
            r = self.replicas[i]
            r.seqs[request_id] = n
            if hasattr(self.router, "observe"):
                self._kv_ids[request_id] = list(ids)
            r.routed += 1
            self._streams[request_id] = out
            self._owner[request_id] = i
        age = time.monotonic() - (time.monotonic() if arrival_time is None else arrival_time)
        ref = r.actor.add.remote(request_id, ids, sampling_params, age, options)
        loop.create_task(self._check_add(r, request_id, ref))
        return out

    def _route(self, ids: Sequence[int]) -> int:
        # Called with the lock held. A router may name a down replica (round robin does):
        # ask again, it moves on; past N tries, the least loaded live one.
        loads = [r.load() for r in self.replicas]
        for _ in range(len(self.replicas)):
            i = self.router.route(ids, loads)
            if self.replicas[i].up:
                return i
        return least_loaded(loads)

    async def _check_add(self, r: ReplicaState, request_id: str, ref: Any) -> None:
        try:
            await ref
        except Exception as e:  # the actor died before taking it; the watcher may beat us
            self._end(request_id, RequestFailedError(
                f"replica {r.index} did not take the request: {_cause(e)}"))

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica (no-op when it already finished)."""
        with self._lock:
            i = self._owner.get(request_id)
        if i is not None and self.replicas[i].up:
            self._fire(self.replicas[i].actor.abort.remote(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight on every live replica."""
        for r in self.replicas:
            if r.up:
                self._fire(r.actor.abort_all.remote())

    async def reset_prefix_cache(self) -> int:
        """Drop idle cached KV blocks on every live replica, and the prefix router's memory
        of what each holds; the total dropped.

        Raises:
            EngineDeadError: not running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        live = [r for r in self.replicas if r.up]
        dropped: int = sum(await asyncio.gather(*(r.actor.reset_prefix_cache.remote() for r in live)))
        for r in live:
            self._router_forget(r.index)  # what it was sent is no longer cached there
        return dropped

    def _router_forget(self, index: int) -> None:
        forget = getattr(self.router, "forget", None)
        if forget is not None:
            forget(index)

    @staticmethod
    def _fire(ref: Any) -> None:
        # Fire and forget, but take the result so a dead actor's error is not logged as
        # unhandled.
        ref.future().add_done_callback(lambda f: f.exception())

    # --- the watchers ----------------------------------------------------------------------
    async def _watch(self, r: ReplicaState) -> None:
        while not self._stopping:
            try:
                gen = r.actor.outputs.options(num_returns="streaming").remote()
                async for ref in gen:
                    batch, stats, num_waiting = await ref
                    self._on_batch(r, batch, stats, num_waiting)
                raise RuntimeError("its output stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._stopping:
                    return
                self._replica_down(r, e)
            await self._wait_back(r)

    def _on_batch(self, r: ReplicaState, batch: list[tuple[str, Any]], stats: EngineStats,
                  num_waiting: int) -> None:
        r.stats, r.num_waiting = stats, num_waiting
        delivered: list[RequestOutput] = []
        for rid, item in batch:
            with self._lock:
                stream = self._streams.get(rid) if self._owner.get(rid) == r.index else None
                final = isinstance(item, BaseException) or item.finished
                if stream is not None and isinstance(item, RequestOutput):
                    self._note_tokens(r, rid, item)
                if stream is not None and final:
                    self._forget(rid)
            if stream is None:
                if not final:  # not ours any more (failed here when the replica blinked)
                    self._fire(r.actor.abort.remote(rid))
                continue
            stream.put(item)
            if isinstance(item, RequestOutput):
                delivered.append(item)
        if delivered and self.listeners:
            now, total = time.monotonic(), self.get_stats()
            for listener in self.listeners:
                try:
                    listener(total, delivered, now)
                except Exception:
                    logger.exception("listener %r failed", listener)

    def _note_tokens(self, r: ReplicaState, rid: str, out: RequestOutput) -> None:
        # Called with the lock held. The first completion's ids follow the prompt's in the
        # replica's KV; when it ends, the prefix router learns the blocks it cached (all but
        # the last sampled token, whose K/V was never computed).
        ids = self._kv_ids.get(rid)
        if ids is None or not out.outputs:
            return
        ids += out.outputs[0].token_ids
        observe = getattr(self.router, "observe", None)
        if out.finished and observe is not None:
            observe(r.index, ids[:-1])

    def _forget(self, rid: str) -> None:
        # Called with the lock held.
        self._kv_ids.pop(rid, None)
        self._streams.pop(rid, None)
        i = self._owner.pop(rid, None)
        if i is not None:
            self.replicas[i].seqs.pop(rid, None)

    def _end(self, rid: str, error: EngineError) -> None:
        with self._lock:
            stream = self._streams.get(rid)
            self._forget(rid)
        if stream is not None:
            stream.put(error)

    def _replica_down(self, r: ReplicaState, e: BaseException) -> None:
        r.up = False
        with self._lock:
            lost = [rid for rid, i in self._owner.items() if i == r.index]
        why = f"engine replica {r.index} died ({_cause(e)}); its requests were lost"
        logger.error("%s: %d in flight", why, len(lost))
        for rid in lost:
            self._end(rid, RequestFailedError(why))
        r.lost += len(lost)
        r.stats, r.num_waiting = _zero_stats(), 0
        self._router_forget(r.index)  # its prefix cache is gone with it

    async def _wait_back(self, r: ReplicaState) -> None:
        t0 = time.monotonic()
        while not self._stopping:
            try:
                r.pid = await r.actor.ready.remote()
            except Exception:
                await asyncio.sleep(_RETRY_S)
                continue
            r.restarts += 1
            r.up = True
            logger.info("engine replica %d is back after %.1f s (pid %s)", r.index,
                        time.monotonic() - t0, r.pid)
            return

    # --- what /metrics and /stats ask the replicas -------------------------------------------
    async def gather(self, method: str, timeout: float = 5.0) -> list[Any]:
        """``method()`` of every replica, None for one that is down or does not answer in
        ``timeout`` seconds."""
        async def one(r: ReplicaState) -> Any:
            if not r.up:
                return None
            try:
                return await asyncio.wait_for(getattr(r.actor, method).remote(), timeout)
            except Exception:
                return None
        return list(await asyncio.gather(*(one(r) for r in self.replicas)))


class _NoRunner:
    """The ingress's engine has no model: it only checks prompts and grammars."""

    def execute(self, out: Any) -> list[Any]:
        raise RuntimeError("the ingress engine does not run steps")


def _cause(e: BaseException) -> str:
    """A short description of a Ray error: the exception its traceback ends with, where it
    carries one (a replica's ``__init__`` error: ``ValueError: max_model_len: ...``), else
    its (cause's) first line."""
    cause = getattr(e, "cause", None) or e
    lines = [ln.strip() for ln in str(cause).strip().splitlines() if ln.strip()]
    raised = [ln for ln in lines[1:] if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b.*:", ln)]
    if raised:
        return _strip_ansi(raised[-1])[:300]
    return f"{type(cause).__name__}: {_strip_ansi(lines[0]) if lines else ''}"[:300]


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
