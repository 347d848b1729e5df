"""The one percentile of the package: the server's sliding windows and the benchmark's summaries
both report it, so both compute it here, on one scale (0-100, NumPy's)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of ``values``.

    Args:
        values: samples in any order (seconds, tokens, ...); the result has their unit.
        p: percentile rank, 0-100 (NumPy's scale: 95 is the p95).
    Returns:
        Linear interpolation between the closest ranks (``numpy.percentile``'s default
        method, as vLLM's bench and GuideLLM report), or None for no values.
    Raises:
        ValueError: ``p`` outside 0-100.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile rank {p} is outside 0-100")
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), p))
