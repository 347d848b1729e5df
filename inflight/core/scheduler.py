"""Iteration-level scheduler over a paged KV cache. Torch-free.

Each step hands out a token budget so every request's ``num_computed_tokens`` catches up
with its ``num_tokens`` (vLLM v1's model, vllm/v1/core/sched/scheduler.py): a prompt, a
chunk of one, or one decode token are the same thing with different counts, so chunked
prefill and mixed prefill/decode steps need no separate phases.

One step (see DESIGN.md), after the waiting requests that can no longer be served in time
are shed (``core.shedding``):
  1. Running requests, oldest first, get the tokens they need (capped by the budget). When
     the pool lacks a block, the newest running request is preempted (blocks freed, back
     to the head of the waiting queue, recomputed later) until the allocation fits.
  2. Waiting requests join, in order, while the batching policy allows, budget and
     ``max_num_seqs`` remain, their KV blocks fit and ``max_loras`` allows their adapter
     (``core.adapter_cap``).

With ``speculative_config``, a decoding request's drafts (``Request.spec_token_ids``) join
its one token in step 1 when ``core.speculation`` allows: they take budget and KV slots like
any token; ``update`` keeps the accepted ones' positions and frees the rest's blocks.

After the runner sampled, ``update`` appends each token (``max_tokens`` 0: none) and applies
the token-level stops (``core.stopping``), freeing a finished request's blocks at once.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from inflight.core.adapter_cap import AdapterCap
from inflight.core.kv_cache import KVCacheManager
from inflight.core.overload import OverloadShedder, capped_step_budget
from inflight.core.output import SampleResult, ScheduledRequest, SchedulerOutput
from inflight.core.policies import make_batching_policy
from inflight.core.prompt_fit import PromptFit
from inflight.core.queue_policy import make_policy
from inflight.core.scheduler_config import SchedulerConfig
from inflight.core.shedding import requests_to_shed
from inflight.core.step_model import StepTimeModel
from inflight.core.speculation import Speculation
from inflight.core.stopping import token_stop
from inflight.request import Request, RequestStatus


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        config: the engine's knobs (budget, ``max_num_seqs``, policies, ...).
        kv_cache: the block manager requests are admitted against.
        max_model_len: the model's length when ``config.max_model_len`` is None; None: the pool's.
        clock: seconds, the clock of arrival times and every stamp (``time.monotonic``;
            the simulator passes its virtual clock).
        max_loras: the most LoRA adapters running at once (0: no adapters).

    Attributes:
        max_model_len: longest sequence, prompt plus output tokens.
        max_sequence_len: longest sequence the pool can hold (<= ``max_model_len``): a
            lone request always fits.
        num_preemptions, num_prompt_tokens, num_generation_tokens: since start; prompt
            tokens count recomputation after preemption.
        num_recomputed_tokens: since start, tokens a preempted request computed again
            (less those the prefix cache gave back: ``KVCacheManager.record_lookup``).
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 max_model_len: int | None = None,
                 clock: Callable[[], float] = time.monotonic, max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras
        self.clock = clock
        self.kv_cache = kv_cache
        self.prompt_fit = PromptFit.for_pool(config, kv_cache.num_blocks * kv_cache.block_size,
                                             max_model_len)
        self.max_model_len = self.prompt_fit.max_model_len
        self.max_sequence_len = self.prompt_fit.max_sequence_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_recomputed_tokens = 0
        # Per preempted request: tokens it had computed before its latest preemption; the
        # ones scheduled below that mark are recomputation.
        self._recompute_until: dict[str, int] = {}
        # Blocks kept spare: a fresh admission is not preempted by the next decode (vLLM's).
        self.watermark_blocks = int(0.01 * kv_cache.num_blocks)
        self.step_model = StepTimeModel()
        self.policy = make_policy(config.scheduling_policy, ttft_slo=config.ttft_slo,
                                  itl_slo=config.itl_slo, priority_aging_s=config.priority_aging_s,
                                  step_model=self.step_model,
                                  max_num_batched_tokens=config.max_num_batched_tokens)
        # Requests left out of the last step (``policy.tenants_ahead``): never twice running.
        self._left_out: set[str] = set()
        self.overload = OverloadShedder(config.overload_ttft, self.step_model, now=clock(),
                                        max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len)
        spec = config.speculative_config
        self.speculation = Speculation(spec) if spec is not None else None
        self.batching = make_batching_policy(config.batching_policy,
                                             max_num_seqs=config.max_num_seqs,
                                             max_queue_delay=config.max_queue_delay)

    # --- queue management -------------------------------------------------------------
    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The one prompt-fit rule (``PromptFit.check``) with this scheduler's limits."""
        return self.prompt_fit.check(num_prompt_tokens, max_tokens)

    def add_request(self, request: Request) -> None:
        self.policy.on_arrival(request, self.waiting, self.running)
        self.overload.judge_on_arrival(request)
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
        self._recompute_until.pop(request.request_id, None)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.overload.note_finished(request)
        request.status = status
        request.finished_time = self.clock()

    def stop_request(self, request: Request, stop_reason: str) -> None:
        """A stop string matched: end ``request`` as stopped (a length finish this step is
        relabelled; a stop by EOS or stop token, checked first, or an abort stays)."""
        if request.status == RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED
        elif not request.is_finished:
            self.finish_request(request, RequestStatus.FINISHED_STOPPED)
        else:
            return
        request.stop_reason = stop_reason

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
            now: the clock for the dynamic policy's queue delay; ``clock()`` when None.
        """
        now = self.clock() if now is None else now
        self.kv_cache.begin_step()
        out = SchedulerOutput()
        budget = self.policy.step_budget(self.running, self.config.max_num_batched_tokens)
        budget = capped_step_budget(self.step_model, self.running, budget,
                                    self.config.max_step_time)
        ahead = self.policy.tenants_ahead(self.running, self.waiting)
        left_out: set[str] = set()
        served = self._served_this_step(ahead, left_out)
        self._shed(out, now, budget, ahead)
        self._gate_drafts()
        budget = self._schedule_running(out, budget, served)
        if not out.preempted:
            self._schedule_waiting(out, budget, now, served)
        self._left_out = left_out
        self.overload.observe(now, self.waiting, len(out.shed))
        return out

    def _served_this_step(self, ahead: frozenset[str | None], left_out: set[str],
                          ) -> Callable[[Request], bool] | None:
        """Which requests this step may serve; None: every one (the cost-free common case).

        While a request of a tenant behind its share waits (``ahead``: the tenants ahead of
        theirs), the step is for the tenants behind and whoever was left out of the last
        step; the predicate adds each request it leaves out to ``left_out``.
        """
        if not (ahead and any(r.tenant not in ahead for r in self.waiting)):
            return None

        def served(r: Request) -> bool:
            if r.tenant not in ahead or r.request_id in self._left_out:
                return True
            left_out.add(r.request_id)
            return False
        return served

    def update(self, out: SchedulerOutput, sampled: list[SampleResult],
               now: float | None = None) -> list[Request]:
        """Record the step's sampled tokens and apply the token-level stops.

        Args:
            out: the step's plan, as ``schedule`` returned it.
            sampled: the runner's tokens, one per row of ``out`` that samples.
            now: when the tokens exist (``clock()`` when None): TTFT and ITL stamps.

        Returns:
            The requests that got a token, in ``sampled`` order; those that stopped are
            finished (status set, blocks freed, ``stop_reason`` the stop token id).
        """
        now = self.clock() if now is None else now
        self.num_prompt_tokens += out.num_prompt_tokens
        updated: dict[str, Request] = {}
        kept: dict[str, int] = {}
        for i, res in enumerate(sampled):
            req = res.request
            kept[req.request_id] = kept.get(req.request_id, 0) + 1
            if req.is_finished:  # aborted while its step ran, or stopped by an earlier token
                continue
            if req.sampling_params.max_tokens == 0:  # prefill only: its sample is not kept
                req.first_token_time = req.last_token_time = now
                self.finish_request(req, RequestStatus.FINISHED_LENGTH)
            else:
                req.append_output_token(res.token_id, res.logprobs, now)
                self.num_generation_tokens += 1
                last = i + 1 == len(sampled) or sampled[i + 1].request is not req
                status = token_stop(req, self.max_sequence_len, last)
                if status is not None:
                    self.finish_request(req, status)
            updated[req.request_id] = req
        if self.speculation is not None:
            self.speculation.settle(out, kept, self.kv_cache)
        return list(updated.values())

    def _gate_drafts(self) -> None:
        """Drop proposed drafts this step should not verify (``Speculation.gate``)."""
        if self.speculation is not None:
            self.speculation.gate(self.running, len(self.waiting))

    def requests_to_draft(self) -> list[tuple[Request, int]]:
        """Running requests whose next step may verify drafts, and how many (``Speculation``)."""
        if self.speculation is None:
            return []
        return self.speculation.requests_to_draft(self.running, self.max_sequence_len,
                                                  len(self.waiting))

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          served: Callable[[Request], bool] | None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if served is not None and not served(req):
                i += 1
                continue
            n = self._num_tokens_to_schedule(req.num_uncomputed_tokens, budget)
            if n == 0:
                i += 1
                continue
            drafts = self._drafts_for(req, n, budget)
            while not self.kv_cache.allocate(req, n + len(drafts)):
                if drafts:  # lookahead slots go before anyone is preempted for them
                    drafts = []
                    continue
                # Only requests not yet given tokens this step (from i on) can be victims.
                victim = self.running.pop(i + self.policy.preemption_victim(self.running[i:]))
                self._preempt(victim, out)
                if victim is req:
                    return budget
            self._add_scheduled(out, req, n, drafts)
            budget -= n + len(drafts)
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float,
                          served: Callable[[Request], bool] | None) -> None:
        cfg = self.config
        is_batch_policy = self.batching.forms_batches
        launching = False
        cap = AdapterCap(self.max_loras, self.running)
        for req in self.policy.waiting_order(self.waiting, now):
            if (served is not None and not served(req)) or not cap.admits(req):
                continue
            if len(self.running) >= cfg.max_num_seqs:
                break
            if budget <= 0 and not launching:
                break
            if not self.batching.can_admit(self.running, self.waiting, now, launching):
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
            bisect.insort_right(self.running, req,
                                key=lambda r: self.policy.running_key(r) or 0)

    def _shed(self, out: SchedulerOutput, now: float, budget: int, ahead: frozenset[str | None]) -> None:
        """Refuse the waiting requests that can no longer be served in time
        (``core.shedding``), before the step's admission."""
        cfg = self.config
        if not self.waiting or (cfg.max_queue_time is None and cfg.scheduling_policy != "slo"
                                and not self.overload.active):
            return  # nothing can be shed: keep the per-step cost at zero
        for req, why in requests_to_shed(self.waiting, self.running, now, budget, ahead, policy=self.policy,
                                         overload=self.overload, max_queue_time=cfg.max_queue_time):
            req.shed_reason = why
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
            out.shed.append(req)

    def _num_tokens_to_schedule(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        cfg = self.config
        if cfg.enable_chunked_prefill and 0 < cfg.long_prefill_token_threshold < n:
            # One long prompt may not take the whole budget: what is left goes to the next
            # requests, waiting ones included (vLLM v1's long_prefill_token_threshold).
            return cfg.long_prefill_token_threshold
        # Chunked prefill off: wait for a step with room for all of it, unless it can never
        # fit one (a preempted request recomputing prompt + output past the budget), which
        # would otherwise block the queue for ever.
        if (n < remaining and not cfg.enable_chunked_prefill
                and remaining <= cfg.max_num_batched_tokens):
            return 0
        return n

    def _drafts_for(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts ``req`` verifies this step: those proposed, when its one token is a
        decode, as many as the budget left after it holds."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or n != 1 or req.num_uncomputed_tokens != 1:
            return []
        return drafts[:max(budget - 1, 0)]

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int,
                       drafts: list[int] | None = None) -> None:
        start = req.num_computed_tokens
        samples = start + n == req.num_tokens
        drafts = drafts or []
        out.scheduled.append(ScheduledRequest(
            request=req,
            token_ids=req.token_ids_slice(start, start + n) + drafts,
            num_computed_tokens=start,
            block_table=self.kv_cache.get_block_table(req.request_id),
            samples=samples,
            num_draft_tokens=len(drafts),
        ))
        out.num_batched_tokens += n + len(drafts)
        self.policy.charge(req, max(0, min(start + n, req.num_prompt_tokens) - start), int(samples))
        req.num_computed_tokens += n
        self._count_recomputed(req.request_id, start, start + n)
        # Only known tokens' blocks are registered; drafts' positions count as computed
        # until ``update`` keeps the accepted ones (``_settle_drafts``).
        self.kv_cache.cache_full_blocks(req)
        req.num_computed_tokens += len(drafts)

    def _count_recomputed(self, request_id: str, start: int, end: int) -> None:
        """Count the tokens ``[start, end)`` just scheduled that the request had computed
        before its latest preemption."""
        until = self._recompute_until.get(request_id)
        if until is None:
            return
        self.num_recomputed_tokens += max(0, min(end, until) - start)
        if end >= until:
            del self._recompute_until[request_id]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks, requeue at the head, start over later."""
        # A request preempted again mid-recompute still owes the older, higher mark.
        rid = req.request_id
        self._recompute_until[rid] = max(self._recompute_until.get(rid, 0),
                                         req.num_computed_tokens)
        self.kv_cache.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
