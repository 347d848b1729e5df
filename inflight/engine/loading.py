"""Start-up: resolve device and dtypes, load weights and tokenizer, size the KV pool."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.config import (DEFAULT_KV_CACHE_MEMORY_CAP, DEFAULT_KV_CACHE_MEMORY_FRACTION,
                             EngineConfig)
from inflight.engine.memory import bound_primitive_caches, trim_heap
from inflight.model import kv_quant
from inflight.model.hparams import ModelConfig
from inflight.model.llama import LlamaForCausalLM
from inflight.model.loader import load_model, read_gguf_blocks
# Re-exported (``as``): the engine's callers and tests resolve them here.
from inflight.model.placement import cpu_has_native_bf16 as cpu_has_native_bf16
from inflight.model.placement import resolve_device as resolve_device
from inflight.model.placement import resolve_dtype as resolve_dtype
from inflight.model.placement import resolve_kv_cache_dtype as resolve_kv_cache_dtype
from inflight.model.placement import resolve_model_path as resolve_model_path
from inflight.model.thread_team import describe_threads, thread_policy
from inflight.model.placement import resolve_quantization as resolve_quantization
from inflight.model.quant import QuantFormat, QuantizedParts
from inflight.runner import ModelRunner, kv_block_bytes
from inflight.sampler import Sampler

logger = logging.getLogger(__name__)


def load_model_and_tokenizer(path: Path, dtype: torch.dtype, device: torch.device,
                             quantization: str = "none", repack: bool = True,
                             ) -> tuple[ModelConfig, LlamaForCausalLM, Any]:
    """``(model_config, model, tokenizer)`` for a GGUF file or HF directory;
    ``quantization`` as resolved by ``resolve_quantization``; ``repack`` as
    ``LlamaForCausalLM.load_weights`` takes it."""
    from inflight.tokenizer import Tokenizer

    if quantization not in ("none", "gguf") and path.is_file():
        _warn_requantizing(path, quantization)
    model_config, state = load_model(path)
    blocks = (read_gguf_blocks(path, model_config, {f.name for f in QuantFormat})
              if quantization == "gguf" else None)
    model = LlamaForCausalLM(model_config, dtype=dtype, device=device)
    model.load_weights(state, quantization, blocks, repack)
    del state, blocks
    trim_heap()  # the float state and the dense weights the blocks replace
    tokenizer = Tokenizer.from_pretrained(path) if path.is_dir() else Tokenizer.from_gguf(path)
    from inflight.tokenizer import check_chat_template
    check_chat_template(tokenizer, path)  # UnsafeChatTemplateError: refuse to serve it
    return model_config, model, tokenizer


def _warn_requantizing(path: Path, quantization: str) -> None:
    """Say so where ``--quantization q*`` quantizes a GGUF whose weights are blocks already:
    it starts from their values, so its error adds to the file's (``gguf`` serves the
    file's own blocks; a higher-bit mode cannot bring back what the file dropped)."""
    from collections import Counter

    from inflight.model.gguf_file import read_gguf_tensors

    types = Counter(t.qtype.name for t in read_gguf_tensors(path)[1]
                    if t.data.ndim == 2 and t.qtype.name not in ("F32", "F16", "BF16"))
    if types:
        logger.warning("quantization %s: %s holds quantized weights already (%s); %s quantizes "
                       "their values again, adding its error to the file's (--quantization "
                       "gguf serves the file's own blocks)", quantization, path.name,
                       ", ".join(f"{k} x {n}" for k, n in sorted(types.items())), quantization)


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype,
                  device: torch.device) -> int:
    """KV pool size in blocks: ``num_kv_blocks``, else ``kv_cache_memory_bytes``, else a
    share of memory: on CUDA, vLLM's ``gpu_memory_utilization`` (this instance may use that
    share of the device's total memory; what is already in use, the weights included, and
    an estimate of the step's peak activations come off it); on CPU,
    ``DEFAULT_KV_CACHE_MEMORY_FRACTION`` of available RAM, at most 4 GiB.

    Raises:
        ValueError: the budget does not hold a single block.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model_config, config.block_size, kv_dtype)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = cuda_kv_budget(free, total, config.gpu_memory_utilization,
                                    activation_bytes(model_config, config))
        else:
            budget = min(int(_available_ram() * DEFAULT_KV_CACHE_MEMORY_FRACTION),
                         DEFAULT_KV_CACHE_MEMORY_CAP)
    blocks = max(budget, 0) // per_block
    if blocks < 1:
        if config.kv_cache_memory_bytes is None and device.type == "cuda":
            raise ValueError(f"gpu_memory_utilization: {config.gpu_memory_utilization} of the "
                             f"device leaves {budget} bytes for the KV cache after weights and "
                             f"activations, less than one block ({per_block} bytes); raise it "
                             f"or lower max_num_batched_tokens")
        raise ValueError(f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                         f"({per_block} bytes each)")
    return blocks


def resolve_max_model_len(requested: int | None, model_len: int, num_blocks: int,
                          block_size: int) -> int:
    """The context length to serve, in tokens, given what the KV pool holds.

    An explicit ``requested`` (``--max-model-len``) is served as asked or refused: vLLM
    refuses to start when one sequence of ``max_model_len`` tokens cannot fit the KV cache,
    since such a request would be accepted and then cut short. Without one the model's
    ``model_len`` is the default, and when the pool is smaller the default is lowered to
    the pool with a warning naming both numbers (the default must always start; nothing is
    cut silently: the served ``max_model_len`` is what requests are checked against).

    Args:
        requested: ``EngineConfig.max_model_len`` (None: the model's).
        model_len: the model's context length (``max_position_embeddings``).
        num_blocks, block_size: the KV pool, blocks and tokens per block.

    Raises:
        ValueError: ``requested`` past ``model_len``, or past the pool's
            ``num_blocks * block_size`` tokens (the message names both numbers and the
            flags that fix it).
    """
    pool_tokens = num_blocks * block_size
    if requested is not None:
        if requested > model_len:
            raise ValueError(f"max_model_len: {requested} exceeds the model's context length "
                             f"{model_len}")
        if requested > pool_tokens:
            raise ValueError(
                f"max_model_len: {requested} is larger than the KV cache can hold: "
                f"{pool_tokens} tokens ({num_blocks} blocks x {block_size}); lower "
                f"--max-model-len to {pool_tokens} or less, or raise --num-kv-blocks or "
                f"--kv-cache-memory-bytes (--gpu-memory-utilization on CUDA)")
        return requested
    if model_len > pool_tokens:
        logger.warning("the model's context length %d is larger than the KV cache can hold "
                       "(%d tokens = %d blocks x %d): serving max_model_len %d; raise "
                       "--num-kv-blocks or --kv-cache-memory-bytes for the full context",
                       model_len, pool_tokens, num_blocks, block_size, pool_tokens)
        return pool_tokens
    return model_len


def cuda_kv_budget(free: int, total: int, utilization: float, activations: int) -> int:
    """Bytes for the KV cache on a CUDA device: ``total * utilization`` less what is in
    use already (``total - free``: this process's weights and context, other processes)
    and the step's ``activations``. May be <= 0 (the share is used up)."""
    return int(total * utilization) - (total - free) - activations


def activation_bytes(model_config: ModelConfig, config: EngineConfig) -> int:
    """Upper estimate of one step's peak activation memory (bytes), for KV sizing on CUDA.

    Per token of the step's budget: the residual stream and its norm, fused QKV, attention
    output and the MLP's gate/up and product, at 4 bytes (float32 upper bound); one layer's
    attention scores if the math path materializes them (``heads x tokens x max_model_len``);
    the sampled rows' float32 logits three times (logits, penalties' copy, softmax). Doubled
    for allocator fragmentation. An estimate, not a profile run as vLLM does.
    """
    c, t = model_config, config.max_num_batched_tokens
    per_token = 3 * c.hidden_size + c.q_size + 2 * c.kv_size + c.q_size + 3 * c.intermediate_size
    ctx = config.max_model_len or c.max_position_embeddings
    scores = c.num_attention_heads * t * ctx
    logits = 3 * config.max_num_seqs * c.vocab_size
    return 2 * 4 * (t * per_token + scores + logits)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class LoadedModel:
    """What ``Engine`` needs from start-up.

    Attributes:
        runner: the model runner, KV cache allocated.
        tokenizer: the model's tokenizer.
        num_blocks: KV pool size in blocks.
        max_model_len: context length (``config.max_model_len``, or the model's lowered
            to the pool: ``resolve_max_model_len``).
        eos_token_ids: end-of-sequence ids of the model and its tokenizer.
    """

    runner: ModelRunner
    tokenizer: object
    num_blocks: int
    max_model_len: int
    eos_token_ids: frozenset[int]


def _describe(model: LlamaForCausalLM, quantization: str, path: Path) -> str:
    """``gguf (Q4_1 x 120, Q8_0 x 1 linear layers; weights 94 MiB, 1.00x the file)``: the
    resolved mode and its linear layers (modules: fused Q/K/V and gate/up count once) by
    format, a fused layer whose parts the file keeps in different formats as
    ``Q5_0+Q8_0``, how many stay dense (a tensor type without a kernel), and the bytes the
    weights hold (``LlamaForCausalLM.weight_bytes``), against a GGUF file's size, naming
    a bfloat16 copy for the prompt GEMM where one is kept (``--no-repack`` drops it)."""
    from collections import Counter

    from inflight.model.linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kinds = Counter("+".join(f.name for f in m.quant.formats) if isinstance(m.quant, QuantizedParts)
                    else m.quant.fmt.name for m in linears if m.quant is not None)
    held = model.weight_bytes()
    size = f"weights {sum(held.values()) / 2**20:.0f} MiB"
    if path.is_file():
        size += f", {sum(held.values()) / path.stat().st_size:.2f}x the file"
    if held["packed"]:
        size += f", {held['packed'] / 2**20:.0f} MiB of them packed for the prompt GEMM"
    if not kinds:
        return f"{quantization}; {size}"
    dense = sum(m.quant is None for m in linears)
    return (f"{quantization} ({', '.join(f'{k} x {n}' for k, n in sorted(kinds.items()))}"
            f"{f'; {dense} dense' if dense else ''} linear layers; {size})")


def load(config: EngineConfig) -> LoadedModel:
    """Load the model ``config`` names and size its KV pool.

    Raises:
        ValueError: ``max_model_len`` past the model's context length or past what the KV
            pool holds (``resolve_max_model_len``), or a bad device.
        FileNotFoundError: no such model.
    """
    bound_primitive_caches()  # before the first GEMM: read once, when oneDNN starts
    thread_policy()  # a bad INFLIGHT_THREADS is refused before the weights load
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    path = resolve_model_path(config.model)
    quantization = resolve_quantization(config.quantization, path, device)
    t0 = time.monotonic()
    model_config, model, tokenizer = load_model_and_tokenizer(path, dtype, device, quantization,
                                                             config.repack)
    blocks = num_kv_blocks(config, model_config, kv_dtype, device)
    # Before the KV tensors are allocated: a refusal should not first take the memory.
    max_len = resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings,
                                    blocks, config.block_size)
    runner = ModelRunner(model, blocks, config.block_size, kv_dtype, Sampler(config.seed, device))
    eos = frozenset(model_config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    logger.info("loaded %s (%s, %s, quantization %s, on %s) in %.1f s; KV cache %s: %d blocks "
                "x %d tokens = %d tokens (%.1f MiB); max_model_len %d", path.name,
                model_config.architecture, str(dtype).removeprefix("torch."),
                _describe(model, quantization, path), device, time.monotonic() - t0,
                kv_quant.dtype_name(kv_dtype), blocks, config.block_size,
                blocks * config.block_size,
                sum(t.numel() * t.element_size() for t in runner.kv_caches) / 2**20, max_len)
    logger.info("threads: %s", describe_threads(device))
    return LoadedModel(runner, tokenizer, blocks, max_len, eos)
