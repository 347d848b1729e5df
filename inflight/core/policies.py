"""Batching policies: when may waiting requests join the running batch? Torch-free.

- ``continuous``: at every step (iteration-level scheduling, Orca, OSDI 2022).
- ``static``: only when nothing runs; the batch then runs until every member finishes.
- ``dynamic``: as static, but a batch launches only once ``max_num_seqs`` requests wait or
  the oldest has waited ``max_queue_delay`` seconds (Triton/TF-Serving dynamic batching).
"""

from __future__ import annotations

from collections import deque

from inflight.request import Request

BATCHING_POLICIES = ("continuous", "static", "dynamic")


def can_admit(policy: str, running: list[Request], waiting: deque[Request], *,
              max_num_seqs: int, max_queue_delay: float, now: float,
              launching: bool) -> bool:
    """Whether the head of ``waiting`` may be admitted this step.

    Args:
        launching: a static/dynamic batch is being formed in this step (members admitted
            earlier in the same step do not close the batch).
    """
    if policy == "continuous":
        return True
    if running and not launching:
        return False
    if policy == "static" or launching:
        return True
    # dynamic: wait for a full batch or for the oldest request's deadline.
    return len(waiting) >= max_num_seqs or now - waiting[0].arrival_time >= max_queue_delay
