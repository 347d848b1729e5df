"""Wall-clock timing of a callable, for the micro-benchmarks in ``benchmarks/``."""

from __future__ import annotations

import time
from typing import Callable


def seconds_per_call(fn: Callable[[], object], seconds: float = 0.4) -> float:
    """Mean wall-clock seconds per call of ``fn`` over at least ``seconds`` of calls, after
    one untimed warm-up call. Callers take the best of several of these, interleaved."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n
