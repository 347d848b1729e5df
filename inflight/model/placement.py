"""Where and how a model runs: its path, device, dtype and weight quantization, resolved
from the ``EngineConfig`` strings (``auto`` included). Shared by the engine's start-up
(``inflight.engine.loading``) and the draft model of speculative decoding
(``inflight.spec_decode.draft_model``), which sits below the engine."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from inflight.model.kernels.native_lib import isa_path, quantized_kernels_vectorized
from inflight.model.kv_quant import KV_8BIT_DTYPES

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(model: str | None) -> Path:
    """The model to load: ``model`` (a path, or a packaged model's short name:
    ``model.bundled.PACKAGED_MODELS``), or the bundled SmolLM2-135M GGUF when None.

    Raises:
        FileNotFoundError: a short name whose package is not installed (with its install
            command).
    """
    from inflight.model.bundled import PACKAGED_MODELS, find_bundled_model
    if model is None:
        return find_bundled_model()
    if model in PACKAGED_MODELS and not Path(model).exists():
        return PACKAGED_MODELS[model]()
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


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has native bfloat16 dot products: the ``avx512_bf16`` (AVX512-BF16,
    ``vdpbf16ps``) or ``amx_bf16`` (AMX) flag in Linux's ``/proc/cpuinfo``. False where the
    file is missing or unreadable (another OS): float32 is the safe default there."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` picks the fast path, as vLLM's CPU backend does: bfloat16 on CUDA and on CPUs
    with native bfloat16 dot products (``cpu_has_native_bf16``), float32 on other CPUs
    (there bfloat16 is emulated and slower). On this machine's AVX512-BF16 cores a bfloat16
    decode step is ~1.5x faster than float32 (docs/performance.md). float32 stays the
    exact one: it matches HF's float32 token for token, while bfloat16 rounds at other
    points than HF's bfloat16 and is checked by teacher forcing instead
    (tests/model/test_bf16_vs_hf.py). An emulated AVX2 host (``INFLIGHT_CPU_ISA=avx2``)
    gets an AVX2 host's float32."""
    if dtype == "auto":
        if device.type == "cuda" or (cpu_has_native_bf16() and isa_path() != "avx2"):
            return torch.bfloat16
        return torch.float32
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's storage dtype for ``--kv-cache-dtype``: ``auto`` is the model's
    ``dtype``; ``int8`` / ``fp8`` / ``fp8_e4m3`` the 8-bit formats (``model.kv_quant``:
    ``torch.int8``, ``torch.float8_e4m3fn``), on any device; else as ``resolve_dtype``."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in KV_8BIT_DTYPES:
        return KV_8BIT_DTYPES[kv_cache_dtype]
    return resolve_dtype(kv_cache_dtype, device)


def resolve_quantization(quantization: str, path: Path, device: torch.device) -> str:
    """``auto``: ``gguf`` for a GGUF file on CPU (its blocks as the file has them, the way
    llama.cpp serves it) where the block kernels have their SIMD path
    (``quantized_kernels_vectorized``: AVX-512 VNNI or AVX2), ``none`` elsewhere: the block
    kernels are CPU code, and their scalar C is slower than dense weights on oneDNN.

    Raises:
        ValueError: a quantization on CUDA, or ``gguf`` for a model that is not a GGUF file.
    """
    if quantization == "auto":
        if device.type != "cpu" or not path.is_file():
            return "none"
        if not quantized_kernels_vectorized():
            logger.info("quantization auto: dense weights (the native block kernels are off "
                        "or unbuilt, or this CPU has neither AVX-512 VNNI nor AVX2, where "
                        "they are scalar and slower)")
            return "none"
        return "gguf"
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization: {quantization} runs on CPU only (device {device})")
    if quantization == "gguf" and not path.is_file():
        raise ValueError(f"quantization: gguf needs a GGUF file, {path} is a directory")
    return quantization
