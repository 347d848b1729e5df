"""vLLM's ``bench serve`` results: its result keys (``mean_ttft_ms``, ``p99_itl_ms``,
``ttfts``, ``generated_texts``, ...) computed from the request records for the saved JSON of
``bench serve``, its setup keys, its printed latency block, and its result file name."""

from __future__ import annotations

import datetime as dt
import math
import os
from typing import Any, Sequence

import numpy as np

from inflight.bench.client import RequestRecord
from inflight.bench.run_config import BenchConfig
from inflight.bench.summary import request_metrics
from inflight.bench.vllm_compat import parse_metric_percentiles, parse_percentile_metrics

BACKEND_NAMES = {"completions": "openai", "chat": "openai-chat"}  # ours -> vLLM's --backend
# vLLM's per-request lists: saved by `vllm bench serve --save-detailed`, always here.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def backend_name(endpoint: str) -> str:
    """vLLM's ``--backend`` name of our endpoint type: openai or openai-chat."""
    return BACKEND_NAMES.get(endpoint, endpoint)


def result_path(config: BenchConfig, kind: str, model: str | None, endpoint: str | None = None,
                now: dt.datetime | None = None) -> str | None:
    """Where to save the result: ``--save-result FILE``, or with ``--save-result`` alone,
    ``--result-dir`` or ``--result-filename`` vLLM's name
    ``{label}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json`` (``sweep``/``capacity``:
    ``{label}-{kind}-{date}.json``), inside ``--result-dir``. None: nothing to save."""
    out = config.output
    save, rdir, rname = out.save_result, out.result_dir, out.result_filename
    if not save and not rdir and not rname:
        return None
    if isinstance(save, str):
        name = save
    elif rname:
        name = rname
    else:
        stamp = (now or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        label = out.label or (backend_name(endpoint) if endpoint else "inflight")
        if kind == "serve":
            conc = config.load.max_concurrency
            base_model = (model or "model").rstrip("/").split("/")[-1]
            name = (f"{label}-{config.arrival.rate}qps{f'-concurrency{conc}' if conc is not None else ''}"
                    f"-{base_model}-{stamp}.json")
        else:
            name = f"{label}-{kind}-{stamp}.json"
    return os.path.join(rdir, name) if rdir else name


def vllm_header(config: BenchConfig, model: str, endpoint: str) -> dict[str, Any]:
    """vLLM's setup keys of a result (date, backend, label, model_id, tokenizer_id, num_prompts,
    request_rate, burstiness, max_concurrency) and ``--metadata``'s fields."""
    backend = backend_name(endpoint)
    rate = config.arrival.rate
    head: dict[str, Any] = {
        "date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
        "label": config.output.label, "model_id": model, "tokenizer_id": config.load.tokenizer or model,
        "num_prompts": config.dataset.num_prompts, "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": config.arrival.burstiness, "max_concurrency": config.load.max_concurrency}
    for item in config.output.metadata:
        k, _, v = item.partition("=")
        head[k.strip()] = v.strip()
    return head



def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _ms_stats(values: list[float], metric: str, percentiles: Sequence[float]) -> dict[str, float]:
    # As vLLM: an empty list counts as [0] (np.mean(x or 0)).
    a = np.asarray(values if values else [0.0], dtype=float)
    out = {f"mean_{metric}_ms": float(a.mean()) * 1000, f"median_{metric}_ms": float(np.median(a)) * 1000,
           f"std_{metric}_ms": float(a.std()) * 1000}
    for p in percentiles:
        out[f"p{_p_word(p)}_{metric}_ms"] = float(np.percentile(a, p)) * 1000
    return out


def vllm_result(records: Sequence[RequestRecord], summary: dict[str, Any], metrics: Sequence[str] | None = None,
                percentiles: Sequence[float] | None = None) -> dict[str, Any]:
    """vLLM's ``bench serve`` result keys from the run's records and our ``summary``.

    Counted requests only (warm-ups and a window's warm-up/cool-down left out), in send order.
    Totals and rates are the summary's (``duration``: first send to last end); the latency
    keys are in ms over the completed requests, as vLLM's ``calculate_metrics``: TPOT over
    requests with more than one output token, ITL pooling every gap, an empty list as 0.
    Per request: ``input_lens`` (the prompt's tokens as built; where the client did not
    count them, chat messages, the server's ``usage.prompt_tokens``), ``output_lens`` (0 when
    failed), ``ttfts`` (s; 0 without a token), ``itls`` (s, list per request),
    ``generated_texts`` and ``errors`` ("" when none).
    """
    metrics = list(metrics or parse_percentile_metrics(None))
    percentiles = list(percentiles or parse_metric_percentiles(None))
    counted = sorted((r for r in records if not r.warmup), key=lambda r: r.index)
    ms = [request_metrics(r) for r in counted if r.success]
    series = {"ttft": [m.ttft for m in ms if m.ttft is not None],
              "tpot": [m.tpot for m in ms if m.tpot is not None],
              "itl": [g for m in ms for g in m.itls],
              "e2el": [m.e2e for m in ms if m.e2e is not None]}
    out: dict[str, Any] = {
        "duration": summary["duration"], "completed": summary["completed"], "failed": summary["failed"],
        "total_input_tokens": summary["total_input_tokens"], "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"], "request_goodput": summary.get("goodput"),
        "output_throughput": summary["output_throughput"], "total_token_throughput": summary["total_token_throughput"],
        "input_lens": [r.prompt_len if r.prompt_len is not None else r.prompt_tokens or 0 for r in counted],
        "output_lens": [(r.output_tokens or 0) if r.success else 0 for r in counted],
        "ttfts": [r.chunk_times[0] - r.send_time if r.chunk_times else 0.0 for r in counted],
        "itls": [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] for r in counted],
        "generated_texts": [r.generated_text for r in counted],
        "errors": [r.error or "" for r in counted],
        "max_concurrent_requests": summary.get("peak_concurrency"),
    }
    for metric in metrics:
        out.update(_ms_stats(series[metric], metric, percentiles))
    return out


def format_vllm_block(result: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """vLLM's printed latency block (``Mean TTFT (ms):``, ``P99 TTFT (ms):``, ...) of ``result``."""
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    lines = []
    if result.get("request_goodput") is not None:
        lines.append("{:<40} {:<10.2f}".format("Request goodput (req/s):", result["request_goodput"]))
    for metric in metrics:
        short, header = headers[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", result[f"mean_{metric}_ms"]))
        lines.append("{:<40} {:<10.2f}".format(f"Median {short} (ms):", result[f"median_{metric}_ms"]))
        for p in percentiles:
            lines.append("{:<40} {:<10.2f}".format(f"P{_p_word(p)} {short} (ms):",
                                                   result[f"p{_p_word(p)}_{metric}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
