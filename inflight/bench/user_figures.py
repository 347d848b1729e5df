"""What a closed-loop point's users saw (``bench.users``): per-user output speed, TTFT by
turn, the time to finish a conversation, the prefix-cache hit rate."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from inflight.bench.client import RequestRecord
from inflight.bench.metrics_scrape import prefix_hit_rate
from inflight.bench.summary import request_metrics
from inflight.quantiles import percentile


def session_figures(records: Sequence[RequestRecord], counters: dict[str, float]) -> dict[str, Any]:
    """What a closed-loop point's users saw, over its sample requests: each request's output
    speed (tokens a second after its first, ``1 / TPOT``: the per-user speed AA-AgentPerf's
    tiers floor) at p5 and p50; TTFT p50 / p95 by turn; the time to finish a conversation
    whose every turn succeeded and whose first turn is in the sample (p50 / p95); the
    server's prefix-cache hit rate over the point (``counters``: its counter deltas)."""
    sample = [r for r in records if r.phase == "sample" and r.user is not None]
    speeds = [1 / m.tpot for m in map(request_metrics, sample) if m.tpot]
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in sample:
        m = request_metrics(r)
        if m.ttft is not None and r.turn is not None:
            by_turn[r.turn].append(m.ttft)
    sessions: dict[tuple[int | None, int | None], list[RequestRecord]] = defaultdict(list)
    for r in records:
        sessions[(r.user, r.conversation)].append(r)
    times = [max(x.end_time for x in rs) - min(x.send_time for x in rs) for rs in sessions.values()
             if rs[0].user is not None and _whole(rs) and _starts_in_sample(rs)]
    return {
        "users": len({r.user for r in records if r.user is not None}),
        "output_speed_per_user": {"p5": percentile(speeds, 5), "p50": percentile(speeds, 50), "n": len(speeds)},
        "ttft_by_turn": {str(t): {"p50": percentile(v, 50), "p95": percentile(v, 95), "n": len(v)}
                         for t, v in sorted(by_turn.items())},
        "session_seconds": {"p50": percentile(times, 50), "p95": percentile(times, 95), "n": len(times)},
        "prefix_cache_hit_rate": prefix_hit_rate(counters),
    }


def _whole(rs: list[RequestRecord]) -> bool:
    """Every turn of the conversation was sent and succeeded, from turn 0 on."""
    turns = sorted(r.turn or 0 for r in rs)
    return all(r.success for r in rs) and turns == list(range(rs[0].turns or 0))


def _starts_in_sample(rs: list[RequestRecord]) -> bool:
    return min(rs, key=lambda r: r.turn or 0).phase == "sample"
