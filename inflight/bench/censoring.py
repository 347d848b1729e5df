"""A point's latencies with its unfinished requests censored, and each SLO statistic's
confidence interval over them: the latency evidence of ``sustain.judge`` (rule 3).

A sample request still unfinished when the point ended is not dropped (that would keep only
the fast ones): its TTFT (if no token came), TPOT and E2E are ``inf``, and the open gap
since its last token is one more ITL.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from inflight.bench.client import RequestRecord
from inflight.bench.confidence import DEFAULT_CONFIDENCE, stat_interval
from inflight.bench.summary import SLO


def censored_metrics(r: RequestRecord, deadline: float) -> dict[str, Any]:
    """One request's TTFT, TPOT, E2E (s) and ITL gaps, with an unfinished request censored:
    ``inf`` where it never got there, its open gap up to ``deadline`` as a last gap."""
    chunks = r.chunk_times
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    if r.success:
        ttft = chunks[0] - r.send_time if chunks else None
        e2e = chunks[-1] - r.send_time if chunks else None
        n = r.output_tokens or 0
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
        return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "itls": gaps}
    # Unfinished: whatever it did not reach is beyond every finite target.
    ttft = chunks[0] - r.send_time if chunks else math.inf
    open_gap = deadline - (chunks[-1] if chunks else r.send_time)
    return {"ttft": ttft, "tpot": math.inf, "e2e": math.inf,
            "itls": gaps + ([max(0.0, open_gap)] if chunks else [])}


def slo_intervals(sample: Sequence[RequestRecord], slo: SLO, deadline: float,
                  confidence: float = DEFAULT_CONFIDENCE) -> dict[str, dict[str, Any]]:
    """Each aggregate SLO's interval over the finished and unfinished sample requests
    (failed ones excluded: a failure fails the point on its own), in arrival order so that
    a clump of slow requests counts as the fewer independent draws it is."""
    kept = sorted((r for r in sample if r.success or r.unfinished), key=lambda r: r.scheduled_time)
    measured = [censored_metrics(r, deadline) for r in kept]
    out = {}
    for (metric, stat), target in slo.aggregate.items():
        if metric == "itl":
            iv = stat_interval(stat, groups=[m["itls"] for m in measured], confidence=confidence,
                               ordered=True)
        else:
            iv = stat_interval(stat, per_request=[m[metric] for m in measured if m[metric] is not None],
                               confidence=confidence, ordered=True)
        out[f"{metric}_{stat}"] = {**iv.to_json(), "target": target,
                                   "passed": iv.bounded and iv.hi <= target}
    return out
