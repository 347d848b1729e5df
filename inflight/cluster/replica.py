"""One engine replica: what runs inside each Ray actor of ``--data-parallel-size N``.

``ReplicaServer`` is a plain class (importable without Ray); ``ray_engine.ClusterEngine`` wraps
it with ``ray.remote`` (an async actor, restarted by Ray when its process dies). It owns an
``Engine`` with its ``AsyncEngine`` loop (the same engine thread as the one-engine server)
and that engine's ``ServerMetrics``; the ingress talks to it through these methods:

- ``add(request_id, prompt_token_ids, params, age_s, options)``: queue a request. Errors
  (a prompt the engine refuses) do not raise: they go out through ``outputs`` like any
  output, so a request has one place where it ends.
- ``outputs()``: an async generator (Ray streaming, ``num_returns="streaming"``) the ingress
  keeps open for the replica's life. Each item is ``(batch, stats, num_waiting)``:
  ``batch`` a list of ``(request_id, RequestOutput | EngineError)`` in order (a request's
  deltas merged while the ingress did not read, as ``RequestStream`` merges them), then the
  replica's ``EngineStats`` and waiting sequences after them. About one Ray object per
  engine step, not one per request and token.
- ``abort(request_id)``, ``abort_all()``, ``reset_prefix_cache()``, ``stats()`` (its
  ``GET /stats`` dict), ``families()`` (its Prometheus metric families), ``info()``,
  ``pid()``, ``ready()``.

Arrival times travel as an age (seconds since the request arrived at the ingress), so
TTFT counts from the HTTP request's arrival on whichever clock the replica's process has.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.watchdog import EXIT_ENGINE_DEAD
from inflight.errors import EngineError, RequestFailedError
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.routing import ReplicaLoad
from inflight.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# (request_id, a delta or the error that ends the request)
Item = tuple[str, "RequestOutput | EngineError"]


class ReplicaServer:
    """An engine replica (the body of a Ray actor).

    Args:
        index: the replica's number, 0..N-1 (its ``replica`` metrics label at the ingress).
        config: the engine's settings; ``num_threads`` sets its torch threads.
        model_name: the served name, its metrics' ``model_name`` label.
        stats_window_s: seconds of the latency windows of its ``/stats``.
        log_interval_s: seconds between its stats log lines while busy (0: none).
        log_level: logging level of the actor process.
        watchdog_timeout_s: ``AsyncEngine``'s; a step past it ends the actor's process.

    Raises:
        ValueError, FileNotFoundError: as ``Engine(config)`` (bad flag, no model); Ray
            reports them to the ingress as the actor's creation error.
    """

    def __init__(self, index: int, config: EngineConfig, model_name: str,
                 stats_window_s: float = 60.0, log_interval_s: float = 10.0,
                 log_level: str = "INFO", watchdog_timeout_s: float | None = None) -> None:
        logging.basicConfig(level=log_level.upper(),
                            format=f"%(asctime)s %(levelname)s replica{index} %(name)s: %(message)s")
        from inflight.engine import Engine
        from inflight.server.lifecycle import build_engine_off_main_thread
        from inflight.server.metrics import ServerMetrics

        self.index = index
        t0 = time.monotonic()
        core = build_engine_off_main_thread(lambda: Engine(config))
        self.engine = AsyncEngine(core, max_num_waiting=None, log_interval_s=log_interval_s,
                                  watchdog_timeout_s=watchdog_timeout_s, watchdog_backstop=True)
        # A dead engine takes its actor's process with it: Ray restarts the actor and the
        # ingress routes around it meanwhile (ray_engine.py). The second lets the errors out.
        self.engine.on_dead.append(
            lambda reason: threading.Timer(1.0, os._exit, (EXIT_ENGINE_DEAD,)).start())
        self.metrics = ServerMetrics.for_client(self.engine, model_name, stats_window_s)
        self.engine.listeners.append(self.metrics.on_step)
        self.engine.start()
        self._outbox: list[Item] = []
        self._ready: asyncio.Event | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        logger.info("replica %d up in %.1f s (pid %d, %s torch threads)", index,
                    time.monotonic() - t0, os.getpid(), config.num_threads or "default")

    # --- requests -------------------------------------------------------------------------
    async def add(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                  age_s: float, options: RequestOptions | None = None) -> None:
        """Queue a request that arrived ``age_s`` seconds ago; its outputs (or the error
        that ends it) come out of ``outputs``."""
        try:
            stream = self.engine.add_request(request_id, prompt, params,
                                             arrival_time=time.monotonic() - max(0.0, age_s),
                                             options=options)
        except EngineError as e:
            self._post(request_id, e)
            return
        self._tasks[request_id] = asyncio.create_task(self._pump(request_id, stream))

    async def _pump(self, request_id: str, stream: Any) -> None:
        try:
            async for out in stream:
                self._post(request_id, out)
        except EngineError as e:
            self._post(request_id, e)
        except Exception as e:  # never leave the ingress waiting
            logger.exception("replica %d: request %s failed", self.index, request_id)
            self._post(request_id, RequestFailedError(f"{type(e).__name__}: {e}"))
        finally:
            self._tasks.pop(request_id, None)

    def _post(self, request_id: str, item: RequestOutput | EngineError) -> None:
        self._outbox.append((request_id, item))
        if self._ready is not None:
            self._ready.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished); its final output follows."""
        self.engine.abort(request_id)

    async def abort_all(self) -> None:
        """Abort every request in flight (the ingress's shutdown grace ran out)."""
        self.engine.abort_all()

    async def outputs(self) -> Any:
        """Batches of ``(request_id, output or error)`` with the stats after them, for the
        replica's life (a Ray streaming generator; see the module docstring)."""
        if self._ready is None:
            self._ready = asyncio.Event()
        while True:
            if not self._outbox:
                self._ready.clear()
                await self._ready.wait()
            batch, self._outbox = self._outbox, []
            yield batch, self.engine.get_stats(), self.engine.num_waiting

    # --- state ----------------------------------------------------------------------------
    def load(self) -> ReplicaLoad:
        """Sequences running and waiting (queued adds included) and KV usage, now."""
        s = self.engine.get_stats()
        return ReplicaLoad(s.num_running, self.engine.num_waiting, s.kv_cache_usage)

    async def ready(self) -> int:
        """The process id, once the engine runs (the ingress waits on it after a start or
        restart)."""
        return os.getpid()

    async def pid(self) -> int:
        """The replica's process id (tests kill it to check fault handling)."""
        return os.getpid()

    async def info(self) -> dict[str, Any]:
        """What the ingress needs to check prompts without the model: ``num_kv_blocks``,
        ``max_model_len``, ``eos_token_ids``."""
        core = self.engine.engine
        return {"num_kv_blocks": self.engine.num_kv_blocks,
                "max_model_len": self.engine.max_model_len,
                "eos_token_ids": sorted(core.eos_token_ids)}

    async def stats(self) -> dict[str, Any]:
        """This replica's ``GET /stats`` dict (its own latency windows and counters)."""
        return self.metrics.stats()

    async def families(self) -> list[Any]:
        """This replica's Prometheus metric families (``prometheus_client`` ``Metric``s),
        relabelled ``replica`` and merged by the ingress."""
        return list(self.metrics.registry.collect())

    async def reset_prefix_cache(self) -> int:
        """Drop idle cached KV blocks; how many were dropped."""
        return await self.engine.reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stop the engine loop (requests in flight end with ``abort``)."""
        await asyncio.to_thread(self.engine.shutdown)
