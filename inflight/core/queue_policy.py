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
"""

from __future__ import annotations

import math
from typing import Iterable

from inflight.core.step_model import StepTimeModel
from inflight.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")


class FCFSPolicy:
    """Arrival order; preempted requests (at the queue head) go first."""

    def waiting_order(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return list(waiting)

    def running_key(self, req: Request) -> int | None:
        """Sort key of the running list (None: admission order). Preemption takes the
        last running request, so the key puts the first to be preempted last."""
        return None

    def step_budget(self, running: list[Request], budget: int) -> int:
        return budget

    def infeasible(self, waiting: Iterable[Request], now: float, running: list[Request],
                   token_budget: int) -> list[tuple[Request, str]]:
        """Waiting requests to shed now, with the reason; ``running`` and ``token_budget``
        (this step's tokens, as ``step_budget`` returned them) let a policy predict when
        each would get its first token."""
        return []


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
        decoding = [r for r in running if r.num_output_tokens > 0]
        targets = [t for t in (r.itl_slo if r.itl_slo is not None else self.itl_slo
                               for r in decoding) if t is not None]
        if not targets:
            return budget
        fits = self.step_model.max_tokens_within(min(targets))
        if fits is None:
            return budget
        # Decodes always get their token, and one prefill token keeps admission moving.
        return min(budget, max(fits, len(decoding) + 1))

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
        per_step = max(token_budget - len(running), 1)
        shed, ahead = [], 0
        for req in self.waiting_order(waiting, now):
            need = req.num_tokens - req.num_computed_tokens
            deadline = self.deadline(req)
            if math.isfinite(deadline):
                total = ahead + need
                steps = -(-total // per_step)
                finish = now + steps * self.step_model.predict(min(token_budget, len(running) + total))
                if finish > deadline:
                    shed.append((req, f"TTFT deadline missed: would reach its first token "
                                      f"{finish - req.arrival_time:.2f} s after arrival at the "
                                      f"earliest, target {deadline - req.arrival_time:.2f} s"))
                    continue
            ahead += need
        return shed


def make_policy(name: str, *, ttft_slo: float | None, itl_slo: float | None,
                priority_aging_s: float, step_model: StepTimeModel) -> FCFSPolicy:
    """The policy object for ``--scheduling-policy name``.

    Raises:
        ValueError: an unknown policy name.
    """
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(priority_aging_s)
    if name == "slo":
        return SLOPolicy(ttft_slo, itl_slo, step_model)
    raise ValueError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got {name!r}")
