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

Generated tokens' rows run on the packed blocks (a third of the bytes of bfloat16 at 4
bits), and so do prompt rows, except where the prompt GEMM has AMX-BF16 tiles: there a
bfloat16 copy of the blocks' values (``QuantizedWeight.dequantize``) is packed for it at load
(``linear.Linear.prepack``, ``--no-repack`` drops it), so both paths compute with the same
weights. Where the block kernels are vectorized the blocks are the layer's only weights.
ggml's formats themselves: ``block_formats.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.model.block_formats import (BLOCK_BYTES, QK, Codes, QuantFormat, decode_blocks,
                                          encode_blocks, format_of)

__all__ = ["QK", "TILE", "QuantFormat", "QuantizedParts", "QuantizedWeight", "format_of",
           "sample_blocks"]


TILE = 16  # weight rows a tile of the kernel's layout


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
        block_bytes = BLOCK_BYTES[fmt]
        rows = np.ascontiguousarray(blocks, dtype=np.uint8)
        if rows.ndim != 2 or rows.shape[1] % block_bytes:
            raise ValueError(f"{fmt.name}: rows of {rows.shape[-1]} bytes are not whole "
                             f"{block_bytes}-byte blocks")
        n = rows.shape[0]
        c = decode_blocks(fmt, rows.reshape(n, -1, block_bytes))
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

    def _codes(self) -> Codes:
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
        return Codes(_untiled(v.reshape(tiles, nb, TILE, QK), n),
                      _untiled(self.scales.numpy(), n),
                      None if self.mins is None else _untiled(self.mins.numpy(), n), sub)

    def to_blocks(self) -> np.ndarray:
        """The GGUF blocks again: uint8 ``[N, K / 32 * block_bytes]`` (``from_blocks``'s
        inverse)."""
        return encode_blocks(self.fmt, self._codes()).reshape(self.num_rows, -1)

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
    nb, size = k // 256, BLOCK_BYTES[fmt]
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
