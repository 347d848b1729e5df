"""Prometheus metrics and sliding-window latency percentiles of one server.

Names are vLLM's with the prefix ``inflight:`` (https://docs.vllm.ai/en/latest/design/metrics.html).
Each app gets its own ``CollectorRegistry``, so several servers in one process (tests) do
not collide. Request and token metrics are fed by ``ServerMetrics.on_step``, an
``AsyncEngine`` step listener, so they see every request, including ones whose client left.

Histograms approximate percentiles only to their bucket bounds; operators set SLOs on p95,
so the p50/p95/p99 of TTFT, ITL and E2E over the last ``window_s`` seconds are also exposed
exactly, as ``GET /stats`` JSON and as the gauges ``inflight:<name>_window{quantile=...}``.
All durations are in seconds.

Aborted requests, one rule for every series. A sequence that ends with ``abort`` (its client
left, the server aborted it or shut down, load shedding) or ``error`` (the engine failed it)
is a finished sequence: it counts once in ``request_success_total`` under that reason, as
vLLM counts finished requests by finish reason, abort included. Beyond that:

- Series of *work and token events* are recorded when the event happens, so they include
  what an aborted request did before it ended: ``prompt_tokens_total`` (a prompt counts when
  its prefill completes, at its first token), ``generation_tokens_total``, TTFT and ITL
  (histograms and windows), ``iteration_tokens_total``, preemptions, prefix-cache and
  recomputed-token counters.
- Series of *per-request summaries*, recorded when a request finishes, take only requests
  whose every sequence finished ``stop`` or ``length``: ``e2e_request_latency_seconds`` (and
  its window), ``request_queue_time_seconds``, ``request_prefill_time_seconds``,
  ``request_decode_time_seconds``, ``request_prompt_tokens`` and
  ``request_generation_tokens``. An aborted request's length and duration are chosen by
  whoever aborted it, not by the server, and would skew latency SLOs.

Per-request histograms count user requests: a request with ``n > 1`` is one observation
(its prompt once, the output tokens of all its sequences together), while
``request_success_total`` counts each sequence. They are vLLM's: besides those above,
``request_inference_time_seconds`` (first scheduling to the last token: prefill plus
decode), ``request_time_per_output_token_seconds`` (the decode time over the first
sequence's output tokens less one; 0 for a single token), ``request_params_n`` and
``request_params_max_tokens`` (the request's ``n`` and effective ``max_tokens``). Like the
other summaries they are recorded when the request finishes, aborted requests left out.

Every series carries the label ``model_name`` (the served model name) as vLLM's do, so one
Prometheus can scrape several servers and a dashboard can pick one; ``ServerMetrics``
built without a ``model_name`` (an engine without a server, in tests) leaves it off.
``inflight:cache_config_info`` (a gauge at 1, vLLM's emulated Info) carries the KV cache
configuration as labels: ``block_size``, ``num_gpu_blocks`` (vLLM's name for the KV pool
size in blocks, wherever the pool lives), ``cache_dtype``, ``enable_prefix_caching``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily

from inflight.engine.stats import EngineStats
from inflight.outputs import RequestMetrics, RequestOutput
from inflight.quantiles import percentile

QUANTILES = (0.5, 0.95, 0.99)
# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# Fallback top of the token-count buckets when the engine does not say its max_model_len.
_DEFAULT_MAX_MODEL_LEN = 131072
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


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


class _WindowCollector:
    """Exposes the windows as gauges computed at scrape time."""

    def __init__(self, windows: dict[str, SlidingWindow], labels: dict[str, str]) -> None:
        self._windows = windows
        self._labels = labels

    def collect(self):
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


class ServerMetrics:
    """The Prometheus metrics of one app, fed from the engine thread.

    Args:
        engine_state: an object with ``get_stats() -> EngineStats`` and ``num_waiting``
            (the ``AsyncEngine``); gauges read it at scrape time. Its ``max_model_len``,
            when it has one, tops the per-request token-count buckets.
        window_s: length of the percentile window, seconds.
        max_num_batched_tokens: upper bucket of ``inflight:iteration_tokens_total``.
        config_labels: labels of the ``inflight:engine_config_info`` metric.
        model_name: the served model name, the ``model_name`` label of every series
            (vLLM's); None leaves the label off.
        cache_config: labels of ``inflight:cache_config_info`` (vLLM's ``cache_config_info``:
            ``block_size``, ``num_gpu_blocks``, ``cache_dtype``, ``enable_prefix_caching``).
    """

    def __init__(self, engine_state, *, window_s: float = 60.0,
                 max_num_batched_tokens: int = 8192,
                 config_labels: dict[str, str] | None = None,
                 model_name: str | None = None,
                 cache_config: dict[str, str] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self._engine_state = engine_state
        self.model_name = model_name
        lab = {} if model_name is None else {"model_name": model_name}
        names = list(lab)

        def child(metric):  # the one series of ``metric`` this server writes
            return metric.labels(**lab) if lab else metric

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return child(Histogram(name, doc, names, buckets=buckets, registry=r))

        def counter(name: str, doc: str) -> Counter:
            return child(Counter(name, doc, names, registry=r))

        def gauge(name: str, doc: str, read) -> None:
            child(Gauge(name, doc, names, registry=r)).set_function(read)

        self.ttft = histogram("inflight:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", _TTFT_BUCKETS)
        self.itl = histogram("inflight:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a sequence.",
                             _ITL_BUCKETS)
        self.e2e = histogram("inflight:e2e_request_latency_seconds",
                             "Time from arrival to finish, requests not aborted.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("inflight:request_queue_time_seconds",
                                    "Time from arrival to first scheduling (WAITING phase).",
                                    _REQUEST_BUCKETS)
        self.inference_time = histogram(
            "inflight:request_inference_time_seconds",
            "Time from first scheduling to the last token (RUNNING phase: prefill + decode).",
            _REQUEST_BUCKETS)
        self.prefill_time = histogram("inflight:request_prefill_time_seconds",
                                      "Time from first scheduling to the first token.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("inflight:request_decode_time_seconds",
                                     "Time from the first to the last token.", _REQUEST_BUCKETS)
        self.request_tpot = histogram(
            "inflight:request_time_per_output_token_seconds",
            "Per request: decode time over its output tokens less one (first sequence).",
            _ITL_BUCKETS)
        max_len = getattr(engine_state, "max_model_len", None) or _DEFAULT_MAX_MODEL_LEN
        token_buckets = token_count_buckets(max_len)
        self.request_prompt_tokens = histogram(
            "inflight:request_prompt_tokens", "Prompt tokens per request, requests not aborted.",
            token_buckets)
        self.request_generation_tokens = histogram(
            "inflight:request_generation_tokens",
            "Output tokens per request (all its sequences), requests not aborted.",
            token_buckets)
        self.request_params_n = histogram("inflight:request_params_n",
                                          "The n request parameter.", _REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "inflight:request_params_max_tokens",
            "The max_tokens request parameter (as the engine applied it: defaulted to what "
            "the context leaves when the request gave none).", token_buckets)
        buckets = [1]
        while buckets[-1] < max_num_batched_tokens:
            buckets.append(buckets[-1] * 2)
        self.iteration_tokens = histogram("inflight:iteration_tokens_total",
                                          "Tokens computed (prompt) and sampled per engine step.",
                                          buckets)
        gauge("inflight:num_requests_running", "Sequences running in the engine.",
              lambda: engine_state.get_stats().num_running)
        gauge("inflight:num_requests_waiting", "Sequences waiting for admission.",
              lambda: engine_state.num_waiting)
        gauge("inflight:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
              lambda: engine_state.get_stats().kv_cache_usage)
        self.prompt_tokens = counter("inflight:prompt_tokens",
                                     "Prompt tokens of requests that got a first token.")
        self.generation_tokens = counter("inflight:generation_tokens", "Output tokens sampled.")
        self.preemptions = counter("inflight:num_preemptions", "Preemptions.")
        self.prefix_cache_queries = counter(
            "inflight:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
            "(first admissions; readmissions after preemption are not counted).")
        self.prefix_cache_hits = counter(
            "inflight:prefix_cache_hits", "Prompt tokens found in the prefix cache "
            "(first admissions; readmissions after preemption are not counted).")
        self.recomputed_tokens = counter(
            "inflight:num_recomputed_tokens", "Tokens computed again after preemption "
            "(those a preempted request had computed, less what the prefix cache gave back).")
        self._request_success = Counter(
            "inflight:request_success", "Finished sequences, by finish reason "
            "(stop, length, abort; error when the engine failed the request).",
            ["finished_reason", *names], registry=r)
        self.requests_shed = counter(
            "inflight:requests_shed", "Requests rejected by load shedding (--overload-ttft, --max-queue-time, "
            "the slo policy) with a 503; their sequences also count as finished_reason abort.")
        if config_labels:
            child(Info("inflight:engine_config", "Engine settings.", names,
                       registry=r)).info(config_labels)
        if cache_config:
            # vLLM emulates an Info with a gauge at 1: same series name, type gauge.
            info = {**cache_config, **lab}
            Gauge("inflight:cache_config_info", "KV cache configuration (vLLM's CacheConfig).",
                  list(info), registry=r).labels(**info).set(1)
        self.windows = {"time_to_first_token_seconds": SlidingWindow(window_s),
                        "inter_token_latency_seconds": SlidingWindow(window_s),
                        "e2e_request_latency_seconds": SlidingWindow(window_s)}
        r.register(_WindowCollector(self.windows, lab))
        self.window_s = window_s
        # Counter deltas start from now: an engine reused by a second app keeps its history.
        self._last_stats: EngineStats = engine_state.get_stats()
        self._first_token_seen: set[str] = set()
        # Output tokens by user request and sequence index, until the request finishes.
        self._num_output_tokens: dict[str, dict[int, int]] = {}
        self._last_emit: dict[tuple[str, int], float] = {}
        # (n, max_tokens) of requests the server queued (``expect``), until they finish.
        self._params: dict[str, tuple[int, int | None]] = {}
        # Plain mirrors of the two token counters for /stats (ints: atomic to read).
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # --- the event loop: what the engine's outputs do not say ------------------------------
    def expect(self, request_id: str, n: int, max_tokens: int | None) -> None:
        """Note the ``n`` and ``max_tokens`` of a request about to be queued, for
        ``request_params_n`` and ``request_params_max_tokens`` when it finishes (the engine's
        outputs do not carry its sampling parameters). Call before ``add_request``; the entry
        goes when the request's final output is seen, or with ``forget``."""
        self._params[request_id] = (n, max_tokens)

    def forget(self, request_id: str) -> None:
        """Drop what ``expect`` noted for a request that failed or was never queued; a
        failed request records no per-request summary, so this never loses one."""
        self._params.pop(request_id, None)

    # --- the engine-thread listener -------------------------------------------------------
    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None:
        """``AsyncEngine`` listener: update counters and histograms from one step."""
        last = self._last_stats
        if stats.num_preemptions > last.num_preemptions:
            self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        if stats.prefix_cache_queries > last.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        if stats.prefix_cache_hits > last.prefix_cache_hits:
            self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        if stats.num_recomputed_tokens > last.num_recomputed_tokens:
            self.recomputed_tokens.inc(stats.num_recomputed_tokens - last.num_recomputed_tokens)
        if stats.num_steps > last.num_steps:
            self.iteration_tokens.observe(stats.prompt_tokens + stats.generation_tokens
                                          - last.prompt_tokens - last.generation_tokens)
        self._last_stats = stats
        for out in outputs:
            self._observe(out, now)

    def _observe(self, out: RequestOutput, now: float) -> None:
        rid, m = out.request_id, out.metrics
        if m is not None and m.first_token_time is not None and rid not in self._first_token_seen:
            self._first_token_seen.add(rid)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self._num_prompt_tokens += len(out.prompt_token_ids)
            ttft = m.first_token_time - m.arrival_time
            self.ttft.observe(ttft)
            self.windows["time_to_first_token_seconds"].add(ttft, now)
        for c in out.outputs:
            n = len(c.token_ids)
            if n:
                per_seq = self._num_output_tokens.setdefault(rid, {})
                per_seq[c.index] = per_seq.get(c.index, 0) + n
                self.generation_tokens.inc(n)
                self._num_generation_tokens += n
                key = (rid, c.index)
                prev = self._last_emit.get(key)
                if prev is not None:
                    gap = (now - prev) / n
                    for _ in range(n):
                        self.itl.observe(gap)
                        self.windows["inter_token_latency_seconds"].add(gap, now)
                self._last_emit[key] = now
            if c.finish_reason is not None:
                self._count_finished("error" if out.error else c.finish_reason)
                self._last_emit.pop((rid, c.index), None)
        if out.finished:
            if out.shed_reason:
                self.requests_shed.inc()
            self._first_token_seen.discard(rid)
            for key in [k for k in self._last_emit if k[0] == rid]:
                del self._last_emit[key]
            per_seq = self._num_output_tokens.pop(rid, {})
            params = self._params.pop(rid, None)
            aborted = out.error or any(c.finish_reason == "abort" for c in out.outputs)
            if aborted:
                return  # per-request summaries leave aborted requests out (module docstring)
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            self.request_generation_tokens.observe(sum(per_seq.values()))
            if params is not None:
                self.request_params_n.observe(params[0])
                if params[1] is not None:
                    self.request_params_max_tokens.observe(params[1])
            if m is not None and m.finished_time is not None:
                self._observe_latencies(m, per_seq.get(0, 0), now)

    def _observe_latencies(self, m: RequestMetrics, num_first_seq_tokens: int,
                           now: float) -> None:
        assert m.finished_time is not None
        e2e = m.finished_time - m.arrival_time
        self.e2e.observe(e2e)
        self.windows["e2e_request_latency_seconds"].add(e2e, now)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            if m.last_token_time is not None:
                self.inference_time.observe(m.last_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = m.last_token_time - m.first_token_time
            self.decode_time.observe(decode)
            # vLLM's mean time per output token: the gaps after the first token.
            self.request_tpot.observe(
                decode / (num_first_seq_tokens - 1) if num_first_seq_tokens > 1 else 0.0)

    def _count_finished(self, reason: str) -> None:
        """One more finished sequence in ``inflight:request_success_total{finished_reason}``."""
        if self.model_name is None:
            self._request_success.labels(reason).inc()
        else:
            self._request_success.labels(reason, self.model_name).inc()

    # --- read side (event loop) -----------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of this app's registry."""
        return generate_latest(self.registry)

    def stats(self) -> dict:
        """``GET /stats``: window percentiles plus the current engine gauges and counters."""
        s = self._engine_state.get_stats()
        now = time.monotonic()
        return {
            "window_seconds": self.window_s,
            "time_to_first_token_seconds": self.windows["time_to_first_token_seconds"].summary(now),
            "inter_token_latency_seconds": self.windows["inter_token_latency_seconds"].summary(now),
            "e2e_request_latency_seconds": self.windows["e2e_request_latency_seconds"].summary(now),
            "num_requests_running": s.num_running,
            "num_requests_waiting": self._engine_state.num_waiting,
            "kv_cache_usage_perc": s.kv_cache_usage,
            "num_preemptions_total": s.num_preemptions,
            "prompt_tokens_total": self._num_prompt_tokens,
            "generation_tokens_total": self._num_generation_tokens,
            "num_steps": s.num_steps,
            "prefix_cache_queries_total": s.prefix_cache_queries,
            "prefix_cache_hits_total": s.prefix_cache_hits,
            "num_recomputed_tokens_total": s.num_recomputed_tokens,
        }
