"""Step breakdown: where an engine step's wall time goes, behind ``--step-breakdown``.

Phases (seconds, per step):

- ``schedule``: the scheduler's plan (admission, preemption, shedding, block allocation);
- ``prepare``: input preparation (token ids, positions, slot mapping, block tables);
- ``forward``: the model forward and LM head, of which ``attention`` (KV write + paged
  attention, summed over layers) is also reported on its own;
- ``sample``: the sampler (penalties, temperature, top-k/p, the token draw, logprobs);
- ``output``: appending tokens, detokenization, stop checks, building outputs.

Timers are ``time.perf_counter`` around each phase. A CUDA step runs asynchronously, so
with timing on every phase boundary synchronizes the device: the breakdown is exact but
the step a little slower. Off (the default) a phase costs one no-op context manager.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ContextManager

PHASES = ("schedule", "prepare", "forward", "attention", "sample", "output")
_NULL = contextlib.nullcontext()


@dataclass
class StepRecord:
    """One step: ``seconds`` per phase, the wall time of the whole step, its size."""

    num_seqs: int
    num_tokens: int
    total: float
    seconds: dict[str, float] = field(default_factory=dict)


class StepTimer:
    """Accumulates phase times of the current step; keeps the last ``window`` steps.

    Args:
        enabled: off, ``section`` returns a shared no-op context.
        device: the engine's device; CUDA phases synchronize at their boundaries.
        window: steps kept for ``summary`` (the server's stats interval reads them).
    """

    def __init__(self, enabled: bool = False, device: Any = None, window: int = 4096) -> None:
        self.enabled = enabled
        self._sync: Callable[[], None] | None = None
        if getattr(device, "type", None) == "cuda":  # a torch.device; torch only then
            import torch
            self._sync = torch.cuda.synchronize
        self._current: dict[str, float] = {}
        self._step_start = 0.0
        self.records: deque[StepRecord] = deque(maxlen=window)

    def begin_step(self) -> None:
        if self.enabled:
            self._current = {}
            self._step_start = time.perf_counter()

    def section(self, phase: str) -> ContextManager[None]:
        """Context manager adding its wall time to ``phase`` of the current step."""
        return self._timed(phase) if self.enabled else _NULL

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        if self._sync:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - t0

    def end_step(self, num_seqs: int, num_tokens: int) -> None:
        """Close the step (one that computed nothing is not recorded)."""
        if self.enabled and num_tokens:
            self.records.append(StepRecord(num_seqs, num_tokens,
                                           time.perf_counter() - self._step_start,
                                           self._current))

    def summary(self, records: list[StepRecord] | None = None) -> dict[str, float]:
        """Mean milliseconds per step, per phase, over ``records`` (default: the window).

        Returns ``{"steps", "mean_seqs", "mean_tokens", "total_ms", "<phase>_ms" ...,
        "other_ms"}``; ``forward_ms`` includes ``attention_ms``; ``other_ms`` is the step time
        no phase covers (engine bookkeeping). Empty dict when nothing was recorded.
        """
        recs = list(self.records) if records is None else records
        if not recs:
            return {}
        n = len(recs)
        out = {"steps": n, "mean_seqs": sum(r.num_seqs for r in recs) / n,
               "mean_tokens": sum(r.num_tokens for r in recs) / n,
               "total_ms": 1e3 * sum(r.total for r in recs) / n}
        for p in PHASES:
            out[f"{p}_ms"] = 1e3 * sum(r.seconds.get(p, 0.0) for r in recs) / n
        covered = sum(out[f"{p}_ms"] for p in PHASES if p != "attention")
        out["other_ms"] = max(out["total_ms"] - covered, 0.0)
        return out

    @staticmethod
    def format(s: dict[str, float]) -> str:
        """One log line from ``summary``."""
        if not s:
            return "no steps"
        parts = " ".join(f"{p} {s[f'{p}_ms']:.1f}" for p in PHASES)
        return (f"{s['steps']} steps, {s['mean_seqs']:.0f} seqs, {s['mean_tokens']:.0f} tokens, "
                f"{s['total_ms']:.1f} ms/step: {parts} other {s['other_ms']:.1f} (ms)")


# The disabled timer that attention metadata carries by default (never records).
NULL_TIMER = StepTimer()
