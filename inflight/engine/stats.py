"""Engine counters and gauges (``EngineStats``) and the periodic stats log line."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from inflight.core.speculation import SpecDecodeStats
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
        spec_decode_num_drafts, spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens: speculative decoding since start
            (``core.speculation.SpecDecodeStats``, vLLM's ``spec_decode_*``): verifications,
            draft tokens verified, draft tokens accepted; 0 with speculation off.
        spec_decode_num_accepted_tokens_per_pos: ``[k]``, drafts accepted at position
            0..k-1 of their verification; empty exactly when speculation is off.
        running_lora_adapters, waiting_lora_adapters: names of the LoRA adapters of
            running / waiting requests, sorted; max_lora: ``--max-loras`` (0: LoRA off)
            (vLLM's ``lora_requests_info`` labels).
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
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0


def spec_decode_fields(spec: SpecDecodeStats | None) -> dict[str, Any]:
    """``EngineStats`` keyword arguments for the speculation counters ``spec`` (copied: the
    scheduler keeps counting into its own); none when speculation is off (None)."""
    if spec is None:
        return {}
    return {"spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(spec.accepted_per_position)}


def _add_positions(a: Sequence[int], b: Sequence[int], sign: int = 1) -> list[int]:
    """``a + sign * b`` elementwise, the shorter one padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(n)]


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Every field summed over ``stats`` (replicas of a data-parallel server), the
    per-position counters elementwise; ``kv_cache_usage`` summed too (a caller wanting the
    mean divides); LoRA adapter names the union, ``max_lora`` the largest. Raises
    ``ValueError`` on an empty sequence."""
    if not stats:
        raise ValueError("sum_stats: no stats")
    total: dict[str, Any] = {}
    for f in fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if isinstance(values[0], list):
            acc: list[int] = []
            for v in values:
                acc = _add_positions(acc, v)
            total[f.name] = acc
        elif isinstance(values[0], tuple):  # adapter names: those of any replica
            total[f.name] = tuple(sorted(set().union(*values)))
        elif f.name == "max_lora":  # every replica's own cap, the same flag
            total[f.name] = max(values)
        else:
            total[f.name] = sum(values)
    return EngineStats(**total)


def spec_decode_line(now: EngineStats, before: EngineStats, dt: float) -> str | None:
    """vLLM's ``SpecDecodingLogging`` line over an interval of ``dt`` seconds (``before`` to
    ``now``); None when no request verified drafts in it.

    Mean acceptance length counts the target's own token (1 + accepted / drafts); the
    per-position rates are drafts accepted at each position over all verifications, so
    position i counts only when 0..i-1 were accepted too (vLLM v1
    ``vllm/v1/spec_decode/metrics.py``).
    """
    drafts = now.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts <= 0 or dt <= 0:
        return None
    drafted = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    per_pos = _add_positions(now.spec_decode_num_accepted_tokens_per_pos,
                             before.spec_decode_num_accepted_tokens_per_pos, -1)
    rates = ", ".join(f"{n / drafts:.3f}" for n in per_pos)
    rate = 100 * accepted / drafted if drafted else float("nan")
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / dt:.2f} tokens/s, "
            f"Drafted throughput: {drafted / dt:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {rate:.1f}%")


def spec_decode_summary(stats: EngineStats) -> dict[str, Any]:
    """The ``spec_decode`` object of ``GET /stats``: counters since start and the rates
    derived from them (``acceptance_rate`` = accepted / drafted, ``mean_acceptance_length``
    = 1 + accepted / drafts, both 0.0 before any draft; ``accepted_per_position``: counts,
    ``[k]``)."""
    spec = SpecDecodeStats(stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                           stats.spec_decode_num_accepted_tokens,
                           list(stats.spec_decode_num_accepted_tokens_per_pos))
    return {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length,
            "accepted_per_position": spec.accepted_per_position}


def _hit_rate(now: EngineStats, before: EngineStats) -> float:
    queries = now.prefix_cache_queries - before.prefix_cache_queries
    return (now.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0


class StatsLogger:
    """Logs one line every ``interval_s`` seconds while the engine steps.

    Running and waiting sequences, KV cache usage, prompt and generation throughput
    (tokens/s over the interval, recomputation after preemption included) and preemptions;
    with speculative decoding, a second line (``spec_decode_line``) when drafts were
    verified in the interval. Silent while idle: no step, no line.
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
        spec_line = spec_decode_line(stats, last, dt)
        if spec_line is not None:
            logger.info("%s", spec_line)
        if self.step_timer is not None and self.step_timer.enabled:
            logger.info("step breakdown: %s", StepTimer.format(self.step_timer.summary()))
            self.step_timer.records.clear()
        self._last, self._last_time = stats, now
