"""The 8-bit KV cache (``--kv-cache-dtype int8`` / ``fp8``): its storage format, and the PyTorch
path that writes and reads it (for CUDA and ``INFLIGHT_NATIVE_KERNELS=0``), bit for bit what
the native kernels write (``kernels/kv8.h``, the C side of the same format).

A layer's cache stays one tensor, ``[2, num_kv_heads, num_blocks, block_size, row]``: for the
model's dtype ``row = head_dim``; for an 8-bit format the tensor's dtype is ``torch.int8`` or
``torch.float8_e4m3fn`` and ``row = head_dim + 4``: each (token, KV head) row holds its
``head_dim`` codes and then its float32 scale in the last four bytes. One scale per token and
head, as vLLM's per-token-head scales (llama.cpp's ``q8_0`` keeps one per 32 values): a row is
written once, with its token, and never rescaled. Block tables, slot mappings, prefix caching
and preemption see the same blocks as before; a block takes ``(head_dim + 4) / head_dim``
bytes per value instead of 2 (bfloat16) or 4 (float32).

- int8: ``s = amax * (1/127)``, ``code = clamp(round_half_even(x * (1/s)), -127, 127)``.
- fp8 (``float8_e4m3fn``, vLLM's ``fp8`` / ``fp8_e4m3``): ``s = amax * (1/448)``,
  ``code = e4m3(clamp(x * (1/s), -448, 448))``, rounded to nearest even.

``value = code * s``; a row of zeros has ``s = 0``. Where ``head_dim`` is a power of two the
row is rotated before it is quantized (``rotate``: the normalized Walsh-Hadamard transform,
QuaRot, Ashkboos et al., 2024): keys carry a few outlier channels that would set every
row's scale, and rotated their energy spreads over the row (teacher-forced top-1 agreement
with a bfloat16 cache 98.7 % -> 99.3 %, int8, bundled model; docs/performance.md).
"""

from __future__ import annotations

import math

import torch

SCALE_BYTES = 4

# --kv-cache-dtype names of the 8-bit formats (vLLM's fp8 names, and int8) -> storage dtype.
KV_8BIT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# The kernels' format codes (kv8.h's enum): 0 is a cache in the model's own dtype.
_FORMAT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def dtype_name(dtype: torch.dtype) -> str:
    """A cache dtype as ``--kv-cache-dtype`` names it (``fp8_e4m3``, ``int8``, ``bfloat16``):
    what the start-up line and ``cache_config_info`` report."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def is_8bit(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the storage dtype of an 8-bit KV format."""
    return dtype in _FORMAT_CODES


def format_code(kv_cache: torch.Tensor) -> int:
    """The kernels' code for this cache: 0 (the model's dtype), 1 (int8), 2 (fp8 e4m3)."""
    return _FORMAT_CODES.get(kv_cache.dtype, 0)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row in a cache of ``dtype``: ``head_dim``, plus the
    scale's 4 bytes for an 8-bit format."""
    return head_dim + SCALE_BYTES if is_8bit(dtype) else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size a cache ``[2, Hkv, num_blocks, block_size, row]`` stores."""
    row = int(kv_cache.shape[-1])
    return row - SCALE_BYTES if is_8bit(kv_cache.dtype) else row


def is_rotated(head_dim: int) -> bool:
    """Whether 8-bit rows of this head size are stored rotated (a power of two, 2..256)."""
    return 2 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``H x`` over the last dimension, ``H`` the normalized Walsh-Hadamard matrix (its own
    inverse), in float32, bit for bit as ``kv8_rotate`` (the same butterflies in the same
    order, then one scaling); ``x`` unchanged where ``is_rotated`` is False.

    Args:
        x: ``[..., head_dim]`` float32.
    """
    d = x.shape[-1]
    if not is_rotated(d):
        return x
    lead, h = x.shape[:-1], 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x * torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32, device=x.device)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of keys or values in the 8-bit format ``dtype``.

    Args:
        x: ``[..., head_dim]`` float32 or bfloat16 (computed in float32).
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Returns:
        ``[..., head_dim + 4]`` in ``dtype``: the codes of the rotated row (``rotate``),
        then each row's float32 scale.
    """
    xf = rotate(x.float())
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax * torch.tensor(1.0 / _QMAX[dtype], dtype=torch.float32, device=x.device)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = xf * inv
    if dtype == torch.int8:
        codes = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-448.0, 448.0).to(dtype)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=dtype, device=x.device)
    out[..., :x.shape[-1]] = codes
    out[..., x.shape[-1]:] = scale.view(torch.uint8).view(dtype)  # its 4 bytes, any offset
    return out


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., head_dim + 4]`` 8-bit rows back to values ``[..., head_dim]`` in ``dtype``
    (``code * scale`` in float32, rotated back, one rounding)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return rotate(rows[..., :d].float() * scale).to(dtype)


def as_values(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (or gathered ones) as values in ``dtype``: dequantized where 8-bit, else
    converted (a no-op when already ``dtype``)."""
    return dequantize_rows(kv, dtype) if is_8bit(kv.dtype) else kv.to(dtype)
