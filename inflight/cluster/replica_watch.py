"""The output side of ``ClusterEngine``: one watcher task per replica.

Each watcher keeps a Ray streaming call (``ReplicaServer.outputs``) open for its replica's
life, hands each batch's deltas to their requests' ``RequestStream``s and feeds the
listeners; when the replica's process dies the stream raises, and every request in flight
there ends at once with ``RequestFailedError`` while the watcher waits for Ray's restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from inflight.cluster.replica_state import ReplicaState, ray_error_cause, zero_stats
from inflight.engine.admission import Admission
from inflight.engine.engine_client import StepListener
from inflight.engine.stats import EngineStats, sum_stats
from inflight.engine.stream import RequestStream
from inflight.errors import EngineError, RequestFailedError
from inflight.outputs import RequestOutput
from inflight.routing import Router

logger = logging.getLogger(__name__)

# Pause between checks whether a dead replica is back.
_RETRY_S = 0.2


class ReplicaWatchers:
    """The requests in flight on the replicas, and the watchers that deliver their
    outputs. ``ClusterEngine`` builds on it.

    Attributes:
        replicas: the ingress's view of each replica.
        router: the ``inflight.routing`` policy (``observe``/``forget`` when it learns).
        admission: its lock guards the request tables and each replica's ``seqs``.
    """

    replicas: list[ReplicaState]
    router: Router
    admission: Admission
    listeners: list[StepListener]
    _stopping: bool

    def _init_tables(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._owner: dict[str, int] = {}
        # For a router that learns from finished requests (prefix affinity): the prompt ids
        # plus the generated ids so far, per request in flight.
        self._kv_ids: dict[str, list[int]] = {}

    def get_stats(self) -> EngineStats:
        """The replicas' last reported stats, summed (KV usage: the mean over live ones)."""
        live = [r.stats for r in self.replicas if r.up] or [zero_stats()]
        total = sum_stats(live)
        return replace(total, kv_cache_usage=total.kv_cache_usage / len(live))

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
            with self.admission.lock:
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
        with self.admission.lock:
            stream = self._streams.get(rid)
            self._forget(rid)
        if stream is not None:
            stream.put(error)

    def _replica_down(self, r: ReplicaState, e: BaseException) -> None:
        r.up = False
        with self.admission.lock:
            lost = [rid for rid, i in self._owner.items() if i == r.index]
        why = f"engine replica {r.index} died ({ray_error_cause(e)}); its requests were lost"
        logger.error("%s: %d in flight", why, len(lost))
        for rid in lost:
            self._end(rid, RequestFailedError(why))
        r.lost += len(lost)
        r.stats, r.num_waiting = zero_stats(), 0
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


