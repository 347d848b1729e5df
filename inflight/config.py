"""Every engine knob: its default, its validation, its CLI flag. Torch-free.

Flag names follow vLLM's engine arguments (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--block-size``, ``--max-model-len``, ``--kv-cache-memory-bytes``, ``--dtype``) so command
lines migrate unchanged.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from inflight.core.overload import OVERLOAD_INTERVAL_S
from inflight.core.policies import BATCHING_POLICIES
from inflight.core.queue_policy import SCHEDULING_POLICIES
from inflight.core.spec_config import SpeculativeConfig
from inflight.lora.lora_config import LoRAConfig, add_lora_cli_args, lora_config_from_args

DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3")
# --quantization (vLLM's flag): model/quant.py; resolved by engine/loading.py.
QUANTIZATIONS = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
DEVICES = ("auto", "cpu", "cuda")
# Share of available RAM (CPU) or free device memory (CUDA) given to the KV cache when
# neither ``kv_cache_memory_bytes`` nor ``num_kv_blocks`` is set.
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.25
# Cap on that default, so a big host does not pin tens of GiB for a small model.
DEFAULT_KV_CACHE_MEMORY_CAP = 4 << 30
# `inflight serve`'s overload protection (docs/reliability.md says why these numbers): a
# standing queue is shed down to a 1 s predicted TTFT, and a step with decodes in it is
# planned to take at most 0.5 s. The engine itself defaults to neither (offline batches
# queue by design).
DEFAULT_OVERLOAD_TTFT = 1.0
DEFAULT_MAX_STEP_TIME = 0.5
# `inflight serve`'s admission bound: sequences that may wait beyond the free running slots
# before requests get 503 (``ServingConfig.max_num_waiting``).
DEFAULT_MAX_NUM_WAITING = 512


@dataclass(frozen=True)
class ServingConfig:
    """Settings of the serving front (admission), apart from the engine's.

    Attributes:
        max_num_waiting: per engine, sequences allowed to wait for admission (queued or
            reserved, plus the scheduler's waiting queue) beyond its free running slots;
            past it requests get 503 with ``Retry-After``. None: unbounded (an engine
            driven without a server).

    Raises:
        ValueError: a negative ``max_num_waiting``.
    """

    max_num_waiting: int | None = DEFAULT_MAX_NUM_WAITING

    def __post_init__(self) -> None:
        if self.max_num_waiting is not None and self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting: must be >= 0, got {self.max_num_waiting}")


@dataclass(frozen=True)
class EngineConfig:
    """Validated engine settings.

    Attributes:
        model: a ``.gguf`` file or HF model directory; None loads the bundled SmolLM2-135M.
        dtype: weights/activations: ``float32``, ``bfloat16`` or ``auto``.
        kv_cache_dtype: KV cache element type; ``auto`` follows ``dtype``; ``int8`` and
            ``fp8`` (``fp8_e4m3``, vLLM's names) store 8-bit keys and values with a float32
            scale per token and head (``model/kv_quant.py``): about twice the tokens of a
            bfloat16 cache in the same bytes.
        quantization: weights of the linear layers: ``gguf`` keeps a GGUF file's own
            block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; other types are
            dequantized); ``q8_0``, ``q4_0``, ``q4_1`` quantize every linear layer to one;
            ``none`` keeps them dense; ``auto`` is ``gguf`` for a GGUF file on CPU, else
            ``none`` (``inflight.model.quant``,
            ``inflight.engine.loading.resolve_quantization``).
        repack: where the prompt GEMM has AMX-BF16 tiles, keep a bfloat16 copy of each
            quantized decoder layer packed for it (1.6x the prefill throughput on Gemma 3
            270M, two bytes a weight); False (``--no-repack``, llama.cpp's flag): the blocks alone, at the
            file's memory (``LlamaForCausalLM.load_weights``).
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA when available).
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size in blocks; overrides ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: KV pool size in bytes (None: a share of free memory, see
            ``DEFAULT_KV_CACHE_MEMORY_FRACTION``).
        gpu_memory_utilization: on CUDA without an explicit size, the share of free device
            memory for the KV cache.
        max_model_len: longest sequence (prompt + output tokens); None: the model's,
            lowered with a warning to what the KV pool holds. An explicit value the pool
            cannot hold is refused at start (``inflight.engine.loading.resolve_max_model_len``).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        enable_chunked_prefill: split prompts longer than the remaining budget.
        long_prefill_token_threshold: with chunked prefill, the most prompt tokens one
            request computes in a step (vLLM's flag; 0: no cap, a long prompt takes the
            whole budget, so requests arriving behind it start when its prefill ends). A
            cap below the budget leaves room in every step for newcomers' prefills.
        enable_prefix_caching: reuse the KV of full blocks shared with earlier requests.
        batching_policy: ``continuous``, ``static`` or ``dynamic``.
        max_queue_delay: dynamic policy: seconds the oldest request may wait for a batch.
        scheduling_policy: ``fcfs``, ``priority`` or ``slo`` (``inflight.core.queue_policy``).
        ttft_slo, itl_slo: default latency targets, seconds, for the ``slo`` policy.
        max_queue_time: shed a request that waited this many seconds without starting.
        overload_ttft: overload shedding (``inflight.core.overload``): once the
            waiting queue has not emptied for ``OVERLOAD_INTERVAL_S``, shed each waiting
            request whose first token is predicted more than this many seconds after its
            arrival. None: off (the engine's default, for offline batches; ``inflight
            serve`` defaults to ``DEFAULT_OVERLOAD_TTFT``).
        max_step_time: cap each step's token budget so its predicted time stays within
            this many seconds while requests decode (the ITL a busy step costs every
            running request); None: off (``inflight serve``: ``DEFAULT_MAX_STEP_TIME``).
        priority_aging_s: ``priority`` policy: seconds of waiting worth one priority level;
            a request of priority ``p`` outranks every request of priority ``q`` arriving
            ``(p - q) * priority_aging_s`` seconds or more after it (20 s for 10 levels at
            the default; ``inflight.core.queue_policy``). 0: no aging.
        num_threads: torch intra-op threads on CPU, which the native kernels share (None:
            torch's default, one per CPU this process may run on, ``os.sched_getaffinity``).
        seed: seed of the default generator for unseeded sampling.
        step_breakdown: time each step's phases (``inflight.profiling``); the server logs
            them with its stats line.
        speculative_config: speculative decoding (``core.spec_config``, vLLM's
            ``--speculative-config`` JSON); None: off.
        lora_config: LoRA adapters (``lora.lora_config``, vLLM's ``--enable-lora``,
            ``--lora-modules``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``);
            None: off.
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    repack: bool = True
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    batching_policy: str = "continuous"
    max_queue_delay: float = 0.05
    scheduling_policy: str = "fcfs"
    ttft_slo: float | None = None
    itl_slo: float | None = None
    max_queue_time: float | None = None
    overload_ttft: float | None = None
    max_step_time: float | None = None
    # 2 s a level: priority 10 waits at most 20 s behind fresh priority-0 traffic (< 30 s).
    priority_aging_s: float = 2.0
    num_threads: int | None = None
    seed: int = 0
    step_breakdown: bool = False
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg}, got {getattr(self, name)!r}")

        check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {KV_CACHE_DTYPES}")
        check(self.quantization in QUANTIZATIONS, "quantization",
              f"must be one of {QUANTIZATIONS}")
        check(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        check(self.block_size >= 1, "block_size", "must be >= 1")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              "kv_cache_memory_bytes", "must be > 0")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
              "must be >= 0 (0: no cap)")
        check(self.batching_policy in BATCHING_POLICIES, "batching_policy",
              f"must be one of {BATCHING_POLICIES}")
        check(self.max_queue_delay >= 0, "max_queue_delay", "must be >= 0 seconds")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
              f"must be one of {SCHEDULING_POLICIES}")
        for name in ("ttft_slo", "itl_slo", "max_queue_time", "overload_ttft",
                     "max_step_time"):
            value = getattr(self, name)
            check(value is None or value > 0, name, "must be > 0 seconds")
        check(self.priority_aging_s >= 0, "priority_aging_s", "must be >= 0 seconds (0: no aging)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per field (vLLM's spelling) to ``parser``."""
        g = parser.add_argument_group("engine")
        _add_model_args(g)
        _add_scheduling_args(g)
        add_lora_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config ``add_cli_args``' flags give. Raises ``ValueError`` naming a field, or
        ``LoRAError`` (a ``ValueError``) for a ``--lora-modules`` adapter whose directory or
        ``adapter_config.json`` cannot be served (checked now, before any model loads)."""
        lora = lora_config_from_args(args)
        if lora is not None and lora.lora_modules:
            from inflight.lora.adapter import check_adapter_dir  # torch: only when needed

            for module in lora.lora_modules:
                check_adapter_dir(module.name, module.path)
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                      if f.name != "lora_config"}, lora_config=lora)


def _seconds_or_off(text: str) -> float | None:
    """``1.5`` -> 1.5 seconds; ``0``, ``off`` or ``none`` -> None (the feature off)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'off', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 or 'off', got {text!r}")
    return value or None


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_bytes(text: str) -> int:
    """``4096``, ``512M``, ``2G``, ``1.5GiB`` -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 4096, 512M or 2G, got {text!r}") from None


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    """The model, memory and batch-size flags."""
    g.add_argument("--model", default=None, help="a .gguf file or HF model directory "
                   "(default: the bundled SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--dtype", default="auto", choices=DTYPES)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache element type: auto follows --dtype; int8 and fp8 "
                        "(fp8_e4m3) store 8-bit keys and values with a scale per token and "
                        "head: about twice the tokens of bfloat16 in the same bytes")
    g.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATIONS,
                   help="linear-layer weights: gguf keeps a GGUF file's own blocks (Q8_0, "
                        "Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), q8_0/q4_0/q4_1 quantize "
                        "to one, none keeps them dense; auto: gguf for a GGUF file on CPU, "
                        "else none")
    g.add_argument("--no-repack", dest="repack", action="store_false",
                   help="keep only a quantized model's blocks: prompts run on them too, at "
                        "the file's memory (default: on a CPU with AMX-BF16 tiles, quantized "
                        "layers also keep a bfloat16 copy for prompts: 1.6x the prefill throughput on Gemma 3 270M)")
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (overrides --kv-cache-memory-bytes)")
    g.add_argument("--kv-cache-memory-bytes", type=_parse_bytes, default=None,
                   help="KV pool size in bytes (suffixes K, M, G allowed)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt plus output tokens (default: the "
                        "model's, lowered to what the KV cache holds); a value the KV "
                        "cache cannot hold is refused at start")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request computes in a step (0: no cap); "
                   "below the budget, requests behind a long prompt start before its "
                   "prefill ends")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse cached KV blocks of shared prompt prefixes")


def _add_scheduling_args(g: argparse._ArgumentGroup) -> None:
    """The batching, scheduling, overload and runtime flags."""
    g.add_argument("--batching-policy", default="continuous", choices=BATCHING_POLICIES)
    g.add_argument("--max-queue-delay", type=float, default=0.05,
                   help="dynamic policy: seconds the oldest request waits for a batch")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs; priority (request field 'priority', lower first, with aging); "
                        "slo (earliest TTFT deadline first, ITL-bounded step budget, "
                        "shedding of requests that cannot meet their TTFT target)")
    g.add_argument("--ttft-slo", type=float, default=None,
                   help="slo policy: default TTFT target, seconds")
    g.add_argument("--itl-slo", type=float, default=None,
                   help="slo policy: default inter-token latency target, seconds")
    g.add_argument("--max-queue-time", type=float, default=None,
                   help="shed requests that waited this many seconds without starting")
    g.add_argument("--overload-ttft", type=_seconds_or_off, default=None, metavar="S",
                   help="overload shedding: once the waiting queue has not emptied for "
                        f"{OVERLOAD_INTERVAL_S:g} s, requests predicted to get their first token "
                        "more than S seconds after arrival get 503 + Retry-After at once (serve's default "
                        f"{DEFAULT_OVERLOAD_TTFT:g}; 0: off)")
    g.add_argument("--max-step-time", type=_seconds_or_off, default=None, metavar="S",
                   help="cap each step's token budget so a step with decodes is predicted "
                        "to take at most S seconds: the inter-token latency a prefill chunk "
                        f"costs every running request (serve's default {DEFAULT_MAX_STEP_TIME:g}; 0: off)")
    g.add_argument("--priority-aging-s", type=float, default=2.0,
                   help="priority policy: seconds of waiting worth one priority level; "
                        "priority p goes ahead of priority q requests arriving "
                        "(p - q) x this many seconds after it (0: no aging)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for the model (default: one per CPU this process may "
                        "run on, as taskset or a cgroup's cpuset allows)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4}; off by default')
    g.add_argument("--step-breakdown", action="store_true",
                   help="time scheduling, input preparation, forward (attention apart), "
                        "sampling and output per step; logged with the stats line")
