"""When to speculate, and what it gained. Torch-free.

Speculative decoding (Leviathan et al., ICML 2023; Chen et al., 2023) verifies k proposed
tokens of a request in the step that computes its next token: the step's rows for it are
its last token and the k drafts, and the target model's tokens at those rows decide how
many drafts were right. A decode step reads every weight once whatever its rows, so at a
small batch k more rows cost little; at a large one they cost throughput. This module
decides, per step and per request, whether drafts are worth their rows:

* **per step, from the measured step cost** (``DecodeStepCost``): with ``B`` decoding
  requests that would verify ``D`` drafts of which ``A`` are expected to be accepted, a
  speculative step yields ``B + A`` tokens in ``t(B + D)`` seconds, plus the measured
  proposing time (a draft model's passes), against ``B`` tokens in ``t(B)``; drafts go out
  only while the first rate is higher. ``disable_by_batch_size`` (vLLM's key) replaces this
  with a fixed batch size.
* **per request, from its acceptance**: a request whose drafts keep failing (acceptance
  below ``min_acceptance_rate`` over ``acceptance_window`` drafted tokens) pauses drafting
  for ``PAUSE_STEPS`` steps, then tries again.

``SpecDecodeStats`` counts what vLLM's ``spec_decode_*`` metrics count.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import SchedulerOutput
from inflight.core.spec_config import SpeculativeConfig
from inflight.request import Request, RequestStatus

PAUSE_STEPS = 64  # steps a request with failing drafts waits before drafting again
# Accepted drafts per verification assumed before any: a guess, replaced by the measured
# moving average (weight ACCEPTED_ALPHA per verification) after the first.
PRIOR_ACCEPTED = 1.0
ACCEPTED_ALPHA = 0.05
EXPLORE_EVERY = 16  # while t(B) is unknown, one step in this many runs without drafts
REPROBE_EVERY = 256  # while drafts do not pay, one decision in this many speculates anyway


class Proposer(Protocol):
    """Makes drafts (``inflight.spec_decode``): called after a step with the requests
    ``Speculation.requests_to_draft`` chose and how many drafts each may get; sets each
    one's ``spec_token_ids`` (any number up to that, none when it has no guess)."""

    def propose(self, requests: list[tuple[Request, int]]) -> None: ...


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's ``vllm:spec_decode_*``).

    Attributes:
        num_drafts: verifications (a request's drafts checked in one step).
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, accepted.
        accepted_per_position: ``[k]``: drafts accepted at position 0, 1, ... of their
            verification (position i is accepted only if 0..i-1 were).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, 0.0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average (accepted drafts plus the target's own
        token): vLLM's "mean acceptance length"; 0.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DecodeStepCost:
    """Seconds of a decode-only step as a function of its rows, measured.

    An exponential moving average per row count; between measured counts the cost is
    interpolated linearly, above the largest it grows in proportion to the rows (an upper
    bound: a step's weight reading is shared), below the smallest it is that step's cost.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._rows: list[int] = []
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self._seconds.get(rows)
        if old is None:
            bisect.insort(self._rows, rows)
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = old + self.alpha * (seconds - old)

    def knows(self, rows: int, tolerance: float = 0.25) -> bool:
        """A step of about ``rows`` rows (within ``tolerance``) was measured."""
        i = bisect.bisect_left(self._rows, rows)
        near = self._rows[max(i - 1, 0):i + 1]
        return any(abs(r - rows) <= tolerance * rows for r in near)

    def predict(self, rows: int) -> float | None:
        """Seconds for a decode step of ``rows`` rows; None before any measurement."""
        keys, t = self._rows, self._seconds
        if not keys:
            return None
        i = bisect.bisect_left(keys, rows)
        if i < len(keys) and keys[i] == rows:
            return t[rows]
        if i == 0:
            return t[keys[0]]
        if i == len(keys):
            return t[keys[-1]] * rows / keys[-1]
        lo, hi = keys[i - 1], keys[i]
        return t[lo] + (t[hi] - t[lo]) * (rows - lo) / (hi - lo)


class Speculation:
    """The scheduler's speculation policy and counters (one per scheduler).

    Args:
        config: the parsed ``--speculative-config``.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.cost = DecodeStepCost()
        # Accepted drafts per verification of k drafts, a moving average over all requests.
        self.mean_accepted = PRIOR_ACCEPTED
        self.propose_s = 0.0  # seconds of proposing per drafting request, a moving average
        self._decisions = 0

    @staticmethod
    def is_decoding(req: Request) -> bool:
        """Running with exactly its newest sampled token left to compute: its next step
        is a decode, which drafts can extend."""
        return (req.status == RequestStatus.RUNNING and req.num_output_tokens > 0
                and req.num_computed_tokens == req.num_tokens - 1)

    def num_to_draft(self, req: Request, max_sequence_len: int) -> int:
        """Drafts worth proposing for ``req``'s next step: k, fewer near ``max_tokens`` or
        the sequence limit (the step's own token always comes on top), 0 while paused."""
        if req.spec_pause > 0 or not self.is_decoding(req):
            return 0
        if req.grammar is not None and req.num_output_tokens < req.sampling_params.min_tokens:
            return 0  # its rows may be masked bare (the sampler's min_tokens fallback)
        k = self.config.num_speculative_tokens
        p = req.sampling_params
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - req.num_output_tokens - 1)
        return max(0, min(k, max_sequence_len - req.num_tokens - 1))

    def step_allows(self, running: list[Request], proposed: bool = False) -> bool:
        """Whether this step's decoding requests should verify drafts (see the module).

        Args:
            running: the running requests.
            proposed: judge the drafts they hold (at scheduling); otherwise (before
                proposing) assume k for each request that may draft.
        """
        decoding = [r for r in running if self.is_decoding(r)]
        b = len(decoding)
        if b == 0:
            return False
        limit = self.config.disable_by_batch_size
        if limit is not None:
            return b < limit
        k = self.config.num_speculative_tokens
        if proposed:
            drafting = [r for r in decoding if r.spec_token_ids]
            drafts = sum(len(r.spec_token_ids) for r in drafting)
        else:
            drafting = [r for r in decoding if r.spec_pause == 0]
            drafts = k * len(drafting)
        if not drafts:
            return not proposed
        self._decisions += 1
        if not self.cost.knows(b + drafts):
            return True  # a verification of about this size is unmeasured: measure one
        if not self.cost.knows(b):
            # Plain steps of this batch unmeasured: speculate, and now and then run a plain
            # step to learn t(B).
            return self._decisions % EXPLORE_EVERY != 0
        t_plain, t_spec = self.cost.predict(b), self.cost.predict(b + drafts)
        assert t_plain is not None and t_spec is not None  # both measured (``knows``)
        t_spec += self.propose_s * len(drafting)
        accepted = self.mean_accepted * drafts / k
        if (b + accepted) * t_plain > b * t_spec:
            return True
        # Now and then speculate anyway, so one slow measurement (a busy neighbour, a
        # warm-up) cannot keep drafts off for good.
        return self._decisions % REPROBE_EVERY == 0

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only step of ``num_rows`` rows took ``seconds``."""
        self.cost.observe(num_rows, seconds)

    def observe_proposal(self, num_requests: int, seconds: float) -> None:
        """Proposing drafts for ``num_requests`` requests took ``seconds`` (a draft
        model's forward passes; next to nothing for n-gram lookup): a cost of drafting the
        switch adds to the verification step's."""
        if num_requests > 0:
            per_request = seconds / num_requests
            self.propose_s += ACCEPTED_ALPHA * 4 * (per_request - self.propose_s)

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """``req`` verified ``num_drafts`` drafts and ``num_accepted`` were right."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        if num_drafts:  # scaled to k drafts: a request near max_tokens drafts fewer
            full = num_accepted * self.config.num_speculative_tokens / num_drafts
            self.mean_accepted += ACCEPTED_ALPHA * (full - self.mean_accepted)
        req.spec_drafted += num_drafts
        req.spec_accepted += num_accepted
        if req.spec_drafted >= self.config.acceptance_window:
            if req.spec_accepted < self.config.min_acceptance_rate * req.spec_drafted:
                req.spec_pause = PAUSE_STEPS
            req.spec_drafted = req.spec_accepted = 0

    def gate(self, running: list[Request], num_waiting: int) -> None:
        """At the start of a step: paused requests come a step closer to drafting again,
        and every proposed draft is dropped when this step should not verify any: prompt
        work is pending (``prompt_work_pending``), or its batch grew since they were
        proposed."""
        for r in running:
            if r.spec_pause > 0:
                r.spec_pause -= 1
        if prompt_work_pending(running, num_waiting) or not self.step_allows(running, True):
            for r in running:
                r.spec_token_ids = []

    def requests_to_draft(self, running: list[Request], max_sequence_len: int,
                          num_waiting: int = 0) -> list[tuple[Request, int]]:
        """After a step: the requests to propose drafts for, with how many each."""
        if prompt_work_pending(running, num_waiting) or not self.step_allows(running):
            return []
        wanted = [(r, self.num_to_draft(r, max_sequence_len)) for r in running]
        return [(r, k) for r, k in wanted if k > 0]

    def settle(self, out: SchedulerOutput, kept: dict[str, int],
               kv_cache: KVCacheManager) -> None:
        """After verification (``kept``: tokens each request kept this step): count the
        accepted drafts; a request still running keeps the computed positions of its
        accepted drafts only (the rejected ones' slots are written again later), gives
        back lookahead blocks it no longer needs, and registers the blocks its now-known
        tokens fill for the prefix cache."""
        for s in out.scheduled:
            if not s.num_draft_tokens:
                continue
            req = s.request
            n = kept.get(req.request_id, 0)
            self.record(req, s.num_draft_tokens, max(n - 1, 0))
            if req.is_finished:
                continue
            req.num_computed_tokens = s.num_computed_tokens + n
            kv_cache.trim(req, req.num_tokens)
            kv_cache.cache_full_blocks(req)


def prompt_work_pending(running: list[Request], num_waiting: int) -> bool:
    """Requests wait, or a running one has prompt tokens left (a chunked prefill): drafts
    would take the step's budget and time from them. Measured at 32 streams, verifying
    drafts while prompts waited tripled the median TTFT and got requests shed
    (docs/performance.md); drafts use only a step that has no prompt work."""
    return num_waiting > 0 or any(r.num_uncomputed_tokens > 1 for r in running)
