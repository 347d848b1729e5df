"""Weights in every block format for the kernel tests (``model.quant.sample_blocks``), and
each format's values by ggml's formula."""

from __future__ import annotations

import numpy as np
import torch

from inflight.model.quant import QuantFormat, QuantizedWeight, sample_blocks

__all__ = ["ggml_values", "kernel_k", "sample_blocks", "sample_weight"]


def sample_weight(fmt: QuantFormat, n: int, k: int, seed: int, scale: float = 0.1) -> QuantizedWeight:
    """``sample_blocks`` packed for the kernel."""
    return QuantizedWeight.from_blocks(fmt, sample_blocks(fmt, n, k, seed, scale))


def kernel_k(fmt: QuantFormat, k: int) -> int:
    """``k`` rounded up to what ``fmt`` takes (a K-quant's 256)."""
    return -(-k // fmt.values_per_row) * fmt.values_per_row


def ggml_values(fmt: QuantFormat, weight: QuantizedWeight) -> torch.Tensor:
    """The weight's values from its codes and scales in float64, by each format's formula as
    ggml's ``dequantize_row_*`` writes it (independent of the packing's own round trip)."""
    c = weight._codes()
    u, d = c.u.astype(np.float64), c.d.astype(np.float64)
    F = QuantFormat
    if fmt.super_block:
        d = np.repeat(d, 8, axis=1)[..., None]
        assert c.sub is not None
        if fmt == F.Q6_K:
            sc = np.repeat(c.sub.view(np.int8).astype(np.float64), 16, axis=2)
            v = d * sc * (u - 32)
        else:
            assert c.m is not None
            dmin = np.repeat(c.m.astype(np.float64), 8, axis=1)[..., None]
            v = d * c.sub[..., 0:1] * u - dmin * c.sub[..., 1:2]
    else:
        offset = {F.Q8_0: 128, F.Q4_0: 8, F.Q5_0: 16}.get(fmt, 0)
        v = d[..., None] * (u - offset)
        if c.m is not None:
            v = v + c.m.astype(np.float64)[..., None]
    return torch.from_numpy(v.reshape(weight.shape))
