"""The engine thread of ``AsyncEngine``: ``Engine.step()`` in a loop, commands between steps.

The event-loop side (``async_engine.AsyncEngine``) only puts commands on a thread-safe
queue and sets ``_wake``; this thread drains the queue between steps, steps while anything
is unfinished, and hands each request's outputs to its ``RequestStream``. When idle it
sleeps on the event.

No request's fault stops the loop: a failed ``add_request`` fails that request, a failed
model step is turned by ``Engine.step`` into error outputs for the requests in it, and any
other exception from ``step`` fails the requests then in flight while the loop goes on.
A step that never returns is the one fault the loop cannot see from inside: the step
watchdog (``watchdog.py``) declares the engine dead, ends the requests in flight with
``EngineDeadError`` and calls ``on_dead``; a bug in the loop itself does the same.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from inflight.engine.admission import Admission
from inflight.engine.commands import Abort, AbortAll, AddRequest, Call, Command
from inflight.engine.engine import Engine
from inflight.engine.engine_client import StepListener
from inflight.engine.memory import HeapTrimmer
from inflight.engine.stats import EngineStats
from inflight.engine.stream import RequestStream
from inflight.engine.watchdog import AUTO_FLOOR_S, AUTO_MULTIPLE, StepWatchdog
from inflight.errors import EngineDeadError, EngineError, InvalidRequestError, RequestFailedError
from inflight.outputs import RequestOutput

logger = logging.getLogger(__name__)

# A step that scheduled nothing while requests are unfinished (the dynamic policy holding
# a batch back for ``max_queue_delay``) is retried after this pause instead of spinning.
IDLE_POLL_S = 0.002
# After ``step`` itself raised, back off this long so a persistently broken engine does
# not spin at 100% CPU failing every new request.
_FAILURE_BACKOFF_S = 0.1


class EngineThread:
    """The state shared by the engine thread and the event-loop side, and the thread's
    loop. ``AsyncEngine`` builds on it; see there for the arguments.

    Attributes:
        engine: the synchronous engine; from ``start()`` on only the engine thread
            touches it.
        admission: the waiting bound and reservations; its lock guards ``_streams`` too.
        on_dead: called once with the reason when the engine dies.
        num_waits: times the loop waited (idle, or after a step that did nothing): a step
            log keeps only steps that followed one another directly.
    """

    engine: Engine
    admission: Admission
    listeners: list[StepListener]
    on_dead: list[Callable[[str], None]]
    watchdog: StepWatchdog | None

    def _init_thread_state(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stats = engine.get_stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None
        self.on_dead = []
        self.heap = HeapTrimmer()  # freed step tensors go back to the OS (engine/memory.py)
        self.num_waits = 0

    def _run(self) -> None:
        failures = 0
        try:
            while self._dead is None:
                self._wake.clear()
                self._drain_commands()
                if self._stopping:
                    self._abort_all()
                if not self.engine.has_unfinished_requests():
                    self._refresh_stats()
                    if self._stopping:
                        break
                    self.heap.maybe(idle=True)
                    self.num_waits += 1
                    self._wake.wait()
                    continue
                failures = self._step(failures)
        except BaseException as e:  # a bug in this loop: fail everyone rather than hang them
            logger.exception("engine loop crashed")
            self._declare_dead(f"engine loop crashed: {type(e).__name__}: {e}")
            raise
        finally:
            self._dead = self._dead or "the engine is shut down"

    def _step(self, failures: int) -> int:
        """One engine step and its delivery; returns the count of steps failed in a row."""
        steps_before = self._stats.num_steps
        if self.watchdog is not None:
            self.watchdog.step_began()
        try:
            outputs = self.engine.step()
        except Exception as e:
            failures += 1
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self.num_waits += 1
            self._wake.wait(_FAILURE_BACKOFF_S * min(failures, 10))
            return failures
        finally:
            if self.watchdog is not None:
                self.watchdog.step_ended()
        if self._dead is not None:  # the watchdog gave up on this step meanwhile
            return 0
        # Counts first: whoever sees this step's tokens (a client deciding what to send
        # next, the admission bound) sees this step's queue, not the last one's.
        stats = self._refresh_stats()
        self._deliver(outputs)
        self._notify_listeners(stats, outputs)
        self.heap.maybe(idle=False)
        if not outputs and self._stats.num_steps == steps_before:
            self.num_waits += 1
            self._wake.wait(IDLE_POLL_S)
        return 0

    def _declare_dead(self, reason: str) -> None:
        """The engine will not step again: refuse new requests (``/health`` 503), end those in
        flight with ``EngineDeadError``, tell ``on_dead``. Never touches the engine: its
        thread may be stuck inside it (any thread may call this)."""
        if self._dead is not None:
            return
        self._dead = reason
        self._wake.set()
        with self.admission.lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self.admission.num_pending = 0
        for s in streams:
            s.put(EngineDeadError(reason))
        for callback in self.on_dead:
            try:
                callback(reason)
            except Exception:
                logger.exception("on_dead callback %r failed", callback)

    def _auto_watchdog_timeout(self) -> float:
        model = self.engine.scheduler.step_model
        full = self.engine.config.max_num_batched_tokens
        predicted = model.predict(full) if model.ready else 0.0
        return max(AUTO_FLOOR_S, AUTO_MULTIPLE * predicted)

    def _describe_step(self) -> str:
        plan = getattr(self.engine, "last_plan", None)
        if plan is None or plan.is_empty:
            return "no plan scheduled yet"
        rows = plan.scheduled
        prefill = [s for s in rows if not s.samples or len(s.token_ids) > 1]
        return (f"last plan scheduled: {len(rows)} rows, {plan.num_batched_tokens} tokens "
                f"({len(prefill)} prefill rows with {sum(len(s.token_ids) for s in prefill)} tokens, "
                f"{len(rows) - len(prefill)} decode rows)")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            match cmd:
                case AddRequest():
                    self._add(cmd)
                case Abort(request_id=rid):
                    try:
                        self.engine.abort_request(rid)
                    except Exception:
                        logger.exception("abort of %s failed", rid)
                case AbortAll():
                    self._abort_all()
                case Call(fn=fn, loop=loop, done=done):
                    try:
                        result, error = fn(), None
                    except Exception as e:
                        result, error = None, e
                    loop.call_soon_threadsafe(_settle, done, result, error)

    def _add(self, cmd: AddRequest) -> None:
        n = cmd.params.n
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, stream=True,
                                    arrival_time=cmd.arrival_time, options=cmd.options)
        except Exception as e:
            with self.admission.lock:
                self.admission.num_pending -= n
                stream = self._streams.pop(cmd.request_id, None)
            if stream is not None:
                stream.put(_as_engine_error(e))
            return
        with self.admission.lock:
            self.admission.num_pending -= n
            self._stats = replace(self._stats, num_waiting=self._stats.num_waiting + n)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self.admission.lock:
                stream = self._streams.pop(out.request_id, None) if out.finished \
                    else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _refresh_stats(self) -> EngineStats:
        stats = self.engine.get_stats()
        with self.admission.lock:
            self._stats = stats
        return stats

    def _notify_listeners(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for listener in self.listeners:
            try:
                listener(stats, outputs, now)
            except Exception:
                logger.exception("step listener %r failed", listener)

    def _abort_all(self) -> None:
        with self.admission.lock:
            ids = list(self._streams)
        for rid in ids:
            self.engine.abort_request(rid, reason="the server is shutting down")

    def _fail_all(self, message: str) -> None:
        with self.admission.lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for rid, stream in streams:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            stream.put(RequestFailedError(message))


def _as_engine_error(e: Exception) -> EngineError:
    if isinstance(e, EngineError):
        return e
    if isinstance(e, ValueError):
        return InvalidRequestError(str(e))
    return RequestFailedError(f"{type(e).__name__}: {e}")


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the caller went away
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
