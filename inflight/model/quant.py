"""Block-quantized weights for the decode path (``--quantization``).

A linear layer's weight ``[N, K]`` kept in one of ggml's 32-value block formats (GGUF's own:
``docs/gguf.md`` in ggml, ``ggml-quants.c``), packed for the native kernel
(``kernels/quant_linear.c``):

- ``Q8_0``: ``w = d * q``, q int8; ``Q4_0``: ``w = d * (q - 8)``, q a nibble;
  ``Q4_1``: ``w = d * q + m``.
- Weights come either as the GGUF file's own blocks (``--quantization gguf``: nothing
  requantized) or quantized from float weights by the ``gguf`` package's reference
  quantizer, ggml's ``quantize_row_*_ref``, the one ``llama-quantize`` runs without an
  importance matrix: the same blocks llama.cpp would make from the same floats.

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

QK = 32  # values a block, every format here


class QuantFormat(enum.IntEnum):
    """The block formats the kernel takes; values are ``quant_linear.c``'s ``fmt``."""

    Q8_0 = 1
    Q4_0 = 2
    Q4_1 = 3

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        """The GGUF tensor type of this format."""
        from gguf import GGMLQuantizationType  # lazily: gguf pulls numpy only
        return GGMLQuantizationType[self.name]


# --quantization values (vLLM's flag): a format for every linear layer, or the file's own.
QUANTIZATION_CHOICES = ("none", "gguf", "q8_0", "q4_0", "q4_1")


def format_of(ggml_type: object) -> QuantFormat | None:
    """The kernel format of a GGUF tensor type, or None when the kernel has none for it."""
    return QuantFormat.__members__.get(getattr(ggml_type, "name", ""))


TILE = 16  # weight rows a tile of the kernel's layout


@dataclass
class QuantizedWeight:
    """One ``[N, K]`` weight in a block format, in ``quant_linear.c``'s tiled layout: rows in
    tiles of 16 (N padded with zero rows), per tile and 32-value block the 16 rows' values
    side by side, so one int32 lane of a vector register is one output row.

    Attributes:
        fmt: the block format.
        num_rows: N, the rows of the layer (the tiles hold it rounded up to 16).
        qs: uint8 ``[N / 16, K / 32, 256]`` (``Q4_*``: 4 registers of 64 bytes; register
            ``j``, lane ``l``, byte ``b``: value ``8j + b`` of row ``l`` in the low nibble,
            value ``8j + 4 + b`` in the high one) or ``[N / 16, K / 32, 512]`` (``Q8_0``: 8
            registers; register ``j``, lane ``l``, byte ``b``: value ``4j + b`` of row ``l``,
            plus 128).
        scales: float16 ``[N / 16, K / 32, 16]``, each row's block scale ``d``.
        mins: ``Q4_1``: float16 ``[N / 16, K / 32, 16]``, each row's block minimum ``m``;
            else None.
    """

    fmt: QuantFormat
    num_rows: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.scales.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins)
                   if t is not None)

    @classmethod
    def from_blocks(cls, fmt: QuantFormat, blocks: np.ndarray) -> QuantizedWeight:
        """Pack GGUF blocks: ``blocks`` uint8 ``[N, K / 32 * block_bytes]`` (a GGUF tensor's
        rows; ``Q8_0``: 34 bytes a block, fp16 ``d`` then 32 int8; ``Q4_0``: 18, ``d`` then 16
        bytes, value ``j`` in byte ``j``'s low nibble and ``j + 16`` in its high one;
        ``Q4_1``: 20, ``d``, ``m``, 16 bytes).

        Raises:
            ValueError: a row length that is not whole blocks of ``fmt``.
        """
        block_bytes = _BLOCK_BYTES[fmt]
        rows = np.ascontiguousarray(blocks, dtype=np.uint8)
        if rows.ndim != 2 or rows.shape[1] % block_bytes:
            raise ValueError(f"{fmt.name}: rows of {rows.shape[-1]} bytes are not whole "
                             f"{block_bytes}-byte blocks")
        n, nb = rows.shape[0], rows.shape[1] // block_bytes
        b = rows.reshape(n, nb, block_bytes)
        d = b[:, :, 0:2].copy().view(np.float16)[..., 0]
        mins = None
        if fmt == QuantFormat.Q8_0:
            values = b[:, :, 2:] ^ np.uint8(0x80)  # int8 q -> the byte q + 128
        else:
            packed = b[:, :, 4:] if fmt == QuantFormat.Q4_1 else b[:, :, 2:]
            values = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # values 0..31
            if fmt == QuantFormat.Q4_1:
                mins = b[:, :, 2:4].copy().view(np.float16)[..., 0]
        tiles = -(-n // TILE)
        pad = tiles * TILE - n

        def tiled(a: np.ndarray) -> np.ndarray:  # [N, nb, ...] -> [tiles, nb, 16, ...]
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            return a.reshape(tiles, TILE, *a.shape[1:]).swapaxes(1, 2)

        v = tiled(values)  # [tiles, nb, 16 rows, 32 values]
        if fmt == QuantFormat.Q8_0:
            qs = v.reshape(tiles, nb, TILE, 8, 4).transpose(0, 1, 3, 2, 4)
        else:
            v = v.reshape(tiles, nb, TILE, 4, 2, 4)  # register, low/high nibble, byte
            qs = (v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 4)).transpose(0, 1, 3, 2, 4)
        return cls(fmt, n, torch.from_numpy(np.ascontiguousarray(qs).reshape(tiles, nb, -1)),
                   torch.from_numpy(np.ascontiguousarray(tiled(d))),
                   None if mins is None else torch.from_numpy(np.ascontiguousarray(tiled(mins))))

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
        """Quantize float ``weight`` ``[N, K]`` (K a multiple of 32) with ggml's reference
        quantizer (the ``gguf`` package's ``quants.quantize``).

        Raises:
            ValueError: K not a multiple of 32.
        """
        from gguf import quants
        n, k = weight.shape
        if k % QK:
            raise ValueError(f"{fmt.name}: K = {k} is not a multiple of {QK}")
        w = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
        return cls.from_blocks(fmt, quants.quantize(w, fmt.ggml_type))

    def to_blocks(self) -> np.ndarray:
        """The GGUF blocks again: uint8 ``[N, K / 32 * block_bytes]`` (``from_blocks``'s
        inverse)."""
        n, k = self.shape
        nb = k // QK
        tiles = self.qs.shape[0]

        def rows(a: np.ndarray) -> np.ndarray:  # [tiles, nb, 16, ...] -> [N, nb, ...]
            a = a.swapaxes(1, 2).reshape(tiles * TILE, *a.shape[1:2], *a.shape[3:])[:n]
            return np.ascontiguousarray(a)

        d = rows(self.scales.numpy()[..., None]).view(np.uint8).reshape(n, nb, 2)
        if self.fmt == QuantFormat.Q8_0:
            v = self.qs.numpy().reshape(tiles, nb, 8, TILE, 4).transpose(0, 1, 3, 2, 4)
            parts = [d, rows(v.reshape(tiles, nb, TILE, QK)) ^ np.uint8(0x80)]
        else:
            packed = self.qs.numpy().reshape(tiles, nb, 4, TILE, 4).transpose(0, 1, 3, 2, 4)
            values = np.stack([packed & 0x0F, packed >> 4], axis=4)  # register, nibble, byte
            values = rows(values.reshape(tiles, nb, TILE, QK))  # [N, nb, 32] values 0..31
            nibbles = values[:, :, :16] | (values[:, :, 16:] << 4)
            parts = [d, nibbles]
            if self.fmt == QuantFormat.Q4_1:
                assert self.mins is not None
                parts.insert(1, rows(self.mins.numpy()[..., None]).view(np.uint8).reshape(n, nb, 2))
        return np.concatenate(parts, axis=2).reshape(n, -1)

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 ``[N, K]`` (the ``gguf`` package's dequantizer)."""
        from gguf import quants
        n, k = self.shape
        return torch.from_numpy(
            np.array(quants.dequantize(self.to_blocks(), self.fmt.ggml_type),
                     dtype=np.float32).reshape(n, k))


_BLOCK_BYTES = {QuantFormat.Q8_0: 34, QuantFormat.Q4_0: 18, QuantFormat.Q4_1: 20}
