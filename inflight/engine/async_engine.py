"""The engine client of one in-process engine: ``AsyncEngine``, the event-loop side.

The asyncio side never runs model work. ``AsyncEngine.add_request`` and ``abort`` only put
commands on a thread-safe queue; the engine thread (``engine_thread.EngineThread``) drains
it between steps and hands each request's outputs to that request's ``asyncio.Queue``
through ``loop.call_soon_threadsafe``. Torch releases the GIL inside its kernels, so the
event loop keeps serving HTTP while a step runs.

Every request runs in the engine's streaming (delta) mode; ``RequestStream``
(``stream.py``) merges deltas that pile up between reads, and a ``final_only`` one hands
over only the final output. Commands are typed dataclasses (``AddRequest``, ``Abort``,
``AbortAll``, ``Call``), handled in one ``match``. Admission (the waiting bound,
reservations) is ``admission.Admission``, shared with the Ray ``ClusterEngine``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from inflight.config import EngineConfig
from inflight.engine.admission import Admission, Capacity, Reservation
from inflight.engine.commands import Abort, AbortAll, AddRequest, Call
from inflight.engine.engine import Engine
from inflight.engine.engine_client import StepListener
from inflight.engine.engine_thread import EngineThread
from inflight.engine.stats import EngineStats, StatsLogger
from inflight.engine.stream import RequestStream
from inflight.engine.watchdog import StepWatchdog
from inflight.errors import EngineDeadError, EngineError, InvalidRequestError
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from inflight.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)


class AsyncEngine(EngineThread):
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
        self.admission = Admission(engine.config.max_num_seqs, max_num_waiting, self._capacity,
                                   self._not_accepting)
        if watchdog_timeout_s is not None and watchdog_timeout_s < 0:
            raise ValueError(f"watchdog_timeout: must be >= 0 s (0: off), got {watchdog_timeout_s!r}")
        self._init_thread_state(engine)
        self.listeners = list(listeners)
        if log_interval_s > 0:
            self.listeners.append(StatsLogger(log_interval_s, getattr(engine, "step_timer", None)))
        self._draining = False
        self.watchdog = None
        if watchdog_timeout_s != 0:
            timeout = self._auto_watchdog_timeout if watchdog_timeout_s is None else watchdog_timeout_s
            self.watchdog = StepWatchdog(timeout, self._declare_dead, self._describe_step,
                                         backstop=watchdog_backstop)

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

    @property
    def kv_cache_dtype(self) -> str:
        """The KV tensors' element type where the runner has them, else the setting."""
        caches = getattr(getattr(self.engine, "runner", None), "kv_caches", None)
        if not caches:
            return self.config.kv_cache_dtype
        from inflight.model import kv_quant  # here: an engine without a model imports no torch

        return kv_quant.dtype_name(caches[0].dtype)

    @property
    def max_num_waiting(self) -> int | None:
        return self.admission.max_num_waiting

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """``Engine.check_prompt_fits``; safe on the event loop (it reads only settings)."""
        return self.engine.check_prompt_fits(num_prompt_tokens, max_tokens)

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
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
        with self.admission.lock:
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

    def _capacity(self) -> Capacity:
        # Called with the admission lock held.
        return Capacity(self._stats.num_waiting, self._stats.num_running)

    def get_stats(self) -> EngineStats:
        """The engine's stats as of the end of the last loop iteration (never blocks)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, queued commands included."""
        with self.admission.lock:
            return self.admission.num_pending + self._stats.num_waiting

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
        """``Admission.check_num_seqs``: ``RequestTooLargeError`` when ``num_seqs``
        sequences exceed ``max_num_seqs + max_num_waiting``."""
        self.admission.check_num_seqs(num_seqs)

    def reserve(self, num_seqs: int) -> Reservation:
        """``Admission.reserve``: hold places for ``num_seqs`` sequences before templating
        and tokenizing. Raises ``EngineDeadError``, ``RequestTooLargeError``,
        ``EngineOverloadedError`` as ``add_request``."""
        return self.admission.reserve(num_seqs)

    def refusal(self, num_seqs: int = 1) -> EngineError | None:
        """``Admission.refusal``: the error ``reserve(num_seqs)`` would raise now, else
        None; takes nothing."""
        return self.admission.refusal(num_seqs)

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams, *, arrival_time: float | None = None,
                    options: RequestOptions | None = None,
                    reservation: Reservation | None = None, final_only: bool = False,
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
            final_only: for a caller that wants only the final output (a non-streamed API
                call): the event loop is woken once per request instead of once per token
                (the engine still makes deltas, for the metrics).

        Raises:
            EngineOverloadedError: ``max_num_waiting`` sequences already wait.
            EngineDeadError: the engine loop is not running, or it drains for shutdown.
            InvalidRequestError: ``request_id`` is already in flight.
            RequestTooLargeError: ``n`` exceeds what could ever be queued
                (``max_num_seqs + max_num_waiting``): retrying cannot help.
        """
        admission = self.admission
        admission.check_accepting()
        loop = asyncio.get_running_loop()
        n = sampling_params.n
        held = admission.held(n, reservation)
        out = RequestStream(request_id, self.abort, loop, final_only=final_only)
        with admission.lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
            admission.take(n, held, keep_pending=True)  # until the engine thread takes it
            self._streams[request_id] = out
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(AddRequest(request_id, prompt, sampling_params, arrival,
                                      options or RequestOptions()))
        self._wake.set()
        return out

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort ``request_id`` (no-op if it already finished)."""
        self._commands.put(Abort(request_id))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Drop idle cached KV blocks, on the engine thread between steps; returns how many.

        Raises:
            EngineDeadError: the engine loop is not running.
        """
        result: int = await self._call(self.engine.reset_prefix_cache)
        return result

    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Load a LoRA adapter (``Engine.add_lora``) between steps; its id. The files are
        read on the engine thread: a load pauses generation for that long.

        Raises:
            EngineDeadError: the engine loop is not running. ValueError
                (``InvalidRequestError``, ``LoRAError``): as ``Engine.add_lora``.
        """
        result: int = await self._call(lambda: self.engine.add_lora(name, path, base_model_name))
        return result

    async def remove_lora(self, name: str) -> bool:
        """Unload a LoRA adapter between steps (``Engine.remove_lora``)."""
        result: bool = await self._call(lambda: self.engine.remove_lora(name))
        return result

    def lora_modules(self) -> list[Any]:
        """The adapters served now (``lora.lora_config.LoRAModule``: name, path,
        base_model_name), in load order; empty with LoRA off."""
        lora = self.engine.lora
        return [] if lora is None else lora.registry.modules()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._commands.put(Call(fn, loop, done))
        self._wake.set()
        return await done

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

