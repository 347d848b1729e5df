"""The load-shedding pass: which waiting requests a step refuses, and why. Torch-free.

Three rules, in order, each seeing only the requests the ones before it kept: waited past
``max_queue_time``; infeasible for the queue policy (``slo``: its TTFT deadline cannot be
met even if it started now); predicted to start too late while the queue stands
(:class:`~inflight.core.overload.OverloadShedder`). A request scheduled once (a preempted
one) is never shed. The scheduler finishes what this returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inflight.core.overload import OverloadShedder
from inflight.core.queue_policy import FCFSPolicy
from inflight.request import Request

# A rule: the waiting requests it may shed -> those it sheds, each with its reason.
Rule = Callable[[list[Request]], list[tuple[Request, str]]]


def requests_to_shed(waiting: Sequence[Request], running: list[Request], now: float, budget: int,
                     ahead: frozenset[str | None], *, policy: FCFSPolicy, overload: OverloadShedder,
                     max_queue_time: float | None) -> list[tuple[Request, str]]:
    """The waiting requests to refuse before this step's admission, each with its reason.

    Args:
        waiting: the waiting queue (arrival order; the rules see it in this order).
        running: the running requests.
        now: seconds on the scheduler's clock.
        budget: the step's token budget (the overload and ``slo`` predictions use it).
        ahead: tenants ahead of their share (``policy.tenants_ahead``); while any are, the
            overload rule sheds only their requests (the overload is theirs).
        policy: the queue policy (``infeasible``, ``waiting_order``).
        overload: the standing-queue shedder.
        max_queue_time: seconds a request may wait; None: no limit.
    """
    def timed_out(queue: list[Request]) -> list[tuple[Request, str]]:
        return [(r, f"waited {now - r.arrival_time:.2f} s, longer than max_queue_time "
                    f"{max_queue_time:g} s") for r in queue if max_queue_time is not None
                and now - r.arrival_time > max_queue_time]

    rules: tuple[Rule, ...] = (
        timed_out,
        lambda queue: policy.infeasible(queue, now, running, budget),
        lambda queue: overload.shed(policy.waiting_order(queue, now), running, now, budget,
                                    (lambda r: r.tenant not in ahead) if ahead else None))
    shed: list[tuple[Request, str]] = []
    for rule in rules:
        seen = {r.request_id for r, _ in shed}
        shed += [(r, why) for r, why in rule([r for r in waiting if r.request_id not in seen])
                 if r.first_scheduled_time is None]
    return shed
