"""ggml's block formats (``docs/gguf.md`` in ggml, ``ggml-quants.c``): what each one is, and
a tensor's blocks decoded to unsigned codes and scales and encoded back, as the ``gguf``
package's ``dequantize_blocks`` reads them. Torch-free; ``quant.py`` packs the codes for the
kernel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

QK = 32  # values a block (a K-quant's sub-block), every format here
QK_K = 256  # values a K-quant super-block


class QuantFormat(enum.IntEnum):
    """The block formats the kernel takes; values are ``quant_linear.c``'s ``fmt``."""

    Q8_0 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 4
    Q5_1 = 5
    Q4_K = 6
    Q5_K = 7
    Q6_K = 8

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        """The GGUF tensor type of this format."""
        from gguf import GGMLQuantizationType  # lazily: gguf pulls numpy only
        return GGMLQuantizationType[self.name]

    @property
    def bits(self) -> int:
        """Bits of a code: 8, or 4 to 6 (a nibble and 0 to 2 bit planes)."""
        return _BITS[self]

    @property
    def super_block(self) -> bool:
        """A K-quant: 256-value super-blocks, integer sub-block scales."""
        return self >= QuantFormat.Q4_K

    @property
    def has_min(self) -> bool:
        """Blocks carry an additive minimum (``+ m``, or a K-quant's ``- dmin * mn``)."""
        return self in (QuantFormat.Q4_1, QuantFormat.Q5_1, QuantFormat.Q4_K, QuantFormat.Q5_K)

    @property
    def values_per_row(self) -> int:
        """K must be a multiple of this: a block, or a K-quant's super-block."""
        return QK_K if self.super_block else QK

    @property
    def quantizable(self) -> bool:
        """The ``gguf`` package has a reference quantizer for it (``QuantizedWeight.quantize``)."""
        return not self.super_block


_BITS = {QuantFormat.Q8_0: 8, QuantFormat.Q4_0: 4, QuantFormat.Q4_1: 4, QuantFormat.Q5_0: 5,
         QuantFormat.Q5_1: 5, QuantFormat.Q4_K: 4, QuantFormat.Q5_K: 5, QuantFormat.Q6_K: 6}
# GGUF bytes per block of 32 values, or per super-block of 256 (K-quants).
BLOCK_BYTES = {QuantFormat.Q8_0: 34, QuantFormat.Q4_0: 18, QuantFormat.Q4_1: 20,
                QuantFormat.Q5_0: 22, QuantFormat.Q5_1: 24, QuantFormat.Q4_K: 144,
                QuantFormat.Q5_K: 176, QuantFormat.Q6_K: 210}

def format_of(ggml_type: object) -> QuantFormat | None:
    """The kernel format of a GGUF tensor type, or None when the kernel has none for it."""
    return QuantFormat.__members__.get(getattr(ggml_type, "name", ""))


@dataclass
class Codes:
    """A tensor's blocks decoded, rows in order (``decode_blocks``'s result, ``encode_blocks``'s input).

    u: uint8 ``[N, K / 32, 32]``, each value's code (Q8_0: the byte ``q + 128``).
    d: float16 ``[N, K / 32]`` block scales, or ``[N, K / 256]`` super-block ``d`` (K-quants).
    m: float16, as ``d``: the minimums (``Q4_1``, ``Q5_1``) or ``dmin``; else None.
    sub: uint8 ``[N, K / 32, 2]``, a K-quant's integers per 32 values: ``(sc, mn)``, Q6_K's
        int8 ``(sc of values 0-15, sc of values 16-31)``; else None.
    """

    u: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    sub: np.ndarray | None


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes at a time as float16: ``[..., 2]`` uint8 -> ``[...]``."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _bytes16(h: np.ndarray) -> np.ndarray:
    """``_f16``'s inverse."""
    return np.ascontiguousarray(h.astype(np.float16)[..., None]).view(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes ``[..., 12]`` as ``(sc, mn)``, each ``[..., 8]``, 6 bits
    (ggml's ``get_scale_min_k4``: sub-blocks 0-3 in the low 6 bits of bytes 0-7, 4-7 in
    bytes 8-11's nibbles and the top 2 bits of bytes 0-7)."""
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 2) & 48)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], axis=-1)
    return sc, mn


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """``_k_scales``' inverse."""
    lo = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    hi = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    return np.concatenate([lo, hi, (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)


def _bits_of(b: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bits: uint8 ``[..., count / 8]`` -> ``[..., count]`` of 0 / 1."""
    return np.unpackbits(b, axis=-1, count=count, bitorder="little")


def decode_blocks(fmt: QuantFormat, b: np.ndarray) -> Codes:
    """GGUF blocks ``b`` uint8 ``[N, blocks, block_bytes]`` as codes (ggml's block structs,
    as the ``gguf`` package's ``dequantize_blocks`` reads them)."""
    n = b.shape[0]
    F = QuantFormat
    if fmt == F.Q8_0:
        return Codes(b[:, :, 2:] ^ np.uint8(0x80), _f16(b[:, :, 0:2]), None, None)
    if fmt in (F.Q4_0, F.Q4_1, F.Q5_0, F.Q5_1):
        head = 4 if fmt in (F.Q4_1, F.Q5_1) else 2
        qh = 4 if fmt in (F.Q5_0, F.Q5_1) else 0
        packed = b[:, :, head + qh:]
        u = np.concatenate([packed & 15, packed >> 4], axis=2)  # value j, j + 16 in byte j
        if qh:
            u |= _bits_of(b[:, :, head:head + 4], 32) << 4
        return Codes(u, _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]) if head == 4 else None, None)
    if fmt in (F.Q4_K, F.Q5_K):
        qh = 32 if fmt == F.Q5_K else 0
        qs = b[:, :, 16 + qh:].reshape(n, -1, 4, 32)  # 4 chunks: sub-blocks 2c, 2c + 1
        u = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if qh:  # bit i of byte j: value j of sub-block i
            u |= _bits_of(b[:, :, 16:48, None], 8).transpose(0, 1, 3, 2) << 4
        sc, mn = _k_scales(b[:, :, 4:16])
        return Codes(u.reshape(n, -1, 32), _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]),
                      np.stack([sc, mn], axis=3).reshape(n, -1, 2))
    # Q6_K: ql 128 bytes (2 chunks of 64: low nibbles values 0-63, high 64-127 of the
    # chunk's 128), qh 64 (2 chunks of 32: bits 2s, 2s + 1 of byte j are values 32s + j's
    # top two), 16 int8 scales (one per 16 values), d
    ql = b[:, :, :128].reshape(n, -1, 2, 64)
    low = np.stack([ql & 15, ql >> 4], axis=3).reshape(n, -1, 2, 4, 32)
    top = b[:, :, 128:192].reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    six = low | ((top & 3) << 4)
    return Codes(six.reshape(n, -1, 32), _f16(b[:, :, 208:210]), None,
                  b[:, :, 192:208].reshape(n, -1, 2))


def encode_blocks(fmt: QuantFormat, c: Codes) -> np.ndarray:
    """``decode_blocks``'s inverse: uint8 ``[N, blocks, block_bytes]``."""
    n, u = c.u.shape[0], c.u
    F = QuantFormat
    if fmt == F.Q8_0:
        return np.concatenate([_bytes16(c.d), u ^ np.uint8(0x80)], axis=2)
    if fmt in (F.Q4_0, F.Q4_1, F.Q5_0, F.Q5_1):
        parts = [_bytes16(c.d)] + ([_bytes16(c.m)] if c.m is not None else [])
        if fmt in (F.Q5_0, F.Q5_1):
            parts.append(np.packbits(u >> 4, axis=2, bitorder="little"))
        nib = u & 15
        return np.concatenate(parts + [nib[:, :, :16] | (nib[:, :, 16:] << 4)], axis=2)
    assert c.m is not None or fmt == F.Q6_K
    assert c.sub is not None
    sub = c.sub.reshape(n, -1, 8, 2)
    us = u.reshape(n, -1, 8, 32)
    if fmt in (F.Q4_K, F.Q5_K):
        assert c.m is not None
        parts = [_bytes16(c.d), _bytes16(c.m), _k_scale_bytes(sub[..., 0], sub[..., 1])]
        if fmt == F.Q5_K:
            bits = ((us >> 4) & 1).transpose(0, 1, 3, 2)  # [N, blocks, byte j, sub-block i]
            parts.append(np.packbits(bits, axis=3, bitorder="little")[..., 0])
        nib = (us & 15).reshape(n, -1, 4, 2, 32)
        parts.append((nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).reshape(n, -1, 128))
        return np.concatenate(parts, axis=2)
    v = us.reshape(n, -1, 2, 4, 32)  # chunk, quarter, byte
    nib = (v & 15).reshape(n, -1, 2, 2, 64)
    ql = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).reshape(n, -1, 128)
    top = (v >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = np.bitwise_or.reduce(top, axis=3).reshape(n, -1, 64)
    return np.concatenate([ql, qh, sub.reshape(n, -1, 16), _bytes16(c.d)], axis=2)
