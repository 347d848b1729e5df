"""``ClusterEngine``: N engine replicas (Ray actors) behind one ``EngineClient``.

The FastAPI app (``server/app.build_app``) talks to an ``EngineClient``
(``engine/engine_client.py``): ``reserve`` / ``refusal`` / ``add_request`` returning a
``RequestStream``, ``abort``, ``drain``, ``abort_all``, ``get_stats``, the tokenizer and
the prompt-fit rule. ``ClusterEngine`` implements it as ``AsyncEngine`` does, so the routes, SSE, disconnect aborts, admission (503) and the shutdown
drain run unchanged in the ingress process, while each request runs in one replica:

- **Routing.** ``add_request`` asks the router (``inflight.routing``: ``round_robin``,
  ``least_load``, ``prefix_affinity`` over the prompt's chained block hashes) with each
  replica's load: the sequences this ingress sent it and that have not finished (exact,
  known here at once) split into running / waiting by the replica's last report, and its
  reported KV usage. A replica that is down is never chosen.
- **Outputs.** One Ray streaming call per replica (``ReplicaServer.outputs``) carries
  batches of deltas for all its requests; a watcher task per replica hands each to its
  request's ``RequestStream`` and feeds ``listeners`` (``replica_watch.py`` (the app's ``ServerMetrics``: the
  ``/stats`` windows across replicas).
- **Faults.** When a replica's process dies its output stream raises (Ray notices the lost
  connection, about 1.5 s here): every request in flight there ends at once with
  ``RequestFailedError`` (500, or an error event on a started stream), the replica stops
  being routed to, and the prefix router forgets what it held. Ray restarts the actor
  (``max_restarts``); once its engine is loaded again (``ready``) it rejoins. Requests on
  the other replicas are untouched.
- **Admission.** Sequences waiting across the live replicas plus places reserved here are
  bounded by ``max_num_waiting`` per live replica beyond their free running slots (the
  one-engine rule: the same ``engine.admission.Admission``), so an overloaded cluster answers 503
  before a body is read, as one engine does.

Everything on the event-loop side runs on the server's loop; ``shutdown`` may be called
from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from inflight.cluster.replica import ReplicaServer
from inflight.cluster.replica_state import ReplicaState, load_tokenizer, ray_error_cause
from inflight.cluster.replica_watch import ReplicaWatchers
from inflight.cluster.runtime import import_ray
from inflight.config import EngineConfig
from inflight.engine.admission import Admission, Capacity, Reservation
from inflight.engine.engine_client import StepListener
from inflight.engine.request_rules import RequestRules
from inflight.engine.stream import RequestStream
from inflight.errors import EngineDeadError, EngineError, InvalidRequestError, RequestFailedError
from inflight.lora.lora_config import LoRAModule
from inflight.request import RequestOptions
from inflight.routing import least_loaded, make_router
from inflight.sampling_params import SamplingParams
from inflight.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

# How long replicas may take to load their engines at start (model load, kernels).
READY_TIMEOUT_S = 300.0
_NO_RUNTIME_LORA = ("runtime LoRA loading is not supported with --data-parallel-size > 1: "
                    "give the adapters with --lora-modules at start")


class ClusterEngine(ReplicaWatchers):
    """N replicas on Ray behind the ``EngineClient`` the HTTP server uses.

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
        self.admission = Admission(config.max_num_seqs, max_num_waiting, self._capacity,
                                   self._not_accepting, num_replicas=num_replicas)
        self._ray = ray = import_ray()
        self._config = config
        self.model_name = model_name
        self.router_name = router
        self.router = make_router(router, config.block_size, router_threshold)
        self.listeners = list(listeners)
        # The cluster as a whole never dies: a dead replica is restarted by Ray.
        self.on_dead: list[Callable[[str], None]] = []
        self._init_tables()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._draining = False
        self._started = False
        actor_cls = ray.remote(ReplicaServer).options(
            num_cpus=(config.num_threads or 1) if num_cpus is None else num_cpus,
            max_restarts=max_restarts, max_task_retries=0, max_concurrency=10_000)
        self.replicas = [ReplicaState(i, actor_cls.remote(i, config, model_name, stats_window_s,
                                                          log_interval_s, log_level,
                                                          watchdog_timeout_s))
                         for i in range(num_replicas)]
        info = self._wait_ready(ready_timeout_s)
        self._num_kv_blocks: int = info["num_kv_blocks"]
        self._max_model_len: int = info["max_model_len"]
        self._tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        # The prompt-fit rule and grammar compiler the replicas run, without a model, so a
        # request they would refuse gets its 400 here.
        self.rules = RequestRules.for_pool(config, self._tokenizer,
                                           num_blocks=self._num_kv_blocks,
                                           max_model_len=self._max_model_len)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait until every replica's engine is loaded; the first one's ``info()``. Raises
        ``RuntimeError`` (the replicas killed) when one fails to start."""
        t0 = time.monotonic()
        try:
            pids = self._ray.get([r.actor.ready.remote() for r in self.replicas],
                                 timeout=timeout_s)
            info: dict[str, Any] = self._ray.get(self.replicas[0].actor.info.remote())
        except Exception as e:
            self._kill_all()
            raise RuntimeError("data parallel: a replica failed to start: "
                               f"{ray_error_cause(e)}") from None
        for r, pid in zip(self.replicas, pids):
            r.pid, r.up = pid, True
        logger.info("%d replicas ready in %.1f s (pids %s), router %s", len(self.replicas),
                    time.monotonic() - t0, pids, self.router_name)
        return info

    # --- what the HTTP layer reads ---------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def kv_cache_dtype(self) -> str:
        """The ``--kv-cache-dtype`` setting: the KV tensors live in the replicas."""
        return self._config.kv_cache_dtype

    @property
    def max_num_waiting(self) -> int | None:
        return self.admission.max_num_waiting

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The engines' prompt-fit rule (``Scheduler.check_prompt_fits``)."""
        return self.rules.check_prompt_fits(num_prompt_tokens, max_tokens)

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """Compile a structured-output spec here to refuse a bad one with a 400 (each
        replica compiles its own copy when the request arrives)."""
        return self.rules.compile_grammar(params)

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
        with self.admission.lock:
            return len(self._streams)

    @property
    def num_pending(self) -> int:
        """Sequences reserved here and not yet sent to a replica."""
        return self.admission.num_pending

    @property
    def num_waiting(self) -> int:
        """Sequences waiting across replicas, plus places reserved here."""
        with self.admission.lock:
            return self.admission.num_pending + sum(r.load().num_waiting for r in self.replicas if r.up)

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
        with self.admission.lock:
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

    def _capacity(self) -> Capacity:
        # Called with the admission lock held.
        live = [r.load() for r in self.replicas if r.up]
        return Capacity(sum(x.num_waiting for x in live), sum(x.num_running for x in live),
                        len(live))

    def check_num_seqs(self, num_seqs: int) -> None:
        """Raise ``RequestTooLargeError`` if ``num_seqs`` sequences could never be queued
        at once on all replicas together."""
        self.admission.check_num_seqs(num_seqs)

    def refusal(self, num_seqs: int = 1) -> EngineError | None:
        """The error ``reserve(num_seqs)`` would raise now, else None; takes nothing."""
        return self.admission.refusal(num_seqs)

    def reserve(self, num_seqs: int) -> Reservation:
        """Hold places for ``num_seqs`` sequences before templating and tokenizing, as
        ``AsyncEngine.reserve``. Raises ``EngineDeadError``, ``RequestTooLargeError``,
        ``EngineOverloadedError``."""
        return self.admission.reserve(num_seqs)

    # --- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams, *, arrival_time: float | None = None,
                    options: RequestOptions | None = None,
                    reservation: Reservation | None = None, final_only: bool = False,
                    ) -> RequestStream:
        """Route a request to a replica and queue it there; returns its stream at once.

        Must be called on the event loop ``start`` ran on. Arguments and errors as
        ``AsyncEngine.add_request``; the replica's refusals (and its death) arrive through
        the stream.
        """
        admission = self.admission
        admission.check_accepting()
        loop = asyncio.get_running_loop()
        n = sampling_params.n
        held = admission.held(n, reservation)
        ids = list(self._tokenizer.encode(prompt, True) if isinstance(prompt, str) else prompt)
        out = RequestStream(request_id, self.abort, loop, final_only=final_only)
        with admission.lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
            # The places move from reserved here to the replica's count.
            admission.take(n, held, keep_pending=False)
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
                f"replica {r.index} did not take the request: {ray_error_cause(e)}"))

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica (no-op when it already finished)."""
        with self.admission.lock:
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

    # --- LoRA adapters ---------------------------------------------------------------------
    def lora_modules(self) -> list[LoRAModule]:
        """The ``--lora-modules`` every replica loaded at start, in order (no runtime loads)."""
        lora = self._config.lora_config
        return [] if lora is None else list(lora.lora_modules)

    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Refused: a runtime load would have to reach every replica, and one Ray restarts
        would come back without it. Raises ``InvalidRequestError`` (400)."""
        raise InvalidRequestError(_NO_RUNTIME_LORA)

    async def remove_lora(self, name: str) -> bool:
        """Refused, as ``add_lora``."""
        raise InvalidRequestError(_NO_RUNTIME_LORA)
