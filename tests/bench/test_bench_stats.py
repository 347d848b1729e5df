"""Latency statistics and goodput from recorded timestamps: exact values.

Timestamps are multiples of 1/64 s, so every difference, sum and interpolation below is
exact in binary floating point and asserted with ``==``.
"""

from __future__ import annotations

import pytest

from inflight.bench.client import RequestRecord
from inflight.bench.summary import (SLO, check_aggregate, concurrency_timeline, meets_slo, parse_slo,
                                  peak_concurrency, percentile, request_metrics, summarize)


def rec(i, send, chunks, out=None, ok=True, end=None, warmup=False, prompt_tokens=10):
    return RequestRecord(index=i, scheduled_time=send, send_time=send, chunk_times=list(chunks),
                         end_time=end if end is not None else (chunks[-1] if chunks else send),
                         success=ok, output_tokens=len(chunks) if out is None else out,
                         prompt_tokens=prompt_tokens, prompt_len=prompt_tokens, warmup=warmup)


def test_request_metrics_follow_vllm_definitions():
    r = rec(0, 1.0, [1.25, 1.375, 1.875, 2.0])
    m = request_metrics(r)
    assert m.ttft == 0.25
    assert m.itls == [0.125, 0.5, 0.125]
    assert m.e2e == 1.0
    assert m.tpot == (1.0 - 0.25) / 3 == 0.25


def test_tpot_uses_usage_tokens_not_chunks():
    # Two tokens per chunk: 3 chunks, 6 tokens -> TPOT = (E2E - TTFT) / 5.
    m = request_metrics(rec(0, 0.0, [0.5, 1.0, 1.75], out=6))
    assert m.tpot == (1.75 - 0.5) / 5 == 0.25
    assert m.itls == [0.5, 0.75]


def test_one_token_and_failed_requests_have_no_tpot():
    assert request_metrics(rec(0, 0.0, [0.5])).tpot is None
    failed = request_metrics(rec(0, 0.0, [], ok=False))
    assert failed.ttft is None and failed.e2e is None and failed.itls == []


def test_percentiles_of_101_values_are_order_statistics():
    vals = [i / 64 for i in range(101)]
    assert percentile(vals, 50) == 50 / 64
    assert percentile(vals, 90) == 90 / 64
    assert percentile(vals, 95) == 95 / 64
    assert percentile(vals, 99) == 99 / 64
    assert percentile([], 50) is None
    # Linear interpolation between order statistics, as numpy and vLLM.
    assert percentile([0.0, 1.0], 25) == 0.25


def make_run():
    """101 requests, request i sent at i/64 s, TTFT i/64 s, then 4 more chunks 1/64 s apart."""
    records = []
    for i in range(101):
        send = i / 64
        first = send + i / 64
        records.append(rec(i, send, [first + k / 64 for k in range(5)]))
    return records


def test_summary_exact():
    records = make_run()
    s = summarize(records, parse_slo("ttft=0.5"))
    assert s["completed"] == 101 and s["failed"] == 0
    # Last request: sent at 100/64, last chunk at 200/64 + 4/64.
    assert s["duration"] == 204 / 64
    assert s["ttft"]["mean"] == 50 / 64
    assert s["ttft"]["median"] == 50 / 64
    assert (s["ttft"]["p90"], s["ttft"]["p95"], s["ttft"]["p99"]) == (90 / 64, 95 / 64, 99 / 64)
    assert s["itl"]["mean"] == s["itl"]["p99"] == 1 / 64
    assert s["tpot"]["median"] == 1 / 64
    assert s["e2e"]["p95"] == 95 / 64 + 4 / 64
    assert s["total_output_tokens"] == 505
    assert s["total_input_tokens"] == 1010
    assert s["request_throughput"] == 101 / (204 / 64)
    assert s["output_throughput"] == 505 / (204 / 64)
    # TTFT <= 0.5 s = 32/64: requests 0..32.
    assert s["good_requests"] == 33
    assert s["goodput"] == 33 / (204 / 64)


def test_goodput_itl_is_every_gap_and_tpot_the_mean():
    smooth = rec(0, 0.0, [0.25, 0.5, 0.75, 1.0])  # gaps 0.25, TPOT 0.25
    stall = rec(1, 0.0, [0.25, 0.3125, 0.9375, 1.0])  # one 0.625 s gap, TPOT 0.25
    for r, itl_ok in ((smooth, True), (stall, False)):
        m = request_metrics(r)
        assert meets_slo(m, {"itl": 0.5}) is itl_ok
        assert meets_slo(m, {"tpot": 0.25}) is True
        assert meets_slo(m, {"tpot": 0.125}) is False
        assert meets_slo(m, {"ttft": 0.25, "e2e": 1.0}) is True
        assert meets_slo(m, {"e2e": 0.9375}) is False


def test_failed_and_warmup_requests():
    records = [rec(0, 0.0, [0.5, 1.0]), rec(1, 0.25, [], ok=False, end=2.0),
               rec(2, 0.0, [5.0, 6.0], warmup=True)]
    s = summarize(records, parse_slo("ttft=1"))
    assert s["completed"] == 1 and s["failed"] == 1
    assert s["duration"] == 2.0  # the failed request's end counts, the warm-up not at all
    assert s["good_requests"] == 1
    assert s["goodput"] == 0.5
    assert s["peak_concurrency"] == 2


def test_goodput_judges_as_guidellm_errored_fail_cancelled_and_undetermined_do_not_count():
    """vllm-project/guidellm PR #1085's rule, each case apart: the denominator of
    ``slo_attainment`` holds the met, the missed and the errored requests only."""
    met = rec(0, 0.0, [0.25, 0.5, 0.75])             # TTFT 0.25, TPOT 0.25
    missed = rec(1, 0.0, [0.75, 1.0, 1.25])          # TTFT 0.75
    errored = rec(2, 0.0, [], ok=False, end=0.5)     # a 500, or a broken stream
    cancelled = rec(3, 0.0, [0.25], ok=False, end=2.0)
    cancelled.unfinished = True                      # the point ended before it finished
    one_token = rec(4, 0.0, [0.25])                  # no TPOT to judge
    unstreamed = rec(5, 0.0, [], end=1.0)            # succeeded, no chunk: no TTFT
    records = [met, missed, errored, cancelled, one_token, unstreamed]
    s = summarize(records, parse_slo("ttft=0.5,tpot=0.5"))
    assert (s["good_requests"], s["judged_requests"]) == (1, 3)
    assert s["slo_attainment"] == 1 / 3
    assert s["goodput"] == 1 / 2.0  # the duration still runs to the cancelled request's end
    # each case moves the figure its own way
    assert summarize([met, errored], parse_slo("ttft=0.5"))["slo_attainment"] == 0.5
    assert summarize([met, cancelled], parse_slo("ttft=0.5"))["slo_attainment"] == 1.0
    assert summarize([met, unstreamed], parse_slo("e2e=2"))["slo_attainment"] == 1.0
    # a TTFT target alone judges the one-token request; a TPOT target does not
    assert summarize([one_token], parse_slo("ttft=0.5"))["judged_requests"] == 1
    assert summarize([one_token], parse_slo("tpot=0.5"))["judged_requests"] == 0
    assert summarize([one_token], parse_slo("tpot=0.5"))["slo_attainment"] is None
    # a target it fails decides, even beside one it cannot be judged on
    assert meets_slo(request_metrics(missed), {"ttft": 0.5, "tpot": 0.5}) is False
    assert meets_slo(request_metrics(one_token), {"ttft": 0.5, "itl": 0.5}) is None
    assert summarize([met], SLO())["slo_attainment"] is None


def test_concurrency_timeline_half_open():
    records = [rec(0, 0.0, [1.0]), rec(1, 1.0, [2.0]), rec(2, 0.5, [1.5])]
    tl = concurrency_timeline(records)
    assert tl[-1] == (2.0, 0)
    # Request 1 starts exactly when request 0 ends: never 3 at once.
    assert peak_concurrency(records) == 2


def test_parse_slo_units_and_kinds():
    slo = parse_slo("ttft=500ms, itl=0.05,ttft_p95=1s,itl_p99=100ms,e2el_median=2")
    assert slo.per_request == {"ttft": 0.5, "itl": 0.05}
    assert slo.aggregate == {("ttft", "p95"): 1.0, ("itl", "p99"): 0.1, ("e2e", "p50"): 2.0}
    assert slo.to_json() == {"ttft": 0.5, "itl": 0.05, "ttft_p95": 1.0, "itl_p99": 0.1, "e2e_p50": 2.0}
    assert not parse_slo(None)
    for bad in ("ttft", "foo=1", "ttft_p42=1", "ttft=fast"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_check_aggregate():
    s = summarize(make_run())
    assert check_aggregate(s, {("ttft", "p95"): 95 / 64}) == []
    assert check_aggregate(s, {("ttft", "p50"): 50 / 64}) == []
    bad = check_aggregate(s, {("ttft", "p99"): 98 / 64, ("tpot", "mean"): 1.0})
    assert len(bad) == 1 and bad[0].startswith("ttft p99")
    assert check_aggregate(summarize([]), {("ttft", "p95"): 1.0}) == ["ttft p95 not measured"]


def test_slo_violations_reported_in_summary():
    s = summarize(make_run(), SLO(aggregate={("ttft", "p90"): 1.0}))
    assert s["slo_violations"] == [f"ttft p90 {90 / 64 * 1000:.1f} ms > 1000.0 ms"]
