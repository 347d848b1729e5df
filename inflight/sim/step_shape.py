"""The shape of one engine step and the cost-model interface over it. Torch-free.

A step is described by its shape (:class:`StepShape`, read off the scheduler's plan); a cost
model (:class:`CostModel`) maps a shape to seconds: fitted to measured steps
(:mod:`inflight.sim.fitted_cost`), derived by roofline (:mod:`inflight.sim.roofline`), or
constant (:class:`ConstantCostModel`, for tests against analytic results).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


class PlannedRow(Protocol):
    """What a shape reads off one row of a plan (``core.output.ScheduledRequest``)."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def samples(self) -> bool: ...
    # ``num_draft_tokens`` (the last that many of ``token_ids`` are drafts) is read where a
    # row has it; a stand-in row without it verifies no drafts.


@dataclass(frozen=True)
class StepShape:
    """The work of one step. Counts in tokens or rows.

    Attributes:
        tokens: tokens computed (the step's ``num_batched_tokens``).
        rows: requests scheduled, a request verifying ``d`` drafts counted as its ``1 + d``
            decode rows (the runner runs them as that many one-query rows).
        samples: rows that sample a token (their last position goes through the LM head;
            every row of a verification does).
        prefill_tokens: tokens of rows that compute more than one token (prompt chunks).
        decode_context: KV tokens attended by one-token rows (sum of their context lengths;
            a verification's row ``i`` attends ``num_computed_tokens + i + 1``).
        prefill_pairs: query-key pairs of the multi-token rows: a chunk of ``n`` tokens
            after ``s`` computed ones attends ``n * s + n * (n + 1) / 2``.
    """

    tokens: int
    rows: int
    samples: int
    prefill_tokens: int = 0
    decode_context: int = 0
    prefill_pairs: int = 0

    @property
    def kind(self) -> str:
        """``decode`` (every row computes one token) or ``mixed``."""
        return "decode" if self.prefill_tokens == 0 else "mixed"

    @classmethod
    def of(cls, scheduled: Sequence[PlannedRow]) -> StepShape:
        """The shape of a plan's ``ScheduledRequest`` rows (``SchedulerOutput.scheduled``).

        A decode token with ``d`` drafts to verify is ``1 + d`` decode rows, each
        sampling (``runner.ModelRunner``: same block table, row ``i`` attends
        ``num_computed_tokens + i + 1`` keys): the step of ``B`` requests verifying ``D``
        drafts has the shape of a decode step of ``B + D`` rows, never prefill tokens."""
        tokens = rows = samples = prefill = ctx = pairs = 0
        for s in scheduled:
            n, start = len(s.token_ids), s.num_computed_tokens
            d = int(getattr(s, "num_draft_tokens", 0))
            tokens += n
            if n - d == 1:
                rows += n
                samples += n if s.samples else 0
                ctx += n * (start + 1) + n * (n - 1) // 2
            else:
                rows += 1
                samples += bool(s.samples)
                prefill += n
                pairs += n * start + n * (n + 1) // 2
        return cls(tokens, rows, samples, prefill, ctx, pairs)


class CostModel(Protocol):
    """Seconds for a step of a given shape."""

    def predict(self, shape: StepShape) -> float: ...


@dataclass
class ConstantCostModel:
    """Every step takes ``seconds`` (for tests against analytic results: a deterministic
    server, one schedule step per time unit)."""

    seconds: float

    def predict(self, shape: StepShape) -> float:
        return self.seconds
