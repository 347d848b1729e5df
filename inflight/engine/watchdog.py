"""The step watchdog: an engine step that never returns is noticed within seconds.

A kernel deadlock, a stuck lock or a hung allocation leaves the engine thread inside
``Engine.step()`` for ever. Nothing else notices: the HTTP side keeps answering ``/health``
with 200 while every request hangs. SGLang guards this with ``--watchdog-timeout`` (its
scheduler's watchdog thread kills the process when a forward pass exceeds it); vLLM marks
the engine dead and stops the server. Ours:

- The engine thread calls ``step_began()`` and ``step_ended()`` around each step (two
  attribute writes). A daemon thread checks every ``check_interval_s`` whether the step in
  progress has run longer than the timeout; once it has, ``on_stuck(message)`` runs on the
  watchdog thread, once, with the step's number, how long it ran and its plan (rows,
  prefill and decode tokens) in the message. ``AsyncEngine`` then marks itself dead
  (``/health`` 503), ends every request in flight with an error, and the server exits
  non-zero so a supervisor (systemd, Kubernetes, Ray) restarts it.
- The timeout: ``--watchdog-timeout S``; by default (``auto``) ``AUTO_MULTIPLE`` x the step
  time the engine's own step model predicts for a full token budget, at least
  ``AUTO_FLOOR_S``. A step that legitimately takes that long is already unusable.
- A thread that hangs while holding Python's GIL (a native kernel that never releases it)
  stops the watchdog thread too. With ``backstop=True`` (the server's processes; the timer
  is process-wide) the watchdog keeps ``faulthandler``'s C-level timer armed at
  ``timeout + BACKSTOP_S``, re-armed at every check: if the checks stop, it dumps every
  thread's traceback to stderr and exits the process with status 1 without the GIL.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

AUTO_FLOOR_S = 60.0  # the automatic timeout is never below this (first steps compile, warm)
AUTO_MULTIPLE = 20.0  # x the predicted full-budget step
BACKSTOP_S = 30.0  # the GIL-free timer fires this long after the watchdog should have
# The exit status of a server whose engine died (a stuck step, a crashed loop): sysexits.h's
# EX_SOFTWARE, so a supervisor tells it from a clean stop (0) and a bad flag (2).
EXIT_ENGINE_DEAD = 70


class StepWatchdog:
    """Notices an engine step running longer than ``timeout_s``.

    Args:
        timeout_s: seconds a step may run, > 0; or a callable returning it, asked at each
            check (the automatic timeout follows the step model as it learns).
        on_stuck: called once, on the watchdog thread, with a message naming the step.
        describe: returns the running step's plan as text (called on the watchdog thread;
            it must only read).
        check_interval_s: seconds between checks (default: a tenth of the timeout, 0.05-1 s).
        backstop: keep ``faulthandler``'s timer armed (process-wide; module doc).
        backstop_s: how long after the timeout the backstop fires.
        clock: monotonic seconds.

    Raises:
        ValueError: a timeout that is not positive.
    """

    def __init__(self, timeout_s: float | Callable[[], float], on_stuck: Callable[[str], None],
                 describe: Callable[[], str] = lambda: "", *, check_interval_s: float | None = None,
                 backstop: bool = False, backstop_s: float = BACKSTOP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout = timeout_s if callable(timeout_s) else (lambda: float(timeout_s))
        if self._timeout() <= 0:
            raise ValueError(f"watchdog_timeout: must be > 0 s, got {self._timeout()!r}")
        self._on_stuck = on_stuck
        self._describe = describe
        self._check_interval = check_interval_s
        self._backstop = backstop
        self._backstop_s = backstop_s
        self._clock = clock
        self._began: float | None = None  # when the step in progress began; None between steps
        self._step = 0
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def timeout_s(self) -> float:
        """The timeout now (s): fixed, or the automatic one as the step model has learned it."""
        return self._timeout()

    # --- the engine thread ------------------------------------------------------------------
    def step_began(self) -> None:
        self._step += 1
        self._began = self._clock()

    def step_ended(self) -> None:
        self._began = None

    # --- the watchdog thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start checking (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="inflight-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop checking and disarm the backstop."""
        self._stop.set()
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def check(self) -> bool:
        """One check; True when it found the step stuck (and called ``on_stuck``)."""
        began, timeout = self._began, self._timeout()
        if self.fired is not None or began is None:
            return False
        ran = self._clock() - began
        if ran <= timeout:
            return False
        plan = self._describe()
        self.fired = (f"engine step {self._step} did not return within the watchdog timeout of "
                      f"{timeout:.3g} s (running for {ran:.3g} s){': ' + plan if plan else ''}")
        logger.critical("%s; the engine is dead", self.fired)
        self._on_stuck(self.fired)
        return True

    def _arm_backstop(self, seconds: float) -> None:
        try:
            faulthandler.dump_traceback_later(seconds, exit=True)
        except (ValueError, RuntimeError, OSError, AttributeError) as e:  # no usable stderr
            logger.warning("watchdog backstop off: faulthandler cannot write to stderr (%s)", e)
            self._backstop = False

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout = self._timeout()
            if self._backstop:
                self._arm_backstop(timeout + self._backstop_s)
            if self.check():
                if self._backstop:  # the process is going down on purpose: let it
                    faulthandler.cancel_dump_traceback_later()
                return
            self._stop.wait(self._check_interval or min(1.0, max(0.05, timeout / 10)))
