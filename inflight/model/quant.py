"""Block-quantized weights for the decode path (``--quantization``).

A linear layer's weight ``[N, K]`` kept in one of ggml's block formats (GGUF's own: ``docs/
gguf.md`` in ggml, ``ggml-quants.c``), packed for the native kernel
(``kernels/quant_linear.c``). Every format is 32-value blocks of unsigned codes ``u`` with a
float scale and offset per block, which is what lets one kernel take them all:

- ``Q8_0``: ``w = d * q``, q int8; ``Q4_0``: ``w = d * (u - 8)``, u a nibble;
  ``Q4_1``: ``w = d * u + m``; ``Q5_0``: ``w = d * (u - 16)``, u 5 bits; ``Q5_1``:
  ``w = d * u + m``, u 5 bits.
- K-quants, 256-value super-blocks (llama.cpp's ``k_quants``): ``Q4_K`` / ``Q5_K``:
  ``w = (d * sc) * u - (dmin * mn)``, u 4 / 5 bits, ``sc`` and ``mn`` 6-bit integers per
  32 values, ``d``, ``dmin`` float16 per 256; ``Q6_K``: ``w = (d * sc) * (u - 32)``, u 6 bits,
  ``sc`` an int8 per 16 values. ``d * sc`` is exact in float32 (11 by at most 8 significant
  bits), so the kernel keeps the integers and the super-block's scale, as the file does.
- Weights come either as the GGUF file's own blocks (``--quantization gguf``: nothing
  requantized) or quantized from float weights by the ``gguf`` package's reference
  quantizer, ggml's ``quantize_row_*_ref``, the one ``llama-quantize`` runs without an
  importance matrix (the legacy formats; the package has no K-quant quantizer).

Decode steps of a few rows run on the packed blocks (a third of the bytes of bfloat16 at
4 bits); steps with more rows run oneDNN's GEMM on the dequantized values, so both paths
compute with the same weights (``QuantizedWeight.dequantize``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

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
_BLOCK_BYTES = {QuantFormat.Q8_0: 34, QuantFormat.Q4_0: 18, QuantFormat.Q4_1: 20,
                QuantFormat.Q5_0: 22, QuantFormat.Q5_1: 24, QuantFormat.Q4_K: 144,
                QuantFormat.Q5_K: 176, QuantFormat.Q6_K: 210}

def format_of(ggml_type: object) -> QuantFormat | None:
    """The kernel format of a GGUF tensor type, or None when the kernel has none for it."""
    return QuantFormat.__members__.get(getattr(ggml_type, "name", ""))


TILE = 16  # weight rows a tile of the kernel's layout


@dataclass
class _Codes:
    """A tensor's blocks decoded, rows in order (``_decode``'s result, ``_encode``'s input).

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


def _decode(fmt: QuantFormat, b: np.ndarray) -> _Codes:
    """GGUF blocks ``b`` uint8 ``[N, blocks, block_bytes]`` as codes (ggml's block structs,
    as the ``gguf`` package's ``dequantize_blocks`` reads them)."""
    n = b.shape[0]
    F = QuantFormat
    if fmt == F.Q8_0:
        return _Codes(b[:, :, 2:] ^ np.uint8(0x80), _f16(b[:, :, 0:2]), None, None)
    if fmt in (F.Q4_0, F.Q4_1, F.Q5_0, F.Q5_1):
        head = 4 if fmt in (F.Q4_1, F.Q5_1) else 2
        qh = 4 if fmt in (F.Q5_0, F.Q5_1) else 0
        packed = b[:, :, head + qh:]
        u = np.concatenate([packed & 15, packed >> 4], axis=2)  # value j, j + 16 in byte j
        if qh:
            u |= _bits_of(b[:, :, head:head + 4], 32) << 4
        return _Codes(u, _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]) if head == 4 else None, None)
    if fmt in (F.Q4_K, F.Q5_K):
        qh = 32 if fmt == F.Q5_K else 0
        qs = b[:, :, 16 + qh:].reshape(n, -1, 4, 32)  # 4 chunks: sub-blocks 2c, 2c + 1
        u = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if qh:  # bit i of byte j: value j of sub-block i
            u |= _bits_of(b[:, :, 16:48, None], 8).transpose(0, 1, 3, 2) << 4
        sc, mn = _k_scales(b[:, :, 4:16])
        return _Codes(u.reshape(n, -1, 32), _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]),
                      np.stack([sc, mn], axis=3).reshape(n, -1, 2))
    # Q6_K: ql 128 bytes (2 chunks of 64: low nibbles values 0-63, high 64-127 of the
    # chunk's 128), qh 64 (2 chunks of 32: bits 2s, 2s + 1 of byte j are values 32s + j's
    # top two), 16 int8 scales (one per 16 values), d
    ql = b[:, :, :128].reshape(n, -1, 2, 64)
    low = np.stack([ql & 15, ql >> 4], axis=3).reshape(n, -1, 2, 4, 32)
    top = b[:, :, 128:192].reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    six = low | ((top & 3) << 4)
    return _Codes(six.reshape(n, -1, 32), _f16(b[:, :, 208:210]), None,
                  b[:, :, 192:208].reshape(n, -1, 2))


def _encode(fmt: QuantFormat, c: _Codes) -> np.ndarray:
    """``_decode``'s inverse: uint8 ``[N, blocks, block_bytes]``."""
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


def _tiled(a: np.ndarray, tiles: int) -> np.ndarray:
    """Rows into tiles of 16, zero rows padding the last: ``[N, nb, ...]`` ->
    ``[tiles, nb, 16, ...]``."""
    pad = tiles * TILE - a.shape[0]
    a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
    return a.reshape(tiles, TILE, *a.shape[1:]).swapaxes(1, 2)


def _untiled(a: np.ndarray, n: int) -> np.ndarray:
    """``_tiled``'s inverse, the padding rows dropped."""
    a = a.swapaxes(1, 2)
    return np.ascontiguousarray(a.reshape(-1, *a.shape[2:])[:n])


@dataclass
class QuantizedWeight:
    """One ``[N, K]`` weight in a block format, in ``quant_linear.c``'s tiled layout: rows in
    tiles of 16 (N padded with zero rows), per tile and 32-value block the 16 rows' codes
    side by side, so one int32 lane of a vector register is one output row.

    Attributes:
        fmt: the block format.
        num_rows: N, the rows of the layer (the tiles hold it rounded up to 16).
        qs: uint8 ``[N / 16, K / 32, tile_bytes]``, per tile and block: ``Q8_0``: 8
            registers of 64 bytes (register ``j``, lane ``l``, byte ``b``: value ``4j + b``
            of row ``l``, plus 128). Else 4 registers of nibbles (register ``j``, lane
            ``l``, byte ``b``: value ``8j + b`` of row ``l`` in the low nibble, ``8j + 4 +
            b`` in the high one), then for 5 and 6 bits one or two bit planes of 64 bytes
            (bit 4, bit 5 of the codes: word ``r`` of 8 bytes, bit ``4l + b``: value ``4r +
            b`` of row ``l``), then for K-quants 32 bytes: ``Q4_K`` / ``Q5_K``: 16 ``sc``
            then 16 ``mn`` (one a row), ``Q6_K``: 16 int8 ``sc`` of values 0-15, 16 of
            values 16-31.
        scales: float16 ``[N / 16, K / 32, 16]``, each row's block scale ``d``; K-quants:
            ``[N / 16, K / 256, 16]``, each row's super-block ``d``.
        mins: as ``scales``: ``Q4_1`` / ``Q5_1``'s minimums ``m``, ``Q4_K`` / ``Q5_K``'s
            ``dmin``; else None.
    """

    fmt: QuantFormat
    num_rows: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.qs.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins)
                   if t is not None)

    @classmethod
    def from_blocks(cls, fmt: QuantFormat, blocks: np.ndarray) -> QuantizedWeight:
        """Pack GGUF blocks: ``blocks`` uint8 ``[N, K / 32 * block_bytes]`` (a GGUF tensor's
        rows, ggml's ``block_q*`` structs; K-quants ``K / 256`` super-blocks).

        Raises:
            ValueError: a row length that is not whole blocks of ``fmt``.
        """
        block_bytes = _BLOCK_BYTES[fmt]
        rows = np.ascontiguousarray(blocks, dtype=np.uint8)
        if rows.ndim != 2 or rows.shape[1] % block_bytes:
            raise ValueError(f"{fmt.name}: rows of {rows.shape[-1]} bytes are not whole "
                             f"{block_bytes}-byte blocks")
        n = rows.shape[0]
        c = _decode(fmt, rows.reshape(n, -1, block_bytes))
        tiles, nb = -(-n // TILE), c.u.shape[1]
        v = _tiled(c.u, tiles)  # [tiles, nb, 16 rows, 32 values]
        if fmt == QuantFormat.Q8_0:
            parts = [v.reshape(tiles, nb, TILE, 8, 4).transpose(0, 1, 3, 2, 4).reshape(tiles, nb, -1)]
        else:
            w = (v & 15).reshape(tiles, nb, TILE, 4, 2, 4)  # register, low/high nibble, byte
            parts = [(w[:, :, :, :, 0] | (w[:, :, :, :, 1] << 4)).transpose(0, 1, 3, 2, 4)
                     .reshape(tiles, nb, -1)]
            regs = v.reshape(tiles, nb, TILE, 8, 4).transpose(0, 1, 3, 2, 4)  # reg, row, byte
            for bit in range(4, fmt.bits):
                plane = ((regs >> bit) & 1).reshape(tiles, nb, 8, 64)
                parts.append(np.packbits(plane, axis=3, bitorder="little").reshape(tiles, nb, 64))
        if c.sub is not None:
            parts.append(_tiled(c.sub, tiles).transpose(0, 1, 3, 2).reshape(tiles, nb, 32))
        qs = np.ascontiguousarray(np.concatenate(parts, axis=2))
        return cls(fmt, n, torch.from_numpy(qs),
                   torch.from_numpy(np.ascontiguousarray(_tiled(c.d, tiles))),
                   None if c.m is None else torch.from_numpy(np.ascontiguousarray(_tiled(c.m, tiles))))

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
        """Quantize float ``weight`` ``[N, K]`` (K a multiple of 32) with ggml's reference
        quantizer (the ``gguf`` package's ``quants.quantize``).

        Raises:
            ValueError: K not a multiple of 32, or a format without a reference quantizer
                in the package (the K-quants: they come from a file's blocks only).
        """
        from gguf import quants
        n, k = weight.shape
        if not fmt.quantizable:
            raise ValueError(f"{fmt.name}: no reference quantizer (the gguf package has "
                             f"none for K-quants); load a file's blocks instead")
        if k % QK:
            raise ValueError(f"{fmt.name}: K = {k} is not a multiple of {QK}")
        w = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
        return cls.from_blocks(fmt, quants.quantize(w, fmt.ggml_type))

    def _codes(self) -> _Codes:
        """The packed tiles decoded again (``from_blocks``' first step, inverted)."""
        n, fmt = self.num_rows, self.fmt
        qs = self.qs.numpy()
        tiles, nb = qs.shape[:2]
        if fmt == QuantFormat.Q8_0:
            v = qs.reshape(tiles, nb, 8, TILE, 4).transpose(0, 1, 3, 2, 4)
        else:
            packed = qs[:, :, :256].reshape(tiles, nb, 4, TILE, 4).transpose(0, 1, 3, 2, 4)
            v = np.stack([packed & 15, packed >> 4], axis=4).reshape(tiles, nb, TILE, 8, 4)
            for i, bit in enumerate(range(4, fmt.bits)):
                plane = np.unpackbits(qs[:, :, 256 + 64 * i:320 + 64 * i].reshape(tiles, nb, 8, 8),
                                      axis=3, bitorder="little").reshape(tiles, nb, 8, TILE, 4)
                v = v | (plane.transpose(0, 1, 3, 2, 4) << bit)
        sub = None
        if fmt.super_block:
            sub = _untiled(qs[:, :, -32:].reshape(tiles, nb, 2, TILE).transpose(0, 1, 3, 2), n)
        return _Codes(_untiled(v.reshape(tiles, nb, TILE, QK), n),
                      _untiled(self.scales.numpy(), n),
                      None if self.mins is None else _untiled(self.mins.numpy(), n), sub)

    def to_blocks(self) -> np.ndarray:
        """The GGUF blocks again: uint8 ``[N, K / 32 * block_bytes]`` (``from_blocks``'s
        inverse)."""
        return _encode(self.fmt, self._codes()).reshape(self.num_rows, -1)

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 ``[N, K]`` (the ``gguf`` package's dequantizer)."""
        from gguf import quants
        n, k = self.shape
        return torch.from_numpy(
            np.array(quants.dequantize(self.to_blocks(), self.fmt.ggml_type),
                     dtype=np.float32).reshape(n, k))


@dataclass
class QuantizedParts:
    """A fused layer (``qkv_proj``, ``gate_up_proj``) whose parts the file keeps in
    different formats (a Q4_K_M file's Q5_0 queries and keys beside Q8_0 values): each
    part's rows on its own blocks, the outputs side by side. llama.cpp never fuses them;
    here the fused layer stays one module and its parts are called in turn.

    Attributes:
        parts: the parts in row order, each ``[N_i, K]``.
    """

    parts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.num_rows for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def formats(self) -> tuple[QuantFormat, ...]:
        return tuple(p.fmt for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The parts' values stacked, float32 ``[sum N_i, K]``."""
        return torch.cat([p.dequantize() for p in self.parts])


def sample_blocks(fmt: QuantFormat, n: int, k: int, seed: int, scale: float = 0.1) -> np.ndarray:
    """Synthetic GGUF blocks for tests and benchmarks: uint8 ``[n, k / 32 * block_bytes]``
    of an ``[n, k]`` weight whose values are about ``scale``: normal values through ggml's
    reference quantizer; for K-quants, whose quantizer the package lacks, uniform random
    codes and integer sub-block scales under float16 super-block scales, so every bit of
    the format is exercised (k a multiple of 256 there)."""
    from gguf import quants
    rng = np.random.default_rng(seed)
    if fmt.quantizable:
        return quants.quantize((rng.standard_normal((n, k)) * scale).astype(np.float32),
                               fmt.ggml_type)
    nb, size = k // 256, _BLOCK_BYTES[fmt]
    b = rng.integers(0, 256, (n, nb, size), dtype=np.uint8)
    # d so that the largest value is about 3 scale: codes up to 2^bits, scales up to 63 / 127
    top = (1 << fmt.bits) * (127 if fmt == QuantFormat.Q6_K else 63) / 4
    d = (np.abs(rng.standard_normal((n, nb, 1))) * 3 * scale / top).astype(np.float16)
    if fmt == QuantFormat.Q6_K:
        b[:, :, 208:210] = d.view(np.uint8)
    else:
        b[:, :, 0:2] = d.view(np.uint8)
        b[:, :, 2:4] = (d / 2).astype(np.float16).view(np.uint8)  # dmin
    return b.reshape(n, -1)
