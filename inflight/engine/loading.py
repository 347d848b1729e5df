"""Start-up: resolve device and dtypes, load weights and tokenizer, size the KV pool."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from inflight.config import (DEFAULT_KV_CACHE_MEMORY_CAP, DEFAULT_KV_CACHE_MEMORY_FRACTION,
                             EngineConfig)
from inflight.model.config import ModelConfig
from inflight.model.llama import LlamaForCausalLM
from inflight.model.loader import load_model
from inflight.runner import kv_block_bytes

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(model: str | None) -> Path:
    """The model to load: ``model``, or the bundled SmolLM2-135M GGUF when None."""
    if model is None:
        from inflight.model.bundled import find_bundled_model
        return find_bundled_model()
    return Path(model).expanduser()


def resolve_device(device: str) -> torch.device:
    """``auto`` means CUDA when available, else CPU.

    Raises:
        ValueError: ``cuda`` asked for on a machine without it.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch.cuda.is_available() is False")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA; float32 on CPU. On this CPU bfloat16 steps are ~1.5x
    faster, but bfloat16 greedy output left HF's bfloat16 reference within 32 tokens on 4 of
    8 MT-Bench prompts (rounding happens at different points), while float32 matches HF's
    float32 token for token; correctness first (docs/performance.md)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_model_and_tokenizer(path: Path, dtype: torch.dtype, device: torch.device):
    """``(model_config, model, tokenizer)`` for a GGUF file or HF directory."""
    from inflight.tokenizer import Tokenizer

    model_config, state = load_model(path)
    model = LlamaForCausalLM(model_config, dtype=dtype, device=device)
    model.load_weights(state)
    del state
    tokenizer = Tokenizer.from_pretrained(path) if path.is_dir() else Tokenizer.from_gguf(path)
    return model_config, model, tokenizer


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype,
                  device: torch.device) -> int:
    """KV pool size in blocks: ``num_kv_blocks``, else ``kv_cache_memory_bytes``, else a
    share of free memory (``gpu_memory_utilization`` of free device memory on CUDA;
    ``DEFAULT_KV_CACHE_MEMORY_FRACTION`` of available RAM, at most 4 GiB, on CPU).

    Raises:
        ValueError: the budget does not hold a single block.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(model_config, config.block_size, kv_dtype)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = min(int(_available_ram() * DEFAULT_KV_CACHE_MEMORY_FRACTION),
                         DEFAULT_KV_CACHE_MEMORY_CAP)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                         f"({per_block} bytes each)")
    return blocks


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
