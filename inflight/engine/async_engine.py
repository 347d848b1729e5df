"""The engine loop the server uses: ``Engine.step()`` in one background thread.

The asyncio side never runs model work. ``AsyncEngine.add_request`` and ``abort`` only put
commands on a thread-safe queue; the engine thread drains it between steps, steps while
anything is unfinished, and hands each request's outputs to that request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. When idle the thread sleeps on an
event. Torch releases the GIL inside its kernels, so the event loop keeps serving HTTP
while a step runs.

Every request runs in the engine's streaming (delta) mode; ``RequestStream``
(``stream.py``) merges deltas that pile up between reads. Commands are typed dataclasses
(``AddRequest``, ``Abort``, ``AbortAll``, ``Call``), handled in one ``match``.

No request's fault stops the loop: a failed ``add_request`` fails that request, a failed
model step is turned by ``Engine.step`` into error outputs for the requests in it, and any
other exception from ``step`` fails the requests then in flight while the loop goes on.
A step that never returns is the one fault the loop cannot see from inside: the step
watchdog (``watchdog.py``) declares the engine dead, ends the requests in flight with
``EngineDeadError`` and calls ``on_dead`` (the server then exits non-zero); a bug in the
loop itself does the same.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from inflight.config import EngineConfig
from inflight.engine.commands import Abort, AbortAll, AddRequest, Call, Command
from inflight.engine.engine import Engine
from inflight.engine.memory import HeapTrimmer
from inflight.engine.stats import EngineStats, StatsLogger
from inflight.engine.stream import RequestStream
from inflight.engine.watchdog import AUTO_FLOOR_S, AUTO_MULTIPLE, StepWatchdog
from inflight.errors import (EngineDeadError, EngineError, EngineOverloadedError,
                             InvalidRequestError, RequestFailedError, RequestTooLargeError)
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A step that scheduled nothing while requests are unfinished (the dynamic policy holding
# a batch back for ``max_queue_delay``) is retried after this pause instead of spinning.
IDLE_POLL_S = 0.002
# After ``step`` itself raised, back off this long so a persistently broken engine does
# not spin at 100% CPU failing every new request.
_FAILURE_BACKOFF_S = 0.1

StepListener = Callable[[EngineStats, list[RequestOutput], float], None]


def has_room(n: int, num_waiting: int, num_running: int, max_num_seqs: int,
             max_num_waiting: int | None) -> bool:
    """The admission bound: ``n`` more sequences fit if those waiting (queued or pending)
    plus ``n`` stay within ``max_num_waiting`` beyond the free running slots (sequences the
    next step can admit into a free slot do not queue). None: unbounded. The simulator
    applies the same rule."""
    if max_num_waiting is None:
        return True
    return num_waiting + n <= max_num_waiting + max(0, max_num_seqs - num_running)


class AsyncEngine:
    """Drives an ``Engine`` from a background thread for an asyncio server.

    Args:
        engine: the synchronous engine; from ``start()`` on only the engine thread touches it.
        max_num_waiting: bound on sequences waiting for admission (queued commands plus the
            scheduler's waiting queue) beyond the free running slots
            (``max_num_seqs - running``); ``add_request`` past it raises
            ``EngineOverloadedError``. None: unbounded.
        log_interval_s: seconds between stats log lines while busy; 0 disables them.
        listeners: called on the engine thread after every step as
            ``listener(stats, outputs, now)`` (``now`` on the ``time.monotonic()`` clock);
            metrics hook in here. A listener that raises is logged and otherwise ignored.
        watchdog_timeout_s: seconds one step may run before the engine is declared dead
            (``watchdog.py``); None: automatic (20 x the predicted full-budget step, at
            least 60 s); 0: no watchdog.
        watchdog_backstop: also arm ``faulthandler``'s process-wide timer (servers only).

    Attributes:
        on_dead: called once with the reason when the engine dies (a stuck step, a crashed
            loop), on the thread that noticed; the server exits non-zero from here.

    Raises:
        ValueError: a negative ``max_num_waiting`` or ``watchdog_timeout_s``.
    """

    def __init__(self, engine: Engine, *, max_num_waiting: int | None = None,
                 log_interval_s: float = 10.0, listeners: Sequence[StepListener] = (),
                 watchdog_timeout_s: float | None = None, watchdog_backstop: bool = False) -> None:
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting: must be >= 0 or None, got {max_num_waiting!r}")
        if watchdog_timeout_s is not None and watchdog_timeout_s < 0:
            raise ValueError(f"watchdog_timeout: must be >= 0 s (0: off), got {watchdog_timeout_s!r}")
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self.listeners: list[StepListener] = list(listeners)
        if log_interval_s > 0:
            self.listeners.append(StatsLogger(log_interval_s, getattr(engine, "step_timer", None)))
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _num_pending and _streams
        self._num_pending = 0  # sequences queued as add commands, not yet in the scheduler
        self._streams: dict[str, RequestStream] = {}
        self._stats = engine.get_stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self.heap = HeapTrimmer()  # freed step tensors go back to the OS (engine/memory.py)
        self._dead: str | None = None
        self.on_dead: list[Callable[[str], None]] = []
        self.watchdog: StepWatchdog | None = None
        if watchdog_timeout_s != 0:
            timeout = self._auto_watchdog_timeout if watchdog_timeout_s is None else watchdog_timeout_s
            self.watchdog = StepWatchdog(timeout, self._declare_dead, self._describe_step,
                                         backstop=watchdog_backstop)
        # Times the loop waited (idle, or after a step that did nothing): a step log keeps
        # only steps that followed one another directly.
        self.num_waits = 0

    # --- passthroughs the HTTP layer needs (read-only after construction) ---------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.kv_cache.num_blocks

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """``Engine.check_prompt_fits``; safe on the event loop (it reads only settings)."""
        return self.engine.check_prompt_fits(num_prompt_tokens, max_tokens)

    def compile_grammar(self, params: Any) -> Any:
        """``Engine.compile_grammar``: thread-safe and cached, so the server compiles on a
        worker thread and the engine thread's own call finds the grammar compiled."""
        return self.engine.compile_grammar(params)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and accepting requests."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._dead is None)

    @property
    def is_accepting(self) -> bool:
        """True while new requests are taken: running and not draining for shutdown."""
        return self.is_running and not self._draining

    @property
    def num_in_flight(self) -> int:
        """Requests (API-level, each ``n`` sequences) queued or running, not yet finished."""
        with self._lock:
            return len(self._streams)

    def drain(self) -> None:
        """Refuse new requests (503 ``server_unavailable``) and let those in flight run on:
        the first phase of a graceful shutdown, so that a client that comes during it hears
        why instead of finding the port closed (idempotent)."""
        self._draining = True

    def _not_accepting(self) -> EngineDeadError | None:
        if not self.is_running:
            return EngineDeadError(self._dead or "the engine is not running")
        if self._draining:
            return EngineDeadError("the server is shutting down; retry on another replica")
        return None

    def _check_accepting(self) -> None:
        error = self._not_accepting()
        if error is not None:
            raise error

    def get_stats(self) -> EngineStats:
        """The engine's stats as of the end of the last loop iteration (never blocks)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, queued commands included."""
        with self._lock:
            return self._num_pending + self._stats.num_waiting

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self._thread.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting requests, abort those in flight, and join the engine thread.

        Aborted requests still receive their final ``finish_reason="abort"`` output.
        """
        self._stopping = True
        self._wake.set()
        if self.watchdog is not None:
            self.watchdog.stop()
            if self.watchdog.fired:  # the engine thread is stuck in its step: not joinable
                timeout = 0.0
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.1f s", timeout)

    # --- requests (event-loop side) -------------------------------------------------------
    def check_num_seqs(self, num_seqs: int) -> None:
        """Raise if ``num_seqs`` sequences (one request's ``n``, or a whole API call's prompts
        x ``n``) could never be queued at once, so that no retry could help.

        Raises:
            RequestTooLargeError: ``num_seqs > max_num_seqs + max_num_waiting``.
        """
        if self.max_num_waiting is None:
            return
        capacity = self.engine.config.max_num_seqs + self.max_num_waiting
        if num_seqs > capacity:
            raise RequestTooLargeError(
                f"n: {num_seqs} sequences (prompts x n) can never be queued at once; this server runs at most "
                f"max_num_seqs + max_num_waiting = {capacity}")

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams, *, arrival_time: float | None = None,
                    options: RequestOptions | None = None,
                    reservation: "Reservation | None" = None, stream: bool = True,
                    ) -> RequestStream:
        """Queue a request; returns its ``RequestStream`` at once.

        Must be called from a running event loop (the outputs are delivered to it).

        Args:
            request_id: unique among unfinished requests.
            prompt: token ids (validated by the caller) or text.
            sampling_params: validated parameters.
            arrival_time: ``time.monotonic()`` seconds when the request arrived; TTFT and
                queue time count from here. Now when None.
            options: priority and latency targets for the scheduler.
            reservation: places taken earlier by ``reserve``; this request uses ``n`` of
                them instead of being admitted again.
            stream: False for a caller that wants only the final output (a non-streamed
                API call): the stream is ``final_only``, and the event loop is woken once
                per request instead of once per token.

        Raises:
            EngineOverloadedError: ``max_num_waiting`` sequences already wait.
            EngineDeadError: the engine loop is not running, or it drains for shutdown.
            InvalidRequestError: ``request_id`` is already in flight.
            RequestTooLargeError: ``n`` exceeds what could ever be queued
                (``max_num_seqs + max_num_waiting``): retrying cannot help.
        """
        self._check_accepting()
        loop = asyncio.get_running_loop()
        n = sampling_params.n
        held = reservation if reservation is not None and reservation.remaining >= n else None
        if held is None:
            self.check_num_seqs(n)
        out = RequestStream(request_id, self.abort, loop, final_only=not stream)
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
            if held is not None:
                held.remaining -= n  # already counted in _num_pending
            else:
                self._check_room(n)
                self._num_pending += n
            self._streams[request_id] = out
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(AddRequest(request_id, prompt, sampling_params, arrival,
                                      options or RequestOptions()))
        self._wake.set()
        return out

    def reserve(self, num_seqs: int) -> "Reservation":
        """Admit ``num_seqs`` sequences now, before any costly work (templating,
        tokenizing), and hold their places until ``add_request`` takes them or the
        reservation is released: concurrent callers see each other's places, so a burst is
        refused at once rather than after every request's tokenization.

        Raises:
            EngineDeadError, RequestTooLargeError, EngineOverloadedError: as ``add_request``.
        """
        self._check_accepting()
        self.check_num_seqs(num_seqs)
        with self._lock:
            self._check_room(num_seqs)
            self._num_pending += num_seqs
        return Reservation(self._unreserve, num_seqs)

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._num_pending -= n

    def refusal(self, num_seqs: int = 1) -> EngineError | None:
        """The error ``reserve(num_seqs)`` would raise now, else None; takes nothing.

        For the HTTP edge to refuse a burst before reading a body (one lock, a few
        comparisons): a request that would get 503 should not first be parsed, templated
        and tokenized.
        """
        error = self._not_accepting()
        if error is not None:
            return error
        with self._lock:
            return self._overload(num_seqs)

    def _overload(self, n: int) -> EngineOverloadedError | None:
        # Called with the lock held.
        waiting = self._num_pending + self._stats.num_waiting
        max_num_seqs = self.engine.config.max_num_seqs
        if has_room(n, waiting, self._stats.num_running, max_num_seqs, self.max_num_waiting):
            return None
        free_slots = max(0, max_num_seqs - self._stats.num_running)
        return EngineOverloadedError(
            f"the server is overloaded: {waiting} sequences are queued for "
            f"{free_slots} free running slots and max_num_waiting="
            f"{self.max_num_waiting} more; retry later")

    def _check_room(self, n: int) -> None:
        # Called with the lock held.
        error = self._overload(n)
        if error is not None:
            raise error

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort ``request_id`` (no-op if it already finished)."""
        self._commands.put(Abort(request_id))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Drop idle cached KV blocks, on the engine thread between steps; returns how many.

        Raises:
            EngineDeadError: the engine loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self._commands.put(Call(self.engine.reset_prefix_cache, loop, done))
        self._wake.set()
        result: int = await done
        return result

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown's grace period ran out)."""
        self._commands.put(AbortAll())
        self._wake.set()

    async def generate(self, request_id: str, prompt: str | Sequence[int],
                       sampling_params: SamplingParams, *,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its deltas; leaving early (a cancelled task, a
        ``break``) aborts the request. Raises as ``add_request`` and ``RequestStream``."""
        stream = self.add_request(request_id, prompt, sampling_params, arrival_time=arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # --- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        failures = 0
        try:
            while self._dead is None:
                self._wake.clear()
                self._drain_commands()
                if self._stopping:
                    self._abort_all()
                if not engine.has_unfinished_requests():
                    self._refresh_stats()
                    if self._stopping:
                        break
                    self.heap.maybe(idle=True)
                    self.num_waits += 1
                    self._wake.wait()
                    continue
                steps_before = self._stats.num_steps
                if self.watchdog is not None:
                    self.watchdog.step_began()
                try:
                    outputs = engine.step()
                except Exception as e:
                    failures += 1
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    self.num_waits += 1
                    self._wake.wait(_FAILURE_BACKOFF_S * min(failures, 10))
                    continue
                finally:
                    if self.watchdog is not None:
                        self.watchdog.step_ended()
                if self._dead is not None:  # the watchdog gave up on this step meanwhile
                    break
                failures = 0
                # Counts first: whoever sees this step's tokens (a client deciding what to
                # send next, the admission bound) sees this step's queue, not the last one's.
                stats = self._refresh_stats()
                self._deliver(outputs)
                self._notify_listeners(stats, outputs)
                self.heap.maybe(idle=False)
                if not outputs and self._stats.num_steps == steps_before:
                    self.num_waits += 1
                    self._wake.wait(IDLE_POLL_S)
        except BaseException as e:  # a bug in this loop: fail everyone rather than hang them
            logger.exception("engine loop crashed")
            self._declare_dead(f"engine loop crashed: {type(e).__name__}: {e}")
            raise
        finally:
            self._dead = self._dead or "the engine is shut down"

    def _declare_dead(self, reason: str) -> None:
        """The engine will not step again: refuse new requests (``/health`` 503), end those in
        flight with ``EngineDeadError``, tell ``on_dead``. Never touches the engine: its
        thread may be stuck inside it (any thread may call this)."""
        if self._dead is not None:
            return
        self._dead = reason
        self._wake.set()
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._num_pending = 0
        for s in streams:
            s.put(EngineDeadError(reason))
        for callback in self.on_dead:
            try:
                callback(reason)
            except Exception:
                logger.exception("on_dead callback %r failed", callback)

    def _auto_watchdog_timeout(self) -> float:
        model = self.engine.scheduler.step_model
        full = self.config.max_num_batched_tokens
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
            with self._lock:
                self._num_pending -= n
                stream = self._streams.pop(cmd.request_id, None)
            if stream is not None:
                stream.put(_as_engine_error(e))
            return
        with self._lock:
            self._num_pending -= n
            self._stats = replace(self._stats, num_waiting=self._stats.num_waiting + n)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id, None) if out.finished \
                    else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _refresh_stats(self) -> EngineStats:
        stats = self.engine.get_stats()
        with self._lock:
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
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.engine.abort_request(rid, reason="the server is shutting down")

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for rid, stream in streams:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            stream.put(RequestFailedError(message))


class Reservation:
    """Places for sequences admitted by ``AsyncEngine.reserve``; ``release`` gives back
    those no ``add_request`` took (idempotent)."""

    def __init__(self, give_back: Callable[[int], None], num_seqs: int) -> None:
        self._give_back = give_back
        self.remaining = num_seqs

    def release(self) -> None:
        n, self.remaining = self.remaining, 0
        if n:
            self._give_back(n)


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
