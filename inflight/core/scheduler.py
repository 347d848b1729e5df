"""Iteration-level scheduler over a paged KV cache. Torch-free.

Each step hands out a token budget so every request's ``num_computed_tokens`` catches up
with its ``num_tokens`` (vLLM v1's model, vllm/v1/core/sched/scheduler.py): a prompt, a
chunk of one, or one decode token are the same thing with different counts, so chunked
prefill and mixed prefill/decode steps need no separate phases.

One step (see DESIGN.md):
  1. Running requests, oldest first, get the tokens they need (capped by the budget). When
     the pool lacks a block, the newest running request is preempted (blocks freed, back
     to the head of the waiting queue, recomputed later) until the allocation fits.
  2. Waiting requests join, in order, while the batching policy allows, budget and
     ``max_num_seqs`` remain and their KV blocks fit.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import ScheduledRequest, SchedulerOutput
from inflight.core.policies import can_admit
from inflight.core.queue_policy import make_policy
from inflight.core.step_model import StepTimeModel
from inflight.request import Request, RequestStatus


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        config: the engine's knobs (budget, ``max_num_seqs``, policy, ...).
        kv_cache: the block manager requests are admitted against.
    """

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Admission keeps a few blocks spare so a freshly admitted request is not preempted
        # by the next decode step's block (vLLM's watermark, 1% of the pool).
        self.watermark_blocks = int(0.01 * kv_cache.num_blocks)
        self.step_model = StepTimeModel()
        self.policy = make_policy(config.scheduling_policy, ttft_slo=config.ttft_slo,
                                  itl_slo=config.itl_slo, priority_aging_s=config.priority_aging_s,
                                  step_model=self.step_model)

    # --- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (stop, length or abort) and free its blocks at once."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        request.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step -----------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan one step; reserves KV slots and advances ``num_computed_tokens``.

        Args:
            now: the clock for the dynamic policy's queue delay (``time.monotonic()``).
        """
        now = time.monotonic() if now is None else now
        self.kv_cache.begin_step()
        out = SchedulerOutput()
        budget = self.policy.step_budget(self.running, self.config.max_num_batched_tokens)
        self._shed(out, now, budget)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget, now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_tokens_to_schedule(req.num_uncomputed_tokens, budget)
            if n == 0:
                i += 1
                continue
            while not self.kv_cache.allocate(req, n):
                victim = self.running.pop()  # the policy keeps the first victim last
                self._preempt(victim, out)
                if victim is req:
                    return budget
            self._add_scheduled(out, req, n)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        cfg = self.config
        # A static/dynamic batch is formed in one step, even past this step's token
        # budget (members then prefill over the next steps); nothing joins it afterwards.
        is_batch_policy = cfg.batching_policy != "continuous"
        launching = False
        for req in self.policy.waiting_order(self.waiting, now):
            if len(self.running) >= cfg.max_num_seqs:
                break
            if budget <= 0 and not launching:
                break
            if not can_admit(cfg.batching_policy, self.running, self.waiting,
                             max_num_seqs=cfg.max_num_seqs, max_queue_delay=cfg.max_queue_delay,
                             now=now, launching=launching):
                break
            hits = self.kv_cache.get_computed_blocks(req)
            num_hit_tokens = len(hits) * self.kv_cache.block_size
            remaining = req.num_tokens - num_hit_tokens
            n = self._num_tokens_to_schedule(remaining, budget)
            if n == 0 and not is_batch_policy:
                break
            # Admit only if the whole known sequence fits beside the watermark: admitting a
            # prompt that cannot finish its prefill just forces a preemption later.
            whole = self.kv_cache.num_new_blocks_needed(req, remaining, hits)
            if whole > self.kv_cache.num_free_blocks - self.watermark_blocks:
                if whole > self.kv_cache.num_free_blocks or self.running:
                    break
            if not self.kv_cache.allocate(req, n, hits):
                break
            self.kv_cache.record_lookup(req, hits)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = num_hit_tokens
            self._add_running(req)
            launching = is_batch_policy
            if n:
                self._add_scheduled(out, req, n)
                budget -= n

    def _add_running(self, req: Request) -> None:
        key = self.policy.running_key(req)
        if key is None:
            self.running.append(req)
        else:  # after every request with the same key: the newest is preempted first
            bisect.insort_right(self.running, req, key=self.policy.running_key)

    def _shed(self, out: SchedulerOutput, now: float, budget: int) -> None:
        """Reject waiting requests that can no longer be served in time (load shedding):
        those past ``max_queue_time`` and those the policy finds infeasible."""
        if not self.waiting or (self.config.max_queue_time is None
                                and self.config.scheduling_policy != "slo"):
            return  # nothing can be shed: keep the per-step cost at zero
        limit = self.config.max_queue_time
        shed = [(r, f"waited {now - r.arrival_time:.2f} s, longer than max_queue_time {limit:g} s")
                for r in self.waiting if limit is not None and r.first_scheduled_time is None
                and now - r.arrival_time > limit]
        seen = {r.request_id for r, _ in shed}
        rest = [r for r in self.waiting if r.request_id not in seen]
        shed += [(r, why) for r, why in self.policy.infeasible(rest, now, self.running, budget)
                 if r.first_scheduled_time is None]
        for req, why in shed:
            req.shed_reason = why
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
            out.shed.append(req)

    def _num_tokens_to_schedule(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if n < remaining and not self.config.enable_chunked_prefill:
            return 0
        return n

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        out.scheduled.append(ScheduledRequest(
            request=req,
            token_ids=req.token_ids_slice(start, start + n),
            num_computed_tokens=start,
            block_table=self.kv_cache.get_block_table(req.request_id),
            samples=start + n == req.num_tokens,
        ))
        out.num_batched_tokens += n
        req.num_computed_tokens += n
        self.kv_cache.cache_full_blocks(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks, requeue at the head, start over later."""
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
