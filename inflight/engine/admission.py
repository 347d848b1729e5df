"""Admission of the server's engine clients: the waiting bound and reservations.

One ``Admission`` serves ``AsyncEngine`` (one engine) and ``ClusterEngine`` (N replicas):
the same rule (``has_room``) over the engines behind the client, the same places held by
``Reservation`` between the HTTP edge's first check and the request's queueing, and the
same errors. The client says what the engines carry now (``Capacity``) and whether it
takes requests at all; the lock is the client's too, so its own bookkeeping (requests in
flight) changes atomically with the places taken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from inflight.errors import EngineDeadError, EngineError, EngineOverloadedError, RequestTooLargeError


def has_room(n: int, num_waiting: int, num_running: int, max_num_seqs: int,
             max_num_waiting: int | None) -> bool:
    """The admission bound: ``n`` more sequences fit if those waiting (queued or pending)
    plus ``n`` stay within ``max_num_waiting`` beyond the free running slots (sequences the
    next step can admit into a free slot do not queue). None: unbounded. The simulator
    applies the same rule."""
    if max_num_waiting is None:
        return True
    return num_waiting + n <= max_num_waiting + max(0, max_num_seqs - num_running)


@dataclass(frozen=True)
class Capacity:
    """What the live engines behind a client carry now, as admission weighs it.

    Attributes:
        num_waiting: sequences waiting in the engines (their queues, commands not yet
            taken), places reserved by this client not included.
        num_running: sequences running in them.
        num_engines: live engines (replicas up); each adds ``max_num_seqs`` running slots
            and ``max_num_waiting`` waiting places.
    """

    num_waiting: int
    num_running: int
    num_engines: int = 1


class Reservation:
    """Places for sequences admitted by ``reserve``; ``release`` gives back those no
    ``add_request`` took (idempotent)."""

    def __init__(self, give_back: Callable[[int], None], num_seqs: int) -> None:
        self._give_back = give_back
        self.remaining = num_seqs

    def release(self) -> None:
        n, self.remaining = self.remaining, 0
        if n:
            self._give_back(n)


class Admission:
    """The waiting bound of one engine client, and the places it reserved.

    Args:
        max_num_seqs: running slots per engine.
        max_num_waiting: per engine, sequences allowed to wait beyond the free running
            slots; None: unbounded.
        capacity: what the live engines carry now; called with ``lock`` held.
        not_accepting: why the client takes no request now (not running, draining), or
            None.
        num_replicas: the client's replicas, for the largest call that could ever be
            queued and the errors' wording; None: one engine.

    Attributes:
        lock: guards ``num_pending`` and whatever the client keeps with it.
        num_pending: sequences admitted here and not yet counted by the engines
            (reserved, or queued as commands).
    """

    def __init__(self, max_num_seqs: int, max_num_waiting: int | None,
                 capacity: Callable[[], Capacity],
                 not_accepting: Callable[[], EngineDeadError | None],
                 num_replicas: int | None = None) -> None:
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting: must be >= 0 or None, got {max_num_waiting!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_waiting = max_num_waiting
        self._capacity = capacity
        self._not_accepting = not_accepting
        self._num_replicas = num_replicas
        self.lock = threading.Lock()
        self.num_pending = 0

    def check_accepting(self) -> None:
        """Raise ``EngineDeadError`` when the client takes no request now."""
        error = self._not_accepting()
        if error is not None:
            raise error

    def check_num_seqs(self, num_seqs: int) -> None:
        """Raise if ``num_seqs`` sequences (one request's ``n``, or a whole API call's
        prompts x ``n``) could never be queued at once, so that no retry could help.

        Raises:
            RequestTooLargeError: more than ``(max_num_seqs + max_num_waiting)`` per engine.
        """
        if self.max_num_waiting is None:
            return
        per_engine = self.max_num_seqs + self.max_num_waiting
        if self._num_replicas is None:
            capacity, rule = per_engine, "max_num_seqs + max_num_waiting"
        else:
            capacity = per_engine * self._num_replicas
            rule = "(max_num_seqs + max_num_waiting) x replicas"
        if num_seqs > capacity:
            raise RequestTooLargeError(
                f"n: {num_seqs} sequences (prompts x n) can never be queued at once; this "
                f"server runs at most {rule} = {capacity}")

    def overload(self, n: int) -> EngineOverloadedError | None:
        """The 503 for ``n`` more sequences, else None. Call with ``lock`` held."""
        cap = self._capacity()
        waiting = self.num_pending + cap.num_waiting
        max_num_seqs = self.max_num_seqs * cap.num_engines
        bound = None if self.max_num_waiting is None else self.max_num_waiting * cap.num_engines
        if has_room(n, waiting, cap.num_running, max_num_seqs, bound):
            return None
        free_slots = max(0, max_num_seqs - cap.num_running)
        if self._num_replicas is None:
            where, more = "", f"max_num_waiting={self.max_num_waiting} more"
        else:
            where = f" on {cap.num_engines} replicas"
            more = f"max_num_waiting={self.max_num_waiting} more per replica"
        return EngineOverloadedError(
            f"the server is overloaded: {waiting} sequences are queued for {free_slots} free "
            f"running slots{where} and {more}; retry later")

    def refusal(self, num_seqs: int = 1) -> EngineError | None:
        """The error ``reserve(num_seqs)`` would raise now, else None; takes nothing.

        For the HTTP edge to refuse a burst before reading a body (one lock, a few
        comparisons): a request that would get 503 should not first be parsed, templated
        and tokenized.
        """
        error = self._not_accepting()
        if error is not None:
            return error
        with self.lock:
            return self.overload(num_seqs)

    def reserve(self, num_seqs: int) -> Reservation:
        """Admit ``num_seqs`` sequences now, before any costly work (templating,
        tokenizing), and hold their places until ``add_request`` takes them or the
        reservation is released: concurrent callers see each other's places, so a burst is
        refused at once rather than after every request's tokenization.

        Raises:
            EngineDeadError: the client takes no request now.
            RequestTooLargeError: ``check_num_seqs``.
            EngineOverloadedError: no room now.
        """
        self.check_accepting()
        self.check_num_seqs(num_seqs)
        with self.lock:
            self._check_room(num_seqs)
            self.num_pending += num_seqs
        return Reservation(self._unreserve, num_seqs)

    def held(self, n: int, reservation: Reservation | None) -> Reservation | None:
        """``reservation`` when it still holds ``n`` places for a request, else None (the
        request is admitted afresh: ``check_num_seqs`` runs here, ``take`` checks room)."""
        if reservation is not None and reservation.remaining >= n:
            return reservation
        self.check_num_seqs(n)
        return None

    def take(self, n: int, held: Reservation | None, *, keep_pending: bool) -> None:
        """Charge a request's ``n`` sequences to ``held``, or admit them now. Call with
        ``lock`` held.

        Args:
            n: the request's sequences.
            held: what ``held`` returned.
            keep_pending: the sequences stay in ``num_pending`` until the engine counts
                them (one engine: a queued command); False: they leave it now (a replica
                counts them from here).

        Raises:
            EngineOverloadedError: not held and no room now.
        """
        if held is not None:
            held.remaining -= n
            if not keep_pending:
                self.num_pending -= n
            return
        self._check_room(n)
        if keep_pending:
            self.num_pending += n

    def _check_room(self, n: int) -> None:
        error = self.overload(n)
        if error is not None:
            raise error

    def _unreserve(self, n: int) -> None:
        with self.lock:
            self.num_pending -= n
