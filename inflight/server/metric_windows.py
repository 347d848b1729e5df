"""The sliding latency windows of ``ServerMetrics``: exact percentiles over the last
``window_s`` seconds, for ``GET /stats`` and the ``inflight:<name>_window`` gauges."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from inflight.quantiles import percentile

QUANTILES = (0.5, 0.95, 0.99)


class SlidingWindow:
    """Samples of the last ``window_s`` seconds (at most ``max_samples``), thread-safe.

    Percentiles interpolate linearly between order statistics (numpy's default method).
    """

    def __init__(self, window_s: float, max_samples: int = 50_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, value))

    def values(self, now: float | None = None) -> list[float]:
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
            return [v for _, v in self._samples]

    def summary(self, now: float | None = None) -> dict[str, float | int | None]:
        """``{"count", "mean", "p50", "p95", "p99"}``; None values when the window is empty."""
        vals = sorted(self.values(now))
        out: dict[str, float | int | None] = {"count": len(vals),
                                              "mean": sum(vals) / len(vals) if vals else None}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = percentile(vals, q * 100)
        return out


def token_count_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``), for
    per-request token-count histograms; always at least ``[1]``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets or [1]
            buckets.append(m * scale)
        scale *= 10


class WindowCollector:
    """Exposes the windows as gauges computed at scrape time."""

    def __init__(self, windows: dict[str, SlidingWindow], labels: dict[str, str]) -> None:
        self._windows = windows
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, window in self._windows.items():
            fam = GaugeMetricFamily(
                f"inflight:{name}_window",
                f"{name} quantiles over the last {window.window_s:g} s (exact, not bucketed)",
                labels=["quantile", *self._labels])
            summary = window.summary()
            for q in QUANTILES:
                value = summary[f"p{round(q * 100)}"]
                fam.add_metric([f"{q:g}", *self._labels.values()],
                               math.nan if value is None else value)
            yield fam


