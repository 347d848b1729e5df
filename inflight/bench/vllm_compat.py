"""``vllm bench serve``'s spellings, so vLLM's benchmark scripts run as they are.

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
- ``--lora-modules`` spreads the requests over LoRA adapters (``lora_modules``; ``NAME=PATH``, the
  server's form, also loads them into a server bench starts);
- ``--save-result`` without a file, ``--result-dir``, ``--result-filename`` and ``--label``
  name the result file as vLLM does (``vllm_result``, which also computes vLLM's result keys).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from inflight.bench.datasets import BUILDERS
from inflight.bench.summary import SLO

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
# Which flag --dataset-path sets, per dataset.
DATA_FILE_FLAGS = {"sonnet": "sonnet_file", "chat": "chat_file", "trace": "trace_file"}


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
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME[=PATH]",
                   help="LoRA adapters: each request names one, chosen at random (seeded by --seed), as its "
                        "model; NAME=PATH also loads them into the server --serve-cmd starts (--enable-lora "
                        "--lora-modules NAME=PATH ... --max-loras N); bare names for a server already serving them")
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

@dataclass(frozen=True)
class SpelledFlags:
    """The flags as given, in either spelling (None: not given): what
    :func:`resolve_vllm_args` folds into one setting each."""

    base_url: str | None = None
    host: str | None = None
    port: int | None = None
    endpoint: str | None = None
    endpoint_type: str | None = None
    served_model_name: str | None = None
    model: str | None = None
    dataset_name: str | None = None
    dataset: str | None = None
    custom_output_len: int | None = None
    skip_chat_template: bool = False
    input_len: int | None = None
    output_len: int | None = None
    prefix_len: int | None = None
    random_prefix_len: int | None = None
    num_prompts: int | None = None
    dataset_path: str | None = None
    trace_file: str | None = None
    chat_file: str = "mt_bench"
    arrival: str | None = None
    burstiness: float = 1.0
    sampling: dict[str, float] = field(default_factory=dict)  # --top-p ...: the ones given
    extra_body: dict[str, Any] = field(default_factory=dict)
    goodput: Sequence[str] | None = None
    percentile_metrics: str | None = None
    metric_percentiles: str | None = None
    save_result: str | bool | None = None
    result_filename: str | None = None
    metadata: Sequence[str] | None = None


@dataclass(frozen=True)
class Resolved:
    """What the run uses, whichever spelling set it (names as the flags': ``--base-url`` ...)."""

    base_url: str
    endpoint_type: str | None
    model: str | None
    dataset: str
    input_len: int
    output_len: int
    prefix_len: int
    num_prompts: int
    trace_file: str | None
    chat_file: str
    sonnet_file: str | None
    arrival: str
    extra_body: dict[str, Any]


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


def resolve_vllm_args(f: SpelledFlags) -> Resolved:
    """Fold vLLM's spellings into inflight's own: the ``base_url``, ``endpoint_type``,
    ``model``, ``dataset``, data files, lengths, ``num_prompts``, ``arrival`` and
    ``extra_body`` the run uses, whichever spelling set them. ValueError on flags that
    contradict (or on a bad ``--goodput``, ``--percentile-metrics``, ``--metadata`` ...)."""
    base_url, endpoint = _server(f)
    dataset, vllm_name = _dataset(f)
    lengths = _lengths(f, dataset, vllm_name)
    files = _data_file(f, dataset)
    if vllm_name == "custom" and f.skip_chat_template:
        if endpoint == "chat":
            raise ValueError("--skip-chat-template sends raw prompts to /v1/completions; it contradicts chat")
        endpoint = "completions"
    # vLLM's --burstiness alone means gamma gaps
    arrival = f.arrival or ("gamma" if f.burstiness != 1.0 else "poisson")
    extra_body = {**f.sampling, **f.extra_body} if f.sampling else f.extra_body
    _check_output(f)
    return Resolved(base_url=base_url, endpoint_type=endpoint,
                    model=f.served_model_name if f.served_model_name else f.model, dataset=dataset,
                    input_len=lengths["input_len"], output_len=lengths["output_len"],
                    prefix_len=lengths["prefix_len"],
                    num_prompts=f.num_prompts if f.num_prompts is not None
                    else VLLM_NUM_PROMPTS if vllm_name else OUR_NUM_PROMPTS,
                    trace_file=files.trace_file, chat_file=files.chat_file, sonnet_file=files.sonnet_file,
                    arrival=arrival, extra_body=extra_body)


def _server(f: SpelledFlags) -> tuple[str, str | None]:
    """(base URL, endpoint type) from --base-url or --host/--port, --endpoint-type or --endpoint."""
    if f.base_url is None:
        base_url = _host_url(f.host or "127.0.0.1", f.port or 8000)
    elif f.host is not None or f.port is not None:
        raise ValueError("give --base-url or --host/--port, not both")
    else:
        base_url = f.base_url
    endpoint = f.endpoint_type
    if f.endpoint is not None:
        from_path = _endpoint_from_path(f.endpoint)
        if f.endpoint_type is not None and f.endpoint_type != from_path:
            raise ValueError(f"--endpoint {f.endpoint} contradicts --endpoint-type/--backend "
                             f"({f.endpoint_type})")
        endpoint = from_path
    return base_url, endpoint


def _dataset(f: SpelledFlags) -> tuple[str, str | None]:
    """(our dataset, vLLM's name where --dataset-name gave one of ours)."""
    if f.dataset_name is None:
        return f.dataset or "random", None
    key = f.dataset_name.strip().lower()
    if key in MISSING_DATASETS:
        raise ValueError(f"--dataset-name {f.dataset_name}: {MISSING_DATASETS[key]}")
    ours = DATASETS.get(key) or (key if key in BUILDERS else None)
    if ours is None:
        raise ValueError(f"--dataset-name {f.dataset_name!r}: unknown; vLLM's names mapped here: "
                         f"{', '.join(DATASETS)}; ours: {', '.join(BUILDERS)}")
    if f.dataset is not None and f.dataset != ours:
        raise ValueError(f"--dataset-name {f.dataset_name} (our {ours}) contradicts --dataset {f.dataset}")
    return ours, key if key in DATASETS else None


def _lengths(f: SpelledFlags, dataset: str, vllm_name: str | None) -> dict[str, int]:
    """input_len, output_len, prefix_len: as given, else the spelling's defaults."""
    given: dict[str, int | None] = {"input_len": f.input_len, "output_len": f.output_len, "prefix_len": f.prefix_len}
    if vllm_name == "custom" and f.custom_output_len is not None:
        if f.output_len is not None and f.output_len != f.custom_output_len:
            raise ValueError("--custom-output-len contradicts --output-len")
        given["output_len"] = f.custom_output_len
    rpl = f.random_prefix_len
    if rpl is not None:
        if f.prefix_len is not None and f.prefix_len != rpl:
            raise ValueError("--random-prefix-len contradicts --prefix-len")
        given["prefix_len"] = rpl
    defaults = VLLM_LENGTHS.get(vllm_name or "", {})
    out = {k: defaults.get(k, ours) for k, ours in OUR_LENGTHS.items()}
    out.update({k: v for k, v in given.items() if v is not None})
    if rpl is not None and dataset == "random":
        # vLLM's random prompt is the prefix plus --random-input-len tokens; ours counts the
        # prefix inside --input-len.
        out["input_len"] += rpl
    return out


@dataclass(frozen=True)
class _DataFiles:
    trace_file: str | None
    chat_file: str
    sonnet_file: str | None


def _data_file(f: SpelledFlags, dataset: str) -> _DataFiles:
    """trace_file, chat_file, sonnet_file: --dataset-path names the one of the dataset."""
    files = _DataFiles(f.trace_file, f.chat_file, None)
    path = f.dataset_path
    if path is None:
        return files
    if dataset == "random":
        raise ValueError("--dataset-path with the random dataset: name the dataset it holds "
                         "(--dataset-name sonnet or custom, or --dataset trace/chat)")
    name = DATA_FILE_FLAGS[dataset]
    if name == "trace_file" and f.trace_file not in (None, path):
        raise ValueError("--dataset-path and --trace-file name different files")
    return replace(files, **{name: path})


def _check_output(f: SpelledFlags) -> None:
    """ValueError on a bad --goodput, --percentile-metrics, --metric-percentiles or
    --metadata, or two names for the result file."""
    parse_goodput(f.goodput)
    parse_percentile_metrics(f.percentile_metrics)
    parse_metric_percentiles(f.metric_percentiles)
    if isinstance(f.save_result, str) and f.result_filename:
        raise ValueError("--save-result FILE and --result-filename both name the result file: give one")
    for item in f.metadata or []:
        if "=" not in item:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")


def merge_goodput(slo: SLO, goodput: Sequence[str] | None) -> SLO:
    """``slo`` with ``--goodput``'s per-request targets added; ValueError where ``--slo`` sets
    the same metric to another value."""
    for metric, target in parse_goodput(goodput).items():
        if metric in slo.per_request and not math.isclose(slo.per_request[metric], target):
            raise ValueError(f"--goodput and --slo both set a per-request {metric} target, differently")
        slo.per_request[metric] = target
    return slo
