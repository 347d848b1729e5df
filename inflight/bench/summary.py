"""Latency statistics and SLO goodput from request records.

Definitions follow vLLM's ``benchmarks/benchmark_serving.py`` (all times in seconds):

- TTFT (time to first token) = first token chunk arrival - send time.
- ITL (inter-token latency) = each gap between consecutive token chunks; the aggregate
  pools every gap of every request.
- TPOT (time per output token, excluding the first) = (E2E - TTFT) / (output_tokens - 1),
  for requests with more than one output token; output_tokens comes from ``usage``.
- E2E (end-to-end latency) = last token chunk arrival - send time.
- Duration = end of the last request - send time of the first (warm-ups excluded).
- Request throughput = completed / duration; output throughput = output tokens / duration;
  total token throughput = (prompt + output tokens) / duration.
- Goodput (DistServe, Zhong et al., OSDI 2024; vLLM's ``--goodput``) = completed requests that
  meet every per-request SLO, divided by duration (requests/s). SLO attainment = those
  requests' share of the judged ones. Judged as GuideLLM judges (vllm-project/guidellm PR
  #1085): a request that errored fails its SLO; one the run cancelled (a point that ended
  before it finished, a cool-down) counts on neither side; one whose objective cannot be
  evaluated (no streamed chunk, so no TTFT; one output token, so no TPOT or ITL) counts on
  neither side.

Percentiles are numpy's default (linear interpolation between order statistics), as vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from inflight.bench.client import RequestRecord
from inflight.quantiles import percentile

METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 95, 99)
STAT_NAMES = ("mean", "median", "std", "p90", "p95", "p99", "min", "max")
_ALIASES = {"e2el": "e2e", "median": "p50"}


@dataclass(frozen=True)
class RequestMetrics:
    """Derived per-request latencies (s); None where undefined (failed, no tokens, one token)."""

    ttft: float | None
    tpot: float | None
    itls: list[float]
    e2e: float | None
    output_tokens: int


def request_metrics(r: RequestRecord) -> RequestMetrics:
    n = r.output_tokens or 0
    if not r.success or not r.chunk_times:
        return RequestMetrics(None, None, [], None, n)
    ttft = r.chunk_times[0] - r.send_time
    e2e = r.chunk_times[-1] - r.send_time
    itls = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    return RequestMetrics(ttft, tpot, itls, e2e, n)


def describe(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p95, p99, min, max of ``values`` (None each if empty)."""
    if len(values) == 0:
        return {k: None for k in STAT_NAMES}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": percentile(values, 90), "p95": percentile(values, 95), "p99": percentile(values, 99),
            "min": float(a.min()), "max": float(a.max())}


# ---------------------------------------------------------------- SLOs

@dataclass
class SLO:
    """Targets in seconds.

    ``per_request``: keys ``ttft``, ``tpot``, ``itl`` (every gap of the request; the
    strictest reading of a streaming deadline), ``e2e``: a request is good when it meets all.
    ``aggregate``: keys ``(metric, stat)`` such as ``("ttft", "p95")``: the run's statistic
    must not exceed the target.
    """

    per_request: dict[str, float] = field(default_factory=dict)
    aggregate: dict[tuple[str, str], float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.per_request or self.aggregate)

    def to_json(self) -> dict[str, float]:
        d = dict(self.per_request)
        d.update({f"{m}_{s}": v for (m, s), v in self.aggregate.items()})
        return d


_DURATION = re.compile(r"^\s*([0-9.eE+-]+)\s*(ms|s)?\s*$")


def parse_duration(text: str) -> float:
    """Seconds from ``"0.2"``, ``"0.2s"`` or ``"200ms"``; ValueError otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"bad duration {text!r} (use seconds, or a suffix: 200ms, 0.2s)")
    v = float(m.group(1))
    return v / 1000.0 if m.group(2) == "ms" else v


def parse_slo(text: str | None) -> SLO:
    """Parse ``"ttft=0.5,itl=50ms,ttft_p95=1s"``: bare keys per request, ``_stat`` keys aggregate.

    Values are seconds unless suffixed ``ms``. Stats: mean, median/p50, p90, p95, p99, max.
    """
    slo = SLO()
    if not text:
        return slo
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, val = part.partition("=")
        if not sep:
            raise ValueError(f"bad SLO item {part!r}: expected key=value")
        key = key.strip().lower()
        metric, _, stat = key.partition("_")
        metric = _ALIASES.get(metric, metric)
        if metric not in METRICS:
            raise ValueError(f"unknown SLO metric {metric!r} (ttft, tpot, itl, e2e)")
        target = parse_duration(val)
        if not target > 0:
            raise ValueError(f"bad SLO item {part!r}: the target must be > 0 s")
        if not stat:
            slo.per_request[metric] = target
            continue
        stat = _ALIASES.get(stat, stat)
        if stat not in ("mean", "p50", "p90", "p95", "p99", "max"):
            raise ValueError(f"unknown SLO statistic {stat!r} (mean, median, p90, p95, p99, max)")
        slo.aggregate[(metric, stat)] = target
    return slo


def meets_slo(m: RequestMetrics, per_request: dict[str, float]) -> bool | None:
    """True when every per-request target holds, False when one does not, None when one
    cannot be evaluated (no TTFT or E2E without a streamed chunk; no TPOT or ITL from a
    request of one output token) and none fails."""
    undetermined = False
    for key, target in per_request.items():
        values = m.itls if key == "itl" else [] if getattr(m, key) is None else [getattr(m, key)]
        if not values:
            undetermined = True
        elif max(values) > target:
            return False
    return None if undetermined else True


def slo_judgement(records: Sequence[RequestRecord], per_request: dict[str, float],
                  ) -> tuple[int, int]:
    """``(good, judged)`` over counted records, GuideLLM's rule (the module docstring):
    errored requests judged and failing, cancelled and undetermined ones not judged."""
    good = judged = 0
    for r in records:
        if r.warmup or r.unfinished or r.cancelled:
            continue
        verdict = meets_slo(request_metrics(r), per_request) if r.success else False
        if verdict is not None:
            judged += 1
            good += verdict
    return good, judged


def check_aggregate(summary: dict[str, Any], aggregate: dict[tuple[str, str], float]) -> list[str]:
    """Violations of aggregate SLOs in ``summary`` as readable strings (empty: all hold)."""
    bad = []
    for (metric, stat), target in aggregate.items():
        key = "median" if stat == "p50" else stat
        value = (summary.get(metric) or {}).get(key)
        if value is None:
            bad.append(f"{metric} {stat} not measured")
        elif value > target:
            bad.append(f"{metric} {stat} {value * 1000:.1f} ms > {target * 1000:.1f} ms")
    return bad


# ---------------------------------------------------------------- aggregates

def concurrency_timeline(records: Iterable[RequestRecord]) -> list[tuple[float, int]]:
    """(time s, requests in flight) after each send/end event; intervals are [send, end)."""
    events = []
    for r in records:
        events.append((r.send_time, 1))
        events.append((r.end_time, -1))
    # At equal times the end comes first, so back-to-back requests do not overlap.
    events.sort(key=lambda e: (e[0], e[1]))
    out, n = [], 0
    for t, d in events:
        n += d
        out.append((t, n))
    return out


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    return max((n for _, n in concurrency_timeline(records)), default=0)


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None) -> dict[str, Any]:
    """Aggregates over counted (non-warm-up) requests. Times in s, rates per s.

    Failed requests count toward duration and ``failed`` but not toward latencies,
    throughput or goodput; an errored one counts against ``slo_attainment``. Prompt tokens are taken from ``usage`` where the server gave
    them, else from the dataset's count. ``connection_retries`` sums every record's,
    warm-ups and cool-downs included.
    """
    slo = slo or SLO()
    counted = [r for r in records if not r.warmup]
    ok = [r for r in counted if r.success]
    metrics = [request_metrics(r) for r in ok]
    start = min((r.send_time for r in counted), default=0.0)
    end = max((r.end_time for r in counted), default=0.0)
    duration = end - start
    in_tokens = sum((r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len or 0) for r in ok)
    out_tokens = sum(m.output_tokens for m in metrics)
    good, judged = slo_judgement(counted, slo.per_request) if slo.per_request else (None, 0)

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(counted) - len(ok),  # unfinished ones included
        "unfinished": sum(1 for r in counted if r.unfinished),
        # Requests sent again after their connection failed before the status line (not
        # failures; client.stream_request), in every phase: a fact about the connection.
        "connection_retries": sum(r.connection_retries for r in records),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "peak_concurrency": peak_concurrency(counted),
        "ttft": describe([m.ttft for m in metrics if m.ttft is not None]),
        "tpot": describe([m.tpot for m in metrics if m.tpot is not None]),
        "itl": describe([g for m in metrics for g in m.itls]),
        "e2e": describe([m.e2e for m in metrics if m.e2e is not None]),
        "good_requests": good,
        "judged_requests": judged if good is not None else None,
        "goodput": rate(good) if good is not None else None,
        "slo_attainment": good / judged if good is not None and judged else None,
        "slo": slo.to_json(),
        "errors": _error_counts(counted),
        "prompt_len_mismatches": sum(1 for r in ok if r.prompt_len is not None
                                     and r.prompt_tokens is not None and r.prompt_tokens != r.prompt_len),
    }
    summary["slo_violations"] = check_aggregate(summary, slo.aggregate)
    return summary


def _error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = (r.error or "unknown")[:80]
            counts[key] = counts.get(key, 0) + 1
    return counts
