"""``vllm bench serve``'s spellings and result keys, so vLLM's benchmark scripts run as they are.

vLLM's flags (``vllm/benchmarks/serve.py`` and ``datasets.py``) are added to every ``bench``
sub-command by :func:`add_vllm_args` and folded into inflight's own settings by
:func:`resolve_vllm_args`, so a vLLM spelling and ours parse into the same configuration:

- ``--host``/``--port`` build ``--base-url`` (``http://HOST:PORT``);
- ``--backend``/``--endpoint-type`` ``openai``/``vllm`` and ``openai-chat``, and
  ``--endpoint /v1/completions`` or ``/v1/chat/completions``, pick ``--endpoint-type``;
- ``--dataset-name`` maps ``random``, ``sonnet`` and ``custom`` (a JSONL of ``{"prompt": ...}``,
  sent as chat) onto our datasets, with vLLM's default lengths for the spelling used; the
  others are refused with the reason; ``--dataset-path`` is the data file;
- ``--goodput ttft:MS tpot:MS e2el:MS`` adds per-request targets (milliseconds) to the goodput;
- ``--top-p`` ... ``--repetition-penalty`` go into the request body;
- ``--save-result`` without a file, ``--result-dir``, ``--result-filename`` and ``--label``
  name the result file as vLLM does.

:func:`vllm_result` computes vLLM's result keys (``mean_ttft_ms``, ``p99_itl_ms``, ``ttfts``,
``generated_texts``, ...) from the request records, for the saved JSON of ``bench serve``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
from typing import Sequence

import numpy as np

from inflight.bench.client import RequestRecord
from inflight.bench.summary import SLO, request_metrics

# vLLM's --dataset-name -> ours, where ours means the same thing.
DATASETS = {"random": "random", "sonnet": "sonnet", "custom": "chat"}
# The ones we lack, and what to use instead.
MISSING_DATASETS = {
    "sharegpt": "no ShareGPT loader; --dataset chat (MT-Bench first turns) or --dataset trace "
                "(Azure/Mooncake lengths) are the real-conversation mixes here",
    "burstgpt": "no BurstGPT loader; --dataset trace replays the Azure or Mooncake trace",
    "hf": "no Hugging Face dataset loader (the bench reads local files only)",
    "random-mm": "multimodal requests are not supported",
    "random-rerank": "reranking requests are not supported",
    "prefix_repetition": "no prefix-repetition dataset; --dataset random --prefix-len N shares one prefix",
    "spec_bench": "no SpecBench loader",
    "txt-slices": "no txt-slices dataset; --dataset sonnet slices a text file",
}
# vLLM's defaults (benchmarks/datasets.py) for the lengths a --dataset-name spelling leaves unset.
VLLM_LENGTHS = {"random": {"input_len": 1024, "output_len": 128, "prefix_len": 0},
                "sonnet": {"input_len": 550, "output_len": 150, "prefix_len": 200},
                "custom": {"output_len": 256}}
VLLM_NUM_PROMPTS = 1000
# Ours, for the same flags without --dataset-name.
OUR_LENGTHS = {"input_len": 256, "output_len": 128, "prefix_len": 0}
OUR_NUM_PROMPTS = 100

GOODPUT_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}  # vLLM's name -> ours
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl,e2el"  # vLLM's is ttft,tpot,itl; e2el added
DEFAULT_METRIC_PERCENTILES = "99"
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
ENDPOINTS = {"completions": "completions", "openai": "completions", "vllm": "completions",
             "chat": "chat", "openai-chat": "chat"}
BACKEND_NAMES = {"completions": "openai", "chat": "openai-chat"}  # ours -> vLLM's --backend
# vLLM's per-request lists: saved by `vllm bench serve --save-detailed`, always here.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def endpoint_type(text: str) -> str:
    """``--endpoint-type``/``--backend``: ours (completions, chat) or vLLM's (openai, vllm,
    openai-chat) -> completions or chat."""
    v = ENDPOINTS.get(text.strip().lower())
    if v is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected completions or chat (vLLM's openai, vllm, openai-chat); other "
            "vLLM backends (tgi, deepspeed-mii, embeddings, ...) are not OpenAI streaming endpoints")
    return v


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """Add vLLM's ``bench serve`` spellings that have no inflight alias to parser ``p``."""
    g = p.add_argument_group("vLLM bench serve spellings (docs/bench.md, \"vLLM's flags\")")
    g.add_argument("--host", default=None, help="with --port: --base-url http://HOST:PORT (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="with --host: the server's port (default 8000)")
    g.add_argument("--endpoint", default=None, metavar="PATH",
                   help="/v1/completions or /v1/chat/completions: sets --endpoint-type")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name sent (over --model, as vLLM)")
    g.add_argument("--dataset-name", default=None, metavar="NAME",
                   help="vLLM's dataset name: random, sonnet, custom (a JSONL of prompts, sent as chat); "
                        "the lengths it leaves unset take vLLM's defaults")
    g.add_argument("--dataset-path", default=None, metavar="PATH",
                   help="the data file: sonnet text, custom/chat JSONL, or trace")
    g.add_argument("--custom-output-len", type=int, default=None, help="custom: max_tokens (vLLM's default 256)")
    g.add_argument("--skip-chat-template", action="store_true",
                   help="custom: send the raw prompt to /v1/completions instead of chat")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="per-request targets in ms for goodput, e.g. ttft:500 tpot:50 e2el:5000 "
                        "(same as --slo ttft=500ms,tpot=50ms,e2e=5000ms)")
    g.add_argument("--percentile-metrics", default=None, metavar="LIST",
                   help=f"metrics of the saved vLLM keys and the printed block: {','.join(PERCENTILE_METRICS)} "
                        f"(default {DEFAULT_PERCENTILE_METRICS})")
    g.add_argument("--metric-percentiles", default=None, metavar="LIST",
                   help=f"percentiles of those metrics, e.g. 50,90,99 (default {DEFAULT_METRIC_PERCENTILES})")
    g.add_argument("--result-dir", default=None, metavar="DIR", help="folder of the result file (implies saving)")
    g.add_argument("--result-filename", default=None, metavar="NAME",
                   help="name of the result file (implies saving; default vLLM's "
                        "{label}-{rate}qps[-concurrencyN]-{model}-{date}.json)")
    g.add_argument("--label", default=None, help="prefix of the default result file name (default the backend)")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None,
                   help="fields added to the result JSON")
    g.add_argument("--save-detailed", action="store_true",
                   help="accepted for vLLM; the per-request lists are always saved")
    for flag in SAMPLING_FLAGS:
        g.add_argument("--" + flag.replace("_", "-"), type=int if flag == "top_k" else float, default=None,
                       help=argparse.SUPPRESS)


# ---------------------------------------------------------------- resolving

def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """vLLM's ``--goodput`` pairs ``ttft:500 tpot:50`` (ms) -> our per-request targets in s
    (``{"ttft": 0.5, "tpot": 0.05}``); ValueError names a bad pair."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        try:
            ms = float(val)
        except ValueError:
            ms = math.nan
        if not sep or not math.isfinite(ms):
            raise ValueError(f"--goodput {item!r}: expected KEY:VALUE with the value in milliseconds, e.g. ttft:500")
        if key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: the metric is one of {', '.join(GOODPUT_METRICS)} "
                             "(per-request ITL targets: --slo itl=...)")
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the target must be >= 0 ms")
        out[GOODPUT_METRICS[key]] = ms / 1000.0
    return out


def parse_percentile_metrics(text: str | None) -> list[str]:
    """``"ttft,itl"`` -> ``["ttft", "itl"]`` (vLLM's names; ``e2e`` taken for ``e2el``)."""
    names = [x.strip().lower() for x in (text or DEFAULT_PERCENTILE_METRICS).split(",") if x.strip()]
    names = ["e2el" if n == "e2e" else n for n in names]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: expected some of {','.join(PERCENTILE_METRICS)}")
    return list(dict.fromkeys(names))


def parse_metric_percentiles(text: str | None) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``, each in [0, 100]."""
    try:
        ps = [float(x) for x in (text or DEFAULT_METRIC_PERCENTILES).split(",") if x.strip()]
    except ValueError:
        ps = []
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {text!r}: expected comma-separated numbers in 0..100, e.g. 50,90,99")
    return list(dict.fromkeys(ps))


def _endpoint_from_path(path: str) -> str:
    p = "/" + path.strip().lstrip("/")
    if p in ("/v1/chat/completions",):
        return "chat"
    if p in ("/v1/completions",):
        return "completions"
    raise ValueError(f"--endpoint {path!r}: expected /v1/completions or /v1/chat/completions (a path prefix "
                     "belongs in --base-url)")


def _host_url(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"http://{host}:{port}"


def resolve_vllm_args(args: argparse.Namespace) -> None:
    """Fold vLLM's spellings in ``args`` into inflight's own, in place (idempotent).

    After it, ``base_url``, ``endpoint_type``, ``model``, ``dataset``, ``data files``, the
    lengths, ``num_prompts``, ``arrival``, ``extra_body`` and ``save_result`` hold what the
    run uses, whichever spelling set them. ValueError on contradicting flags.
    """
    if getattr(args, "_vllm_resolved", False):
        return
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731

    # server
    if g("base_url") is None:
        args.base_url = _host_url(g("host") or "127.0.0.1", g("port") or 8000)
    elif g("host") is not None or g("port") is not None:
        raise ValueError("give --base-url or --host/--port, not both")
    if g("endpoint") is not None:
        from_path = _endpoint_from_path(args.endpoint)
        if g("endpoint_type") is not None and args.endpoint_type != from_path:
            raise ValueError(f"--endpoint {args.endpoint} contradicts --endpoint-type/--backend "
                             f"({args.endpoint_type})")
        args.endpoint_type = from_path
    if g("served_model_name"):
        args.model = args.served_model_name

    # dataset
    name = g("dataset_name")
    vllm_name = None
    if name is not None:
        key = name.strip().lower()
        if key in MISSING_DATASETS:
            raise ValueError(f"--dataset-name {name}: {MISSING_DATASETS[key]}")
        from inflight.bench.datasets import BUILDERS
        ours = DATASETS.get(key) or (key if key in BUILDERS else None)
        if ours is None:
            raise ValueError(f"--dataset-name {name!r}: unknown; vLLM's names mapped here: "
                             f"{', '.join(DATASETS)}; ours: {', '.join(BUILDERS)}")
        if g("dataset") is not None and args.dataset != ours:
            raise ValueError(f"--dataset-name {name} (our {ours}) contradicts --dataset {args.dataset}")
        args.dataset = ours
        vllm_name = key if key in DATASETS else None
    elif g("dataset") is None:
        args.dataset = "random"
    lengths = VLLM_LENGTHS.get(vllm_name or "", {}) if vllm_name else {}
    if vllm_name == "custom" and g("custom_output_len") is not None:
        if g("output_len") is not None and args.output_len != args.custom_output_len:
            raise ValueError("--custom-output-len contradicts --output-len")
        args.output_len = args.custom_output_len
    rpl = g("random_prefix_len")
    if rpl is not None:
        if g("prefix_len") is not None and args.prefix_len != rpl:
            raise ValueError("--random-prefix-len contradicts --prefix-len")
        args.prefix_len = rpl
    for k, ours_default in OUR_LENGTHS.items():
        if g(k) is None:
            setattr(args, k, lengths.get(k, ours_default))
    if rpl is not None and args.dataset == "random":
        # vLLM's random prompt is the prefix plus --random-input-len tokens; ours counts the
        # prefix inside --input-len.
        args.input_len = args.input_len + rpl
    if g("num_prompts") is None:
        args.num_prompts = VLLM_NUM_PROMPTS if vllm_name else OUR_NUM_PROMPTS
    path = g("dataset_path")
    if path is not None:
        if args.dataset == "random":
            raise ValueError("--dataset-path with the random dataset: name the dataset it holds "
                             "(--dataset-name sonnet or custom, or --dataset trace/chat)")
        field = {"sonnet": "sonnet_file", "chat": "chat_file", "trace": "trace_file"}[args.dataset]
        if field == "trace_file" and g("trace_file") not in (None, path):
            raise ValueError("--dataset-path and --trace-file name different files")
        setattr(args, field, path)
    if vllm_name == "custom" and g("skip_chat_template"):
        if g("endpoint_type") == "chat":
            raise ValueError("--skip-chat-template sends raw prompts to /v1/completions; it contradicts chat")
        args.endpoint_type = "completions"

    # arrivals: vLLM's --burstiness alone means gamma gaps
    if g("arrival") is None:
        args.arrival = "gamma" if g("burstiness", 1.0) != 1.0 else "poisson"

    # request body
    sampling = {k: g(k) for k in SAMPLING_FLAGS if g(k) is not None}
    if sampling:
        args.extra_body = {**sampling, **(g("extra_body") or {})}

    # output
    parse_goodput(g("goodput"))
    parse_percentile_metrics(g("percentile_metrics"))
    parse_metric_percentiles(g("metric_percentiles"))
    if isinstance(g("save_result"), str) and g("result_filename"):
        raise ValueError("--save-result FILE and --result-filename both name the result file: give one")
    for item in g("metadata") or []:
        if "=" not in item:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
    args._vllm_resolved = True


def merge_goodput(slo: SLO, args: argparse.Namespace) -> SLO:
    """``slo`` with ``--goodput``'s per-request targets added; ValueError where ``--slo`` sets
    the same metric to another value."""
    for metric, target in parse_goodput(getattr(args, "goodput", None)).items():
        if metric in slo.per_request and not math.isclose(slo.per_request[metric], target):
            raise ValueError(f"--goodput and --slo both set a per-request {metric} target, differently")
        slo.per_request[metric] = target
    return slo


def backend_name(endpoint: str) -> str:
    """vLLM's ``--backend`` name of our endpoint type: openai or openai-chat."""
    return BACKEND_NAMES.get(endpoint, endpoint)


def result_path(args: argparse.Namespace, kind: str, model: str | None, endpoint: str | None = None,
                now: dt.datetime | None = None) -> str | None:
    """Where to save the result: ``--save-result FILE``, or with ``--save-result`` alone,
    ``--result-dir`` or ``--result-filename`` vLLM's name
    ``{label}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json`` (``sweep``/``capacity``:
    ``{label}-{kind}-{date}.json``), inside ``--result-dir``. None: nothing to save."""
    save = getattr(args, "save_result", None)
    rdir, rname = getattr(args, "result_dir", None), getattr(args, "result_filename", None)
    if not save and not rdir and not rname:
        return None
    if isinstance(save, str):
        name = save
    elif rname:
        name = rname
    else:
        stamp = (now or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        label = getattr(args, "label", None) or (backend_name(endpoint) if endpoint else "inflight")
        if kind == "serve":
            conc = getattr(args, "max_concurrency", None)
            base_model = (model or "model").rstrip("/").split("/")[-1]
            name = (f"{label}-{args.request_rate}qps{f'-concurrency{conc}' if conc is not None else ''}"
                    f"-{base_model}-{stamp}.json")
        else:
            name = f"{label}-{kind}-{stamp}.json"
    return os.path.join(rdir, name) if rdir else name


# ---------------------------------------------------------------- vLLM's result keys

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


def vllm_result(records: Sequence[RequestRecord], summary: dict, metrics: Sequence[str] | None = None,
                percentiles: Sequence[float] | None = None) -> dict:
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
    out: dict = {
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


def vllm_header(args: argparse.Namespace, model: str, endpoint: str) -> dict:
    """vLLM's setup keys of a result (date, backend, label, model_id, tokenizer_id, num_prompts,
    request_rate, burstiness, max_concurrency) and ``--metadata``'s fields."""
    backend = backend_name(endpoint)
    head = {"date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
            "label": getattr(args, "label", None), "model_id": model,
            "tokenizer_id": getattr(args, "tokenizer", None) or model, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    for item in getattr(args, "metadata", None) or []:
        k, _, v = item.partition("=")
        head[k.strip()] = v.strip()
    return head


def format_vllm_block(result: dict, metrics: Sequence[str], percentiles: Sequence[float]) -> str:
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
