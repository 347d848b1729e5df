"""Overload protection: keep the running set inside what the steps carry, shed a standing
queue. Torch-free.

Past its operating limit a server gets more work than it can finish; something has to be
refused, and the only question is how late. Served first-come first-served with no bound,
the queue grows until every request waits longer than any client would, and every step is
packed with prefill so every running request's tokens slow down too: goodput collapses
(docs/reliability.md measures it). Two rules, both from the step-time model the scheduler
already fits (``inflight.core.step_model``):

- **Step time cap** (``max_step_time``): while requests decode, a step's token budget is
  capped so its predicted time stays within the cap. A prefill chunk then cannot stretch
  every running request's inter-token gap past it; prompts get what the cap leaves. This is
  the "adaptive concurrency limit" of the running set measured in seconds rather than rows:
  the budget follows the machine's measured step cost (Sarathi-Serve's TBT-derived token
  budget, Agrawal et al., OSDI 2024, made a default).
- **Standing-queue shedding** (``overload_ttft``): a queue that drains is a burst and is
  served; a queue that has not emptied for ``OVERLOAD_INTERVAL_S`` is overload, and then each
  waiting request predicted to get its first token more than ``overload_ttft`` seconds after
  its arrival is refused at once (HTTP 503 with ``Retry-After``), so the ones admitted get
  their first token in time and the rest can retry elsewhere now rather than time out
  later. The good-queue / bad-queue split is CoDel's (Nichols & Jacobson, "Controlling Queue
  Delay", ACM Queue 2012) as Facebook applied it to RPC queues ("Fail at Scale", ACM Queue
  2015: a short queue timeout only while the queue has not been empty for an interval).
  The prediction, rather than a timeout, is what keeps the admitted requests' TTFT: a
  timeout admits requests that already spent their wait (docs/scheduling.md measured half
  the goodput). The prediction is the ``slo`` policy's (``queue_policy.SLOPolicy``) in the
  policy's own order, so it composes with ``fcfs`` and ``priority``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from inflight.core.step_model import StepTimeModel
from inflight.request import Request

# A queue that has not emptied for this long is overload, not a burst. 10 s lets a burst of
# ten seconds' work (hundreds of requests on a small model) through whole, and still reacts
# well inside the 60 s windows an operating-limit search judges.
OVERLOAD_INTERVAL_S = 10.0
# The step cap's first budget while the step-time model cannot predict yet (tokens): a
# quarter of the default token budget, a fraction of a second on a 2-core CPU.
SLOW_START_TOKENS = 512


def capped_step_budget(step_model: StepTimeModel, running: list[Request], budget: int,
                       max_step_time: float | None) -> int:
    """The step's token budget under ``max_step_time`` (seconds).

    Args:
        step_model: the scheduler's online step-time model.
        running: the running requests; the cap applies only when one of them decodes.
        budget: the budget before the cap (tokens).
        max_step_time: seconds; None: no cap.

    Returns:
        ``budget``, lowered to the tokens a step of ``max_step_time`` holds, never below one
        token per decoding request plus one (decodes always advance, and admission moves).
        Before the model can answer (``max_tokens_within``), the cap is
        ``SLOW_START_TOKENS``: a server restarted into overload does not run its first
        steps unbounded.
    """
    if max_step_time is None:
        return budget
    decoding = sum(1 for r in running if r.num_output_tokens > 0)
    if not decoding:
        return budget
    fits = step_model.max_tokens_within(max_step_time)
    if fits is None:
        fits = SLOW_START_TOKENS
    return min(budget, max(fits, decoding + 1))


class OverloadShedder:
    """Sheds a standing queue's requests that would get their first token too late.

    Args:
        ttft: seconds from arrival to the predicted first token a waiting request may have;
            None turns shedding off.
        step_model: the scheduler's online step-time model.
        interval: seconds the waiting queue must stay non-empty before shedding starts.

    Overload starts when the waiting queue has not emptied for ``interval`` seconds, and
    ends when it empties with nothing shed for ``interval`` seconds: shedding empties the
    queue too, and that is not the load going away. Call ``shed`` before a step's admission
    and ``observe`` after it. Times are seconds on the scheduler's clock.
    """

    def __init__(self, ttft: float | None, step_model: StepTimeModel,
                 interval: float = OVERLOAD_INTERVAL_S, now: float = 0.0) -> None:
        self.ttft = ttft
        self.step_model = step_model
        self.interval = interval
        self.active = False  # overloaded now (the class docstring says when)
        self.last_empty = now  # the queue was empty at this time (seconds)
        self.last_shed = -float("inf")
        self._was_empty, self._last_step = True, now

    def observe(self, now: float, waiting: Collection[Request], num_shed: int) -> None:
        """Record a step: the requests still waiting after its admission, and how many
        requests ``shed`` refused before it. Off, it costs nothing; on, it reads the
        waiting requests only when the queue starts standing."""
        if self.ttft is None:
            return
        if num_shed:
            self.last_shed = now
        if not waiting:
            self.last_empty = now
            if now - self.last_shed > self.interval:
                self.active = False
        else:
            if self._was_empty:
                # Empty at the last step, and while the engine idled since: the queue
                # started standing when its oldest request arrived (an idle spell is not
                # a standing queue).
                self.last_empty = max(self._last_step, min(r.arrival_time for r in waiting))
            if now - self.last_empty > self.interval:
                self.active = True
        self._was_empty, self._last_step = not waiting, now

    def _settle_idle_spell(self, waiting: list[Request]) -> None:
        """End overload over an idle spell: the queue was empty at the last step and stayed
        empty until the oldest of these requests arrived; ``interval`` seconds of that with
        nothing shed is the load gone. Without it a server that idled right after shedding
        kept refusing (``observe`` runs after steps only, and each refusal restarted the
        quiet period a client obeying ``Retry-After`` never let pass)."""
        if self.active and self._was_empty:
            since = min((r.arrival_time for r in waiting), default=self._last_step)
            if since - self.last_shed > self.interval:
                self.active = False

    def shed(self, waiting_in_order: Iterable[Request], running: list[Request], now: float,
             budget: int, protected: Callable[[Request], bool] | None = None,
             ) -> list[tuple[Request, str]]:
        """Waiting requests to refuse now, with the reason; empty unless ``active``.

        A request's first token is predicted at ``now`` plus the steps needed to prefill
        what is ahead of it and its own uncomputed tokens: ahead are the uncomputed prompt
        tokens of running requests and of the waiting requests before it in admission order
        (those not shed), at ``budget`` less one token per running request per step, each
        step taking the model's time for the step admission builds: ``budget`` tokens, or
        fewer when the running rows and all the waiting tokens are fewer (a step a policy
        composed of some tenants only, ``FCFSPolicy.tenants_ahead``). Free slots and KV blocks are
        assumed, so the prediction is optimistic; the time already waited always counts, so
        a request held by slots or KV is shed once it has waited ``ttft``. Requests already
        started once (preempted) are kept, and so are those ``protected`` picks (a fair
        policy's tenants behind their share): both count as work ahead. Each refused
        request's ``shed_retry_after`` (the 503's ``Retry-After``) is set to the seconds
        until the work predicted ahead of it has drained to ``ttft`` (at least 1): a retry,
        which starts its wait afresh, sent sooner would meet the same queue.
        """
        waiting_in_order = list(waiting_in_order)
        self._settle_idle_spell(waiting_in_order)
        if not self.active:
            return []
        assert self.ttft is not None
        model = self.step_model
        ahead = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in running)
        step = min(budget, len(running) + ahead
                   + sum(r.num_tokens - r.num_computed_tokens for r in waiting_in_order))
        shed = []
        for req in waiting_in_order:
            need = req.num_tokens - req.num_computed_tokens
            if req.first_scheduled_time is not None or (protected is not None and protected(req)):
                ahead += need
                continue
            prefill = model.time_to_prefill(ahead + need, budget, len(running), step) if model.ready else 0.0
            ttft = now + prefill - req.arrival_time
            if ttft > self.ttft:
                req.shed_retry_after = max(1.0, prefill - self.ttft)
                shed.append((req, f"overloaded: first token predicted {ttft:.3f} s after "
                                  f"arrival, over the {self.ttft:g} s the server allows once "
                                  f"its queue has not emptied for {self.interval:g} s"))
                continue
            ahead += need
        return shed
