"""Prometheus metrics and sliding-window latency percentiles of one server.

Names are vLLM's with the prefix ``inflight:`` (https://docs.vllm.ai/en/latest/design/metrics.html).
Each app gets its own ``CollectorRegistry``, so several servers in one process (tests) do
not collide. Request and token metrics are fed by ``ServerMetrics.on_step``, an
``AsyncEngine`` step listener, so they see every request, including ones whose client left.

Histograms approximate percentiles only to their bucket bounds; operators set SLOs on p95,
so the p50/p95/p99 of TTFT, ITL and E2E over the last ``window_s`` seconds are also exposed
exactly, as ``GET /stats`` JSON and as the gauges ``inflight:<name>_window{quantile=...}``.
All durations are in seconds.

Aborted requests, one rule for every series: **an aborted request is a finished request
whose finish is its abort, observed for what it reached.** A sequence that ends with
``abort`` (its client left, the server aborted it or shut down) or ``error`` (the engine
failed it) counts once in ``request_success_total`` under that reason, as vLLM counts
finished requests by finish reason. Every other series treats it as any finished request,
with the tokens and times it had reached when it ended:

- Event series, recorded when the event happens: ``prompt_tokens_total`` (a prompt counts
  once, when its prefill completes, at its first token), ``generation_tokens_total`` (every
  token sampled into an output), TTFT and ITL (histograms and windows),
  ``iteration_tokens_total``, preemptions, prefix-cache and recomputed-token counters.
- Per-request series, recorded when the request finishes, aborted or not:
  ``request_prompt_tokens`` observes the prompt tokens ``prompt_tokens_total`` counted for
  it (0 if its prefill never completed), ``request_generation_tokens`` the tokens
  ``generation_tokens_total`` counted: each histogram's ``_sum`` equals its counter once no
  request is in flight. The latencies (e2e and its window, queue, prefill, inference,
  decode) end at the abort; a stage never reached (scheduling, a first token) is not
  observed. Leaving aborts out would hide the requests a slow server made give up.
- A request shed (503 before it was scheduled) was refused, not served: it counts in
  ``requests_shed_total`` and ``request_success_total{finished_reason="abort"}`` only.

Per-request histograms count user requests: a request with ``n > 1`` is one observation
(its prompt once, the output tokens of all its sequences together), while
``request_success_total`` counts each sequence. Also vLLM's: ``request_params_n``,
``request_params_max_tokens`` (as the engine applied them) and
``request_time_per_output_token_seconds`` (the first sequence's decode time over its
tokens less one; only with >= 2 output tokens: one token has no interval, and vLLM and
SGLang record none).

Every series carries the label ``model_name`` (the served model name) as vLLM's do, so one
Prometheus can scrape several servers and a dashboard can pick one; ``ServerMetrics``
built without a ``model_name`` (an engine without a server, in tests) leaves it off.
``inflight:cache_config_info`` (a gauge at 1, vLLM's Info) has the KV cache's ``block_size``,
``num_gpu_blocks`` (the pool in blocks, vLLM's name), ``cache_dtype``, ``enable_prefix_caching``.
Speculative decoding adds ``inflight:spec_decode_*`` (``spec_metrics.py``), absent when off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from inflight.engine.engine_client import EngineClient
from inflight.engine.stats import EngineStats, spec_decode_summary
from inflight.outputs import RequestMetrics, RequestOutput
from inflight.server.metric_windows import SlidingWindow, WindowCollector, token_count_buckets
from inflight.server.spec_metrics import SpecDecodeSeries

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


class EngineState(Protocol):
    """What the gauges read at scrape time (an ``EngineClient`` has it)."""

    @property
    def num_waiting(self) -> int: ...

    def get_stats(self) -> EngineStats: ...


def config_labels(client: EngineClient, model_name: str) -> dict[str, str]:
    """The labels of ``inflight:engine_config_info``."""
    cfg = client.config
    return {"model": model_name, "block_size": str(cfg.block_size),
            "num_kv_blocks": str(client.num_kv_blocks),
            "max_num_seqs": str(cfg.max_num_seqs),
            "max_num_batched_tokens": str(cfg.max_num_batched_tokens),
            "max_model_len": str(client.max_model_len), "batching_policy": cfg.batching_policy,
            "enable_chunked_prefill": str(cfg.enable_chunked_prefill).lower()}


def cache_config_labels(client: EngineClient) -> dict[str, str]:
    """The labels of ``inflight:cache_config_info``, vLLM's ``cache_config_info`` names.

    ``num_gpu_blocks`` is the KV pool in blocks wherever it lives (vLLM's name, which
    dashboards and benchmark tools read); ``cache_dtype`` the pool's element type where the
    runner has KV tensors, else the ``--kv-cache-dtype`` setting.
    """
    cfg = client.config
    return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(client.num_kv_blocks),
            "cache_dtype": client.kv_cache_dtype,
            "enable_prefix_caching": str(cfg.enable_prefix_caching).lower()}


class _Series:
    """Makes the metrics of one registry, each reduced to the one series (label values)
    this server writes."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels
        self.names = list(labels)

    def child(self, metric: Any) -> Any:
        return metric.labels(**self.labels) if self.labels else metric

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        h: Histogram = self.child(Histogram(name, doc, self.names, buckets=buckets,
                                            registry=self.registry))
        return h

    def counter(self, name: str, doc: str) -> Counter:
        c: Counter = self.child(Counter(name, doc, self.names, registry=self.registry))
        return c

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self.child(Gauge(name, doc, self.names, registry=self.registry)).set_function(read)


class ServerMetrics:
    """The Prometheus metrics of one app, fed from the engine thread.

    Args:
        engine_state: an object with ``get_stats() -> EngineStats`` and ``num_waiting``
            (the ``EngineClient``); gauges read it at scrape time. Its ``max_model_len``,
            when it has one, tops the per-request token-count buckets.
        window_s: length of the percentile window, seconds.
        max_num_batched_tokens: upper bucket of ``inflight:iteration_tokens_total``.
        config_labels: labels of the ``inflight:engine_config_info`` metric.
        model_name: the served model name, the ``model_name`` label of every series
            (vLLM's); None leaves the label off.
        cache_config: labels of ``inflight:cache_config_info`` (vLLM's ``cache_config_info``:
            ``block_size``, ``num_gpu_blocks``, ``cache_dtype``, ``enable_prefix_caching``).
        num_speculative_tokens: k when the server speculates (``spec_metrics.py``), else None.
    """

    def __init__(self, engine_state: EngineState, *, window_s: float = 60.0,
                 max_num_batched_tokens: int = 8192,
                 config_labels: dict[str, str] | None = None,
                 model_name: str | None = None,
                 cache_config: dict[str, str] | None = None,
                 num_speculative_tokens: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self._engine_state = engine_state
        self.model_name = model_name
        lab = {} if model_name is None else {"model_name": model_name}
        series = _Series(self.registry, lab)
        self._add_latency_series(series)
        max_len = getattr(engine_state, "max_model_len", None) or _DEFAULT_MAX_MODEL_LEN
        self._add_token_series(series, token_count_buckets(max_len), max_num_batched_tokens)
        self._add_engine_series(series, engine_state)
        self._add_info(series, config_labels, cache_config)
        self.spec_decode = SpecDecodeSeries.when_on(self.registry, lab, num_speculative_tokens)
        self.windows = {name: SlidingWindow(window_s) for name in (
            "time_to_first_token_seconds", "inter_token_latency_seconds",
            "e2e_request_latency_seconds")}
        self.registry.register(WindowCollector(self.windows, lab))
        self.window_s = window_s
        # Counter deltas start from now: an engine reused by a second app keeps its history.
        self._last_stats: EngineStats = engine_state.get_stats()
        self._first_token_seen: set[str] = set()
        # Output tokens by user request and sequence index, until the request finishes.
        self._num_output_tokens: dict[str, dict[int, int]] = {}
        self._last_emit: dict[tuple[str, int], float] = {}
        # Plain mirrors of the two token counters for /stats (ints: atomic to read).
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    @classmethod
    def for_client(cls, client: EngineClient, model_name: str,
                   window_s: float = 60.0) -> "ServerMetrics":
        """The metrics of a server (or replica) of ``client``, labelled with its settings."""
        spec = client.config.speculative_config
        return cls(client, window_s=window_s,
                   max_num_batched_tokens=client.config.max_num_batched_tokens,
                   config_labels=config_labels(client, model_name), model_name=model_name,
                   cache_config=cache_config_labels(client),
                   num_speculative_tokens=None if spec is None else spec.num_speculative_tokens)

    def _add_latency_series(self, s: _Series) -> None:
        self.ttft = s.histogram("inflight:time_to_first_token_seconds",
                                "Time from arrival to the first output token.", _TTFT_BUCKETS)
        self.itl = s.histogram("inflight:inter_token_latency_seconds",
                               "Time between consecutive output tokens of a sequence.",
                               _ITL_BUCKETS)
        self.e2e = s.histogram("inflight:e2e_request_latency_seconds",
                               "Time from arrival to finish (an aborted request: to its abort).",
                               _REQUEST_BUCKETS)
        self.queue_time = s.histogram("inflight:request_queue_time_seconds",
                                      "Time from arrival to first scheduling (WAITING phase).",
                                      _REQUEST_BUCKETS)
        self.inference_time = s.histogram(
            "inflight:request_inference_time_seconds",
            "Time from first scheduling to the last token (RUNNING phase: prefill + decode).",
            _REQUEST_BUCKETS)
        self.prefill_time = s.histogram("inflight:request_prefill_time_seconds",
                                        "Time from first scheduling to the first token.",
                                        _REQUEST_BUCKETS)
        self.decode_time = s.histogram("inflight:request_decode_time_seconds",
                                       "Time from the first to the last token.", _REQUEST_BUCKETS)
        self.request_tpot = s.histogram(
            "inflight:request_time_per_output_token_seconds",
            "Per request with >= 2 output tokens: decode time over its tokens less one.",
            _ITL_BUCKETS)

    def _add_token_series(self, s: _Series, token_buckets: list[int],
                          max_num_batched_tokens: int) -> None:
        self.request_prompt_tokens = s.histogram(
            "inflight:request_prompt_tokens",
            "Prompt tokens per request, as prompt_tokens counted them (0 unless prefilled).",
            token_buckets)
        self.request_generation_tokens = s.histogram(
            "inflight:request_generation_tokens",
            "Output tokens per request (all its sequences), aborted ones included.",
            token_buckets)
        self.request_params_n = s.histogram("inflight:request_params_n",
                                            "The n request parameter.", _REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = s.histogram(
            "inflight:request_params_max_tokens",
            "The max_tokens request parameter (as the engine applied it: defaulted to what "
            "the context leaves when the request gave none).", token_buckets)
        buckets = [1]
        while buckets[-1] < max_num_batched_tokens:
            buckets.append(buckets[-1] * 2)
        self.iteration_tokens = s.histogram("inflight:iteration_tokens_total",
                                            "Tokens computed (prompt) and sampled per engine step.",
                                            buckets)

    def _add_engine_series(self, s: _Series, engine_state: EngineState) -> None:
        s.gauge("inflight:num_requests_running", "Sequences running in the engine.",
                lambda: engine_state.get_stats().num_running)
        s.gauge("inflight:num_requests_waiting", "Sequences waiting for admission.",
                lambda: engine_state.num_waiting)
        s.gauge("inflight:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                lambda: engine_state.get_stats().kv_cache_usage)
        self.prompt_tokens = s.counter("inflight:prompt_tokens",
                                       "Prompt tokens of requests that got a first token.")
        self.generation_tokens = s.counter("inflight:generation_tokens", "Output tokens sampled.")
        self.preemptions = s.counter("inflight:num_preemptions", "Preemptions.")
        self.prefix_cache_queries = s.counter(
            "inflight:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
            "(first admissions; readmissions after preemption are not counted).")
        self.prefix_cache_hits = s.counter(
            "inflight:prefix_cache_hits", "Prompt tokens found in the prefix cache "
            "(first admissions; readmissions after preemption are not counted).")
        self.recomputed_tokens = s.counter(
            "inflight:num_recomputed_tokens", "Tokens computed again after preemption "
            "(those a preempted request had computed, less what the prefix cache gave back).")
        self._request_success = Counter(
            "inflight:request_success", "Finished sequences, by finish reason "
            "(stop, length, abort; error when the engine failed the request).",
            ["finished_reason", *s.names], registry=s.registry)
        self.requests_shed = s.counter(
            "inflight:requests_shed", "Requests rejected by load shedding (--overload-ttft, --max-queue-time, "
            "the slo policy) with a 503; their sequences also count as finished_reason abort.")

    @staticmethod
    def _add_info(s: _Series, config_labels: dict[str, str] | None,
                  cache_config: dict[str, str] | None) -> None:
        if config_labels:
            s.child(Info("inflight:engine_config", "Engine settings.", s.names,
                         registry=s.registry)).info(config_labels)
        if cache_config:
            # vLLM emulates an Info with a gauge at 1: same series name, type gauge.
            info = {**cache_config, **s.labels}
            Gauge("inflight:cache_config_info", "KV cache configuration (vLLM's CacheConfig).",
                  list(info), registry=s.registry).labels(**info).set(1)

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
        if self.spec_decode is not None:
            self.spec_decode.on_step(stats, last)
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
            prefilled = rid in self._first_token_seen
            self._first_token_seen.discard(rid)
            for key in [k for k in self._last_emit if k[0] == rid]:
                del self._last_emit[key]
            per_seq = self._num_output_tokens.pop(rid, {})
            if out.shed_reason:
                self.requests_shed.inc()
                return  # refused, not served (module docstring)
            # What the counters counted for it, aborted or not: the sums agree.
            self.request_prompt_tokens.observe(len(out.prompt_token_ids) if prefilled else 0)
            self.request_generation_tokens.observe(sum(per_seq.values()))
            if m is not None and m.n is not None:
                self.request_params_n.observe(m.n)
                if m.max_tokens is not None:
                    self.request_params_max_tokens.observe(m.max_tokens)
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
            if num_first_seq_tokens > 1:  # the mean gap after the first token: needs a gap
                self.request_tpot.observe(decode / (num_first_seq_tokens - 1))

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

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: window percentiles plus the current engine gauges and counters,
        and ``spec_decode`` (``spec_decode_summary``) when the server speculates."""
        s = self._engine_state.get_stats()
        now = time.monotonic()
        spec = {} if self.spec_decode is None else {"spec_decode": spec_decode_summary(s)}
        return {
            "window_seconds": self.window_s,
            **{name: window.summary(now) for name, window in self.windows.items()},
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
            **spec,
        }
