"""Batching policies: when may waiting requests join the running batch? Torch-free.

- ``continuous``: at every step (iteration-level scheduling, Orca, OSDI 2022).
- ``static``: only when nothing runs; the batch then runs until every member finishes.
- ``dynamic``: as static, but a batch launches only once ``max_num_seqs`` requests wait or
  the oldest has waited ``max_queue_delay`` seconds (Triton/TF-Serving dynamic batching).

They sit beside the queue policies (``queue_policy.py``): those order the queue, these gate
admission into the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from inflight.request import Request

BATCHING_POLICIES = ("continuous", "static", "dynamic")


class ContinuousBatching:
    """Admit at every step."""

    #: A batch is formed in one step, even past that step's token budget (its members then
    #: prefill over the next steps), and nothing joins it afterwards.
    forms_batches = False

    def can_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float,
                  launching: bool) -> bool:
        """Whether the head of ``waiting`` may be admitted this step.

        Args:
            running, waiting: the scheduler's queues (``waiting`` not empty).
            now: ``time.monotonic()`` seconds.
            launching: a batch is being formed in this step (members admitted earlier in
                the same step do not close it).
        """
        return True


class StaticBatching(ContinuousBatching):
    """Admit only into an empty engine; the batch then runs until every member finishes."""

    forms_batches = True

    def can_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float,
                  launching: bool) -> bool:
        return launching or not running


class DynamicBatching(StaticBatching):
    """Static batches that launch once ``max_num_seqs`` wait or the oldest waited
    ``max_queue_delay`` seconds."""

    def __init__(self, max_num_seqs: int, max_queue_delay: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_queue_delay = max_queue_delay

    def can_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float,
                  launching: bool) -> bool:
        if launching:
            return True
        if running:
            return False
        return (len(waiting) >= self.max_num_seqs
                or now - waiting[0].arrival_time >= self.max_queue_delay)


def make_batching_policy(name: str, *, max_num_seqs: int,
                         max_queue_delay: float) -> ContinuousBatching:
    """The policy called ``name`` (one of ``BATCHING_POLICIES``); raises ``ValueError``."""
    if name == "continuous":
        return ContinuousBatching()
    if name == "static":
        return StaticBatching()
    if name == "dynamic":
        return DynamicBatching(max_num_seqs, max_queue_delay)
    raise ValueError(f"batching_policy: must be one of {BATCHING_POLICIES}, got {name!r}")
