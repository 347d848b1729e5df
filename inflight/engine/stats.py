"""Engine counters and gauges (``EngineStats``) and the periodic stats log line."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from inflight.outputs import RequestOutput
from inflight.profiling import StepTimer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters and gauges for metrics and the periodic log line.

    Attributes:
        num_running, num_waiting: requests (sequences) now running / waiting.
        kv_cache_usage: fraction of KV blocks in use, 0..1.
        num_preemptions: preemptions since start.
        prompt_tokens, generation_tokens: tokens computed for prompts / sampled, since start.
        num_steps: engine steps since start.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in / found in the
            prefix cache at first admission, since start (readmissions after preemption
            are left out, as vLLM does).
        num_recomputed_tokens: tokens computed again after preemption, since start
            (``Scheduler.num_recomputed_tokens``).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_recomputed_tokens: int = 0


def _hit_rate(now: EngineStats, before: EngineStats) -> float:
    queries = now.prefix_cache_queries - before.prefix_cache_queries
    return (now.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0


class StatsLogger:
    """Logs one line every ``interval_s`` seconds while the engine steps.

    Running and waiting sequences, KV cache usage, prompt and generation throughput
    (tokens/s over the interval, recomputation after preemption included) and preemptions.
    Silent while idle: no step, no line.
    """

    def __init__(self, interval_s: float = 10.0, step_timer: StepTimer | None = None) -> None:
        self.interval_s = interval_s
        self.step_timer = step_timer
        self._last: EngineStats | None = None
        self._last_time = 0.0
        self._last_step_time = float("-inf")

    def __call__(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None:
        idle_gap = now - self._last_step_time > self.interval_s
        self._last_step_time = now
        if self._last is None or idle_gap:
            # The first step after an idle spell starts a fresh interval, so the rates
            # are not diluted by time nobody was waiting.
            self._last, self._last_time = stats, now
            return
        dt = now - self._last_time
        if dt < self.interval_s:
            return
        last = self._last
        logger.info(
            "running: %d, waiting: %d, KV cache usage: %.1f%%, prompt throughput: %.1f tok/s, "
            "generation throughput: %.1f tok/s, preemptions: %d (+%d), "
            "prefix cache hit rate: %.1f%%",
            stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage,
            (stats.prompt_tokens - last.prompt_tokens) / dt,
            (stats.generation_tokens - last.generation_tokens) / dt,
            stats.num_preemptions, stats.num_preemptions - last.num_preemptions,
            100 * _hit_rate(stats, last))
        if self.step_timer is not None and self.step_timer.enabled:
            logger.info("step breakdown: %s", StepTimer.format(self.step_timer.summary()))
            self.step_timer.records.clear()
        self._last, self._last_time = stats, now
