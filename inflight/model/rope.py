"""Rotary position embedding (Su et al., "RoFormer", 2021) as HF transformers computes it:
rotate-half pairs, inverse frequencies in float64 then float32, and the ``linear`` and
``llama3`` frequency scalings of ``modeling_rope_utils.py``."""

from __future__ import annotations

import math
from typing import Any

import torch

from inflight.model.hparams import ModelConfig

__all__ = ["apply_rope", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None,
                  theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32, with the config's scaling
    (``scaled``), of base ``theta`` (default the config's ``rope_theta``).

    Raises:
        ValueError: an unsupported ``rope_scaling`` type.
    """
    d = config.head_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if freq_factors is not None:  # GGUF stores llama3 scaling as per-dimension divisors
        return (inv_freq / freq_factors.double()).float()
    scaling = (config.rope_scaling or {}) if scaled else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3)")
    return inv_freq.float()


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, head_dim]``; ``cos``/``sin`` ``[T, 1, head_dim]`` in x's dtype."""
    return x * cos + _rotate_half(x) * sin
