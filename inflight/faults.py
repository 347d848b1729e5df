"""Fault injection: make a chosen call at a named site raise, to test that one bad step or
one bad request never takes the engine down (tests/reliability/test_faults.py).

Sites, each checked where the work happens:

- ``runner``: ``ModelRunner.execute``, the model step (every request in the step fails);
- ``sampler``: ``Sampler.sample``, after the forward pass (every request in the step fails);
- ``detokenizer``: ``OutputProcessor`` turning one sequence's new token into text (only
  that request fails).

A plan may *stall* instead of raising (``stall_s``): the call sleeps, a step that does not
return, for the step watchdog's tests (tests/reliability/test_watchdog.py).

Disarmed, a site costs one dict lookup. Nothing arms a fault outside tests: there is no
flag or environment variable, so a production server cannot be told to fail.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SITES = ("runner", "sampler", "detokenizer")


class InjectedFault(RuntimeError):
    """The error an armed site raises."""


@dataclass
class _Plan:
    nth: int
    request_id: str | None
    remaining: int
    stall_s: float = 0.0
    calls: int = 0


class FaultInjector:
    """Which sites fail, and when. Thread-safe: tests arm on their thread, the engine thread
    trips."""

    def __init__(self) -> None:
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.Lock()
        self.tripped: list[tuple[str, str | None]] = []  # (site, request id) per raise

    def arm(self, site: str, *, nth: int = 1, request_id: str | None = None,
            times: int = 1, stall_s: float = 0.0) -> None:
        """Make the ``nth`` matching call at ``site`` from now raise ``InjectedFault``, and
        the ``times - 1`` matching calls after it; with ``stall_s`` > 0 they sleep that long
        instead (and then go on normally).

        Args:
            site: one of ``SITES``.
            nth: 1 = the next matching call.
            request_id: only calls for this engine request match (the ``detokenizer`` site
                passes its request's id; the step-wide sites pass none, so a filter there
                never matches).
            times: how many matching calls raise in a row.

        Raises:
            ValueError: an unknown site, or ``nth`` / ``times`` below 1.
        """
        if site not in SITES:
            raise ValueError(f"site: must be one of {SITES}, got {site!r}")
        if nth < 1 or times < 1 or stall_s < 0:
            raise ValueError(f"nth and times: must be >= 1, stall_s >= 0, got {nth}, {times}, {stall_s}")
        with self._lock:
            self._plans[site] = _Plan(nth, request_id, times, stall_s)

    def disarm(self) -> None:
        """Clear every plan and the record of raises."""
        with self._lock:
            self._plans.clear()
            self.tripped.clear()

    def check(self, site: str, request_id: str | None = None) -> None:
        """Called at ``site``; raises ``InjectedFault`` (or stalls) when an armed plan says so."""
        if site not in self._plans:
            return
        with self._lock:
            plan = self._plans.get(site)
            if plan is None or (plan.request_id is not None and plan.request_id != request_id):
                return
            plan.calls += 1
            if plan.calls < plan.nth:
                return
            plan.remaining -= 1
            if plan.remaining <= 0:
                del self._plans[site]
            self.tripped.append((site, request_id))
        if plan.stall_s > 0:
            time.sleep(plan.stall_s)
            return
        raise InjectedFault(f"injected fault at {site}"
                            + (f" for {request_id}" if request_id else ""))


FAULTS = FaultInjector()
