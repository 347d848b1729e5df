"""Scheduling policies: who is admitted next, who is preempted first, who is shed. Torch-free.

- ``fcfs``: arrival order; preempt the newest running request (vLLM's default).
- ``priority``: lower ``Request.priority`` first, ties by arrival (vLLM's ``priority``
  policy); under KV pressure the lowest-priority running request is preempted first.
  Aging prevents starvation: every ``priority_aging_s`` seconds a request waits improves
  its effective priority by one level (``priority - floor(waited / priority_aging_s)``,
  ties by arrival). The bound this gives: a request of priority ``p`` goes ahead of every
  request of priority ``q`` that arrives ``(p - q) * priority_aging_s`` seconds or more
  after it (``PriorityPolicy.outranks_after``). So under saturation by a stream of fresh
  priority-``q`` requests it is admitted at the first step at or after
  ``arrival + (p - q) * priority_aging_s`` (20 s for priority 10 over priority 0 at the
  default 2 s), later only by the time to admit requests queued ahead of it that arrived
  before that; once running it needs its own generation time, unless KV pressure preempts
  it (aging orders the waiting queue, not preemption). vLLM's priority policy has no
  aging; this is the classic aging remedy for starvation in priority scheduling.
- ``slo``: earliest deadline first (Liu & Layland, JACM 1973) on the waiting queue, deadline
  = arrival + TTFT target; the step's token budget is capped so the predicted step time
  stays within the tightest ITL target of the running decodes, and prefills get what is
  left (Sarathi-Serve's stall-free batching with a TBT-SLO-derived budget, Agrawal et al.,
  OSDI 2024); a waiting request whose TTFT deadline cannot be met even if it started now
  is shed at once rather than served late (deadline-aware admission control).
- ``fair``: tenants (``Request.tenant``, the name of the API key) share the engine by the
  Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI
  2024): each tenant's counter adds the prompt tokens computed for it and twice its
  generated tokens (the paper's weights: an output token costs about two input tokens);
  admission serves the tenant with the smallest counter first, and a tenant that comes
  back after an idle spell has its counter lifted to the smallest active one, so idling
  banks no credit. Within a tenant: ``priority`` with aging, then arrival, as ``priority``.
  Under KV pressure the running request of the tenant with the largest counter is
  preempted first. Admission order alone does not keep a light tenant's latency: on a
  CPU a step's time grows with every row and prompt token in it, so a light tenant's
  first token would wait for the heavy tenant's prompt chunks already running and then
  ride a step filled to the cap with the heavy tenant's work. So the step composition
  follows the counters too: while a tenant whose counter is more than one step's tokens
  (``max_num_batched_tokens``) below another's has a request waiting, the step leaves the
  higher tenants out (their prompt chunks and decode rows wait one step, never two in a
  row), and the waiting request's first token comes from a step about as long as if it
  were alone. Token-level pausing of requests ahead of their share is Andes' (Liu et al.,
  "Andes: Defining and Enhancing Quality-of-Experience in LLM-Based Text Streaming
  Services", 2024); within one step's tokens tenants count as even, so balanced tenants
  do not split steps.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Iterable

from inflight.core.overload import capped_step_budget
from inflight.core.step_model import StepTimeModel
from inflight.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "slo", "fair")


class FCFSPolicy:
    """Arrival order; preempted requests (at the queue head) go first."""

    def waiting_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return list(waiting)

    def running_key(self, req: Request) -> int | None:
        """Sort key of the running list (None: admission order). Preemption takes the
        last running request, so the key puts the first to be preempted last."""
        return None

    def preemption_victim(self, running: list[Request]) -> int:
        """Index in ``running`` of the request to preempt next: the last one (the list is
        kept in ``running_key`` order)."""
        return len(running) - 1

    def step_budget(self, running: list[Request], budget: int) -> int:
        return budget

    def infeasible(self, waiting: Iterable[Request], now: float, running: list[Request],
                   token_budget: int) -> list[tuple[Request, str]]:
        """Waiting requests to shed now, with the reason; ``running`` and ``token_budget``
        (this step's tokens, as ``step_budget`` returned them) let a policy predict when
        each would get its first token."""
        return []

    def on_arrival(self, req: Request, waiting: Iterable[Request],
                   running: Iterable[Request]) -> None:
        """``req`` joins the waiting queue (``waiting`` and ``running`` before it)."""

    def tenants_ahead(self, running: Iterable[Request], waiting: Iterable[Request]) -> frozenset[str | None]:
        """Tenants ahead of their share now; empty: none (every policy but ``fair``). While
        some are, a request of a tenant behind that waits for its first step gets a step
        without the tenants ahead (never the same request left out twice running), and
        overload shedding refuses only the tenants ahead."""
        return frozenset()

    def charge(self, req: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A step computed ``num_prompt_tokens`` prompt tokens of ``req`` and will sample
        ``num_output_tokens`` (0 or 1) for it."""


class PriorityPolicy(FCFSPolicy):
    """Lower ``priority`` first with aging (see the module docstring).

    Args:
        aging_s: seconds of waiting that raise a request by one priority level.
    """

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s

    def effective_priority(self, req: Request, now: float) -> float:
        """``priority`` less one level per ``aging_s`` seconds waited since arrival at
        ``now`` (seconds on the scheduler's clock); lower goes first."""
        waited = max(now - req.arrival_time, 0.0)
        return req.priority - (math.floor(waited / self.aging_s) if self.aging_s > 0 else 0)

    def outranks_after(self, priority: int, other_priority: int) -> float:
        """Seconds ``(priority - other_priority) * aging_s``: a request of ``priority`` goes
        ahead of any request of ``other_priority`` arriving this long or longer after it
        (then its effective priority is never worse, and ties go to the earlier arrival).
        0 when ``priority <= other_priority``; ``inf`` with aging off and a worse priority."""
        levels = priority - other_priority
        if levels <= 0:
            return 0.0
        return levels * self.aging_s if self.aging_s > 0 else math.inf

    def waiting_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: (self.effective_priority(r, now), r.arrival_time))

    def running_key(self, req: Request) -> int | None:
        # Highest priority number is preempted first; among equals, the latest admitted.
        return req.priority


class SLOPolicy(FCFSPolicy):
    """Deadline-ordered admission, ITL-protecting budget, TTFT-infeasibility shedding.

    Args:
        ttft_slo, itl_slo: default targets (seconds) for requests that set none.
        step_model: the engine's online step-time model.
    """

    def __init__(self, ttft_slo: float | None, itl_slo: float | None,
                 step_model: StepTimeModel) -> None:
        self.ttft_slo = ttft_slo
        self.itl_slo = itl_slo
        self.step_model = step_model

    def deadline(self, req: Request) -> float:
        if req.first_scheduled_time is not None:
            return -math.inf  # preempted work already under way comes back first
        target = req.ttft_slo if req.ttft_slo is not None else self.ttft_slo
        return math.inf if target is None else req.arrival_time + target

    def waiting_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: (self.deadline(r), r.arrival_time))

    def step_budget(self, running: list[Request], budget: int) -> int:
        targets = [t for t in (r.itl_slo if r.itl_slo is not None else self.itl_slo
                               for r in running if r.num_output_tokens > 0) if t is not None]
        return capped_step_budget(self.step_model, running, budget, min(targets, default=None))

    def infeasible(self, waiting: Iterable[Request], now: float, running: list[Request],
                   token_budget: int) -> list[tuple[Request, str]]:
        """Requests whose TTFT deadline is out of reach even at full prefill speed.

        In deadline order, a request's first token cannot come before every request ahead
        of it (preempted work first, then earlier deadlines) and its own prompt are
        prefilled. Each step gives prefill ``token_budget`` (ITL-capped) less one token per
        running request, and takes the step model's time for that many tokens. Free KV blocks and
        ``max_num_seqs`` slots are assumed, so the estimate is optimistic about capacity:
        what it sheds is late under the step model. It counts whole prompts, not
        prefix-cache hits, so a prompt with a long cached prefix can be shed that would have
        made it. It sheds at arrival rather than once
        the deadline has passed, so the client can retry elsewhere at once.
        """
        if not self.step_model.ready:
            return []
        shed, ahead = [], 0
        for req in self.waiting_order(waiting, now):
            need = req.num_tokens - req.num_computed_tokens
            deadline = self.deadline(req)
            if math.isfinite(deadline):
                total = ahead + need
                finish = now + self.step_model.time_to_prefill(
                    total, token_budget, len(running), min(token_budget, len(running) + total))
                if finish > deadline:
                    shed.append((req, f"TTFT deadline missed: would reach its first token "
                                      f"{finish - req.arrival_time:.2f} s after arrival at the "
                                      f"earliest, target {deadline - req.arrival_time:.2f} s"))
                    continue
            ahead += need
        return shed


class FairPolicy(PriorityPolicy):
    """Virtual Token Counter fairness between tenants (see the module docstring).

    Args:
        aging_s: within a tenant, seconds of waiting worth one priority level.
        output_weight: counter cost of a generated token, in prompt tokens (2, the paper's).
        even_tokens: counters closer than this (virtual tokens; one step's budget) are
            even: ``tenants_ahead`` never names one of them, so they never split a step.

    Attributes:
        counters: tenant -> virtual tokens served (prompt + ``output_weight`` x output).
    """

    def __init__(self, aging_s: float, output_weight: float = 2.0,
                 even_tokens: float = 2048.0) -> None:
        super().__init__(aging_s)
        self.output_weight = output_weight
        self.even_tokens = even_tokens
        self.counters: dict[str | None, float] = defaultdict(float)

    def on_arrival(self, req: Request, waiting: Iterable[Request],
                   running: Iterable[Request]) -> None:
        # The paper's counter lift: a tenant with nothing queued or running restarts at the
        # least counter among active tenants, so its idle time is not banked as credit.
        active = {r.tenant for r in waiting} | {r.tenant for r in running}
        if req.tenant in active or not active:
            return
        floor = min(self.counters[t] for t in active)
        self.counters[req.tenant] = max(self.counters[req.tenant], floor)

    def tenants_ahead(self, running: Iterable[Request], waiting: Iterable[Request]) -> frozenset[str | None]:
        """The active tenants (a request running or waiting) whose counter is more than
        ``even_tokens`` above the least active counter; empty with one active tenant."""
        active = {r.tenant for r in running}
        active.update(r.tenant for r in waiting)
        if len(active) < 2:
            return frozenset()
        bar = min(self.counters[t] for t in active) + self.even_tokens
        return frozenset(t for t in active if self.counters[t] > bar)

    def charge(self, req: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.counters[req.tenant] += num_prompt_tokens + self.output_weight * num_output_tokens

    def waiting_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """Tenants merged by their counters as admission would move them: the tenant with
        the least counter gives its next request, whose uncomputed tokens then count
        against it for the rest of this ordering; within a tenant, ``PriorityPolicy``'s
        order. Preempted requests (already started) keep the head, as in every policy."""
        started = [r for r in waiting if r.first_scheduled_time is not None]
        queues: dict[str | None, list[Request]] = defaultdict(list)
        for r in waiting:
            if r.first_scheduled_time is None:
                queues[r.tenant].append(r)
        for q in queues.values():  # next request last, for pop()
            q.sort(key=lambda r: (self.effective_priority(r, now), r.arrival_time))
            q.reverse()
        heap = [(self.counters[t], q[-1].arrival_time, i, t) for i, (t, q) in enumerate(queues.items())]
        heapq.heapify(heap)
        order = list(started)
        while heap:
            counter, _, i, tenant = heapq.heappop(heap)
            q = queues[tenant]
            req = q.pop()
            order.append(req)
            if q:
                cost = req.num_tokens - req.num_computed_tokens
                heapq.heappush(heap, (counter + cost, q[-1].arrival_time, i, tenant))
        return order

    def running_key(self, req: Request) -> int | None:
        return None  # preemption order is chosen by counters at the time: see preemption_victim

    def preemption_victim(self, running: list[Request]) -> int:
        """Index in ``running`` of the request to preempt: the tenant with the largest
        counter, its latest-admitted request (lowest priority first within it)."""
        worst = max(self.counters[r.tenant] for r in running)
        candidates = [i for i, r in enumerate(running) if self.counters[r.tenant] == worst]
        return max(candidates, key=lambda i: (running[i].priority, i))


def make_policy(name: str, *, ttft_slo: float | None, itl_slo: float | None,
                priority_aging_s: float, step_model: StepTimeModel,
                max_num_batched_tokens: int = 2048) -> FCFSPolicy:
    """The policy object for ``--scheduling-policy name`` (``max_num_batched_tokens``: the
    step's token budget, ``fair``'s even margin).

    Raises:
        ValueError: an unknown policy name.
    """
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(priority_aging_s)
    if name == "slo":
        return SLOPolicy(ttft_slo, itl_slo, step_model)
    if name == "fair":
        return FairPolicy(priority_aging_s, even_tokens=max_num_batched_tokens)
    raise ValueError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got {name!r}")
