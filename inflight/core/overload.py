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
- **Shedding at the door under overload** (``overload_ttft``): a queue that drains is a
  burst and is served, and so is a queue that stands but does not grow (a closed-loop
  client at more concurrency than ``max_num_seqs``: each request waits for a slot, the
  arrivals follow the completions). A queue that has not emptied for
  ``OVERLOAD_INTERVAL_S`` and has grown over it (``GROWTH_REQUESTS``) is overload. Then
  each request is judged once, when it arrives (at the first step after it joins the
  queue): refused at once (HTTP 503 with ``Retry-After``) if its first token is predicted
  later than its deadline, kept for good otherwise. A 503 after the request has waited
  tells the client nothing it could act on, so none is sent: what arrived before overload
  began, and what was kept, is served. The deadline is the request's own ``ttft_slo``
  (seconds after arrival: the client's patience) or ``overload_ttft``. The good-queue /
  bad-queue split is CoDel's (Nichols & Jacobson, "Controlling Queue Delay", ACM Queue
  2012) as Facebook applied it to RPC queues ("Fail at Scale", ACM Queue 2015: a short
  queue timeout only while the queue has not been empty for an interval), judged at the
  door as Envoy's and gRPC's admission control do. The prediction, rather than a timeout,
  is what keeps the admitted requests' TTFT: a timeout admits requests that already spent
  their wait (docs/scheduling.md measured half the goodput). It follows the scheduler: the
  work ahead of a request is what the queue policy runs before it (``waiting_order``, the
  one owner of that order: ``priority`` with its aging, ``fair``'s tenants, ``slo``'s
  deadlines), and a slot it must wait for frees when a running request is predicted to
  finish (``SlotForecast``). The request the scheduler runs next is never refused; the
  lowest in the policy's order are refused first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Iterable

from inflight.core.step_model import StepTimeModel
from inflight.request import Request

# A queue that has not emptied for this long is overload, not a burst. 10 s lets a burst of
# ten seconds' work (hundreds of requests on a small model) through whole, and still reacts
# well inside the 60 s windows an operating-limit search judges.
OVERLOAD_INTERVAL_S = 10.0
# Overload also needs the queue to grow: its mean length over the interval's second half at
# least this many requests above its mean over the first half. A closed-loop client's queue
# stands but dips and refills by a request or two as requests leave and their successors
# arrive; means over half an interval each smooth that out, and an open-loop excess of e
# requests a second shows as e x interval / 2.
GROWTH_REQUESTS = 1.0
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


class SlotForecast:
    """When running slots free up, in seconds from now, as the queue takes them in order.

    Each running request holds its slot until it is predicted to finish: its expected
    remaining output tokens (``expected_output``) at one decode step each, every step the
    model's time for a step of ``max_num_seqs`` rows (a full running set; prompt chunks in
    those steps make them longer, so the forecast errs early). A waiting request that
    takes a slot holds it from then for its own expected output. KV blocks are not
    forecast: a request held by KV waits for the same finishes, so slots bound it too.

    Args:
        running: the running requests.
        max_num_seqs: the running slots, at least one.
        step_s: seconds a decode step takes.
        expected_output: a request's expected output tokens still to come.
    """

    def __init__(self, running: list[Request], max_num_seqs: int, step_s: float,
                 expected_output: Callable[[Request], float]) -> None:
        self.step_s = step_s
        self.expected_output = expected_output
        free = [0.0] * max(max_num_seqs - len(running), 0)
        self._frees = free + [expected_output(r) * step_s for r in running]
        heapq.heapify(self._frees)

    def next_free(self) -> float:
        """Seconds until the next slot the queue can take is free (0: one is)."""
        return self._frees[0]

    def take(self, start: float, req: Request) -> None:
        """``req`` takes the next slot at ``start`` seconds from now."""
        heapq.heapreplace(self._frees, start + self.expected_output(req) * self.step_s)


class OverloadShedder:
    """Refuses, at their arrival, the requests a growing queue would serve too late.

    Args:
        ttft: seconds from arrival to the predicted first token a request may have (a
            request's own ``ttft_slo`` replaces it); None turns shedding off.
        step_model: the scheduler's online step-time model.
        interval: seconds the waiting queue must stay non-empty, and grow, before
            shedding starts.
        max_num_seqs: running slots (``SlotForecast``); None: slots are not forecast.
        max_model_len: the context, the output bound of a request without ``max_tokens``.

    Overload starts when the waiting queue has not emptied for ``interval`` seconds and has
    grown over it (``GROWTH_REQUESTS``), and ends when it empties with nothing shed for
    ``interval`` seconds: shedding empties the queue too, and that is not the load going
    away. ``judge_on_arrival`` marks what the guard will judge; call ``shed`` before a
    step's admission, ``observe`` after it, ``note_finished`` as requests finish. Times
    are seconds on the scheduler's clock.
    """

    def __init__(self, ttft: float | None, step_model: StepTimeModel,
                 interval: float = OVERLOAD_INTERVAL_S, now: float = 0.0,
                 max_num_seqs: int | None = None, max_model_len: int | None = None) -> None:
        self.ttft = ttft
        self.step_model = step_model
        self.interval = interval
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.active = False  # overloaded now (the class docstring says when)
        self.last_empty = now  # the queue was empty at this time (seconds)
        self.last_shed = -float("inf")
        self._was_empty, self._last_step = True, now
        # (time, queue length) at each step over the last interval, in its two halves with
        # their sums, so the growth test is O(1) a step
        self._halves = _Halves(interval)
        # Output tokens of the requests that finished (an exponential average, about 50):
        # what a request without a tight ``max_tokens`` is expected to generate.
        self.typical_output: float | None = None

    def judge_on_arrival(self, req: Request) -> None:
        """``req`` joins the queue now: it is judged at the next ``shed`` while overloaded;
        arrived before overload, it is served (refused at arrival or not at all)."""
        req.overload_judged = not self.active

    def note_finished(self, req: Request) -> None:
        """``req`` finished generating (a stop or its length): its output's length."""
        n = float(req.num_output_tokens)
        self.typical_output = n if self.typical_output is None else 0.98 * self.typical_output + 0.02 * n

    def expected_output(self, req: Request) -> float:
        """Output tokens ``req`` is expected still to generate: what its ``max_tokens`` (or
        the context) leaves, at most the typical output's remainder, at least one."""
        max_tokens = req.sampling_params.max_tokens
        left: float = (max_tokens - req.num_output_tokens if max_tokens is not None
                else (self.max_model_len or req.num_tokens + 1) - req.num_tokens)
        if self.typical_output is not None:
            left = min(left, self.typical_output - req.num_output_tokens)
        return max(float(left), 1.0)

    def observe(self, now: float, waiting: Collection[Request], num_shed: int) -> None:
        """Record a step: the requests still waiting after its admission, and how many
        requests ``shed`` refused before it. Off, it costs nothing; on, it reads the
        waiting requests only when the queue starts standing."""
        if self.ttft is None:
            return
        if num_shed:
            self.last_shed = now
        self._halves.add(now, len(waiting))
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
            if not self.active and now - self.last_empty > self.interval and self._grew():
                self.active = True
        self._was_empty, self._last_step = not waiting, now

    def _grew(self) -> bool:
        """The queue's mean length over the interval's second half is ``GROWTH_REQUESTS``
        above its mean over the first half."""
        growth = self._halves.growth()
        return growth is not None and growth >= GROWTH_REQUESTS

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
        """The requests judged now to refuse, with the reason; empty unless ``active``.

        Only requests not yet judged are judged (``judge_on_arrival``), each once. The
        order is the scheduler's (``policy.waiting_order``). A request's first token is
        predicted at ``now`` plus the later of: the steps needed to prefill what is ahead
        of it and its own uncomputed tokens (the uncomputed prompt tokens of running
        requests and of the kept waiting requests before it, at ``budget`` less one token
        per running request per step, each step taking the model's time for the step
        admission builds: ``budget`` tokens, or fewer when the running rows and all the
        waiting tokens are fewer), and the time a slot frees for it (``SlotForecast``)
        plus its own prefill. It is refused if that is past its deadline (``ttft_slo``,
        else ``ttft``) counted from its arrival. Never refused: the first in the order
        (the scheduler runs it next), requests started once (preempted), those
        ``protected`` picks (a fair policy's tenants behind their share), and those judged
        before; all count as work ahead and take slots. Each refused request's
        ``shed_retry_after`` (the 503's ``Retry-After``) is set to the seconds until the
        work predicted ahead of it has drained to its deadline (at least 1): a retry sent
        sooner would meet the same queue.
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
        slots = (SlotForecast(running, self.max_num_seqs, model.predict(self.max_num_seqs),
                              self.expected_output)
                 if self.max_num_seqs is not None and model.ready else None)

        def prefill_s(tokens: int) -> float:
            return model.time_to_prefill(tokens, budget, len(running), step) if model.ready else 0.0
        shed = []
        for i, req in enumerate(waiting_in_order):
            need = req.num_tokens - req.num_computed_tokens
            slot_s = 0.0 if slots is None else slots.next_free()
            after_work, after_slot = prefill_s(ahead + need), slot_s + prefill_s(need)
            first_s = max(after_work, after_slot)
            exempt = (req.overload_judged or i == 0 or req.first_scheduled_time is not None
                      or (protected is not None and protected(req)))
            req.overload_judged = True
            deadline = req.ttft_slo if req.ttft_slo is not None else self.ttft
            ttft = now + first_s - req.arrival_time
            if not exempt and ttft > deadline:
                req.shed_retry_after = max(1.0, first_s - deadline)
                held = " (waiting for a running slot)" if after_slot > after_work else ""
                shed.append((req, f"overloaded: first token predicted {ttft:.3f} s after "
                                  f"arrival{held}, over the {deadline:g} s "
                                  f"{'its ttft_slo' if req.ttft_slo is not None else 'the server'} "
                                  f"allows while the queue grows (standing {self.interval:g} s)"))
                continue
            if slots is not None:
                slots.take(slot_s, req)
            ahead += need
        return shed


class _Halves:
    """Queue lengths over the last ``interval`` seconds, split at its middle, with running
    sums: the mean of each half in O(1), each sample moved and dropped once."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.old: deque[tuple[float, int]] = deque()
        self.new: deque[tuple[float, int]] = deque()
        self.old_sum = self.new_sum = 0

    def add(self, now: float, length: int) -> None:
        self.new.append((now, length))
        self.new_sum += length
        while self.new[0][0] < now - self.interval / 2:
            t, n = self.new.popleft()
            self.new_sum -= n
            self.old.append((t, n))
            self.old_sum += n
        while self.old and self.old[0][0] < now - self.interval:
            self.old_sum -= self.old.popleft()[1]

    def growth(self) -> float | None:
        """The second half's mean length minus the first's; None while a half is empty."""
        if not self.old or not self.new:
            return None
        return self.new_sum / len(self.new) - self.old_sum / len(self.old)
