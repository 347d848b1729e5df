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

import numpy as np
import torch

QK = 32  # values a block, every format here


class QuantFormat(enum.IntEnum):
    """The block formats the kernel takes; values are ``quant_linear.c``'s ``fmt``."""

    Q8_0 = 1
    Q4_0 = 2
    Q4_1 = 3

    @property
    def ggml_type(self):  # gguf.GGMLQuantizationType, imported lazily (gguf pulls numpy only)
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType[self.name]


# --quantization values (vLLM's flag): a format for every linear layer, or the file's own.
QUANTIZATION_CHOICES = ("none", "gguf", "q8_0", "q4_0", "q4_1")


def format_of(ggml_type) -> QuantFormat | None:
    """The kernel format of a GGUF tensor type, or None when the kernel has none for it."""
    return QuantFormat.__members__.get(getattr(ggml_type, "name", ""))


@dataclass
class QuantizedWeight:
    """One ``[N, K]`` weight in a block format, as ``quant_linear.c`` reads it.

    Attributes:
        fmt: the block format.
        qs: uint8. ``Q8_0``: ``[N, K]``, each ``q + 128`` (the kernel's unsigned operand);
            ``Q4_*``: ``[N, K / 2]``, per block 16 bytes, value ``j`` in byte ``j``'s low
            nibble and value ``j + 16`` in its high nibble (GGUF's order).
        scales: float16 ``[N, K / 32]``, each block's ``d``.
        mins: ``Q4_1``: float16 ``[N, K / 32]``, each block's ``m``; else None.
    """

    fmt: QuantFormat
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins)
                   if t is not None)

    @classmethod
    def from_blocks(cls, fmt: QuantFormat, blocks: np.ndarray) -> QuantizedWeight:
        """Pack GGUF blocks: ``blocks`` uint8 ``[N, K / 32 * block_bytes]`` (a GGUF tensor's
        rows, ``Q8_0``: 34 bytes a block, fp16 ``d`` then 32 int8; ``Q4_0``: 18, ``d`` then 16
        bytes of nibbles; ``Q4_1``: 20, ``d``, ``m``, 16 bytes).

        Raises:
            ValueError: a row length that is not whole blocks of ``fmt``.
        """
        block_bytes = {QuantFormat.Q8_0: 34, QuantFormat.Q4_0: 18, QuantFormat.Q4_1: 20}[fmt]
        rows = np.ascontiguousarray(blocks, dtype=np.uint8)
        if rows.ndim != 2 or rows.shape[1] % block_bytes:
            raise ValueError(f"{fmt.name}: rows of {rows.shape[-1]} bytes are not whole "
                             f"{block_bytes}-byte blocks")
        n, nb = rows.shape[0], rows.shape[1] // block_bytes
        b = rows.reshape(n, nb, block_bytes)
        scales = b[:, :, 0:2].copy().view(np.float16).reshape(n, nb)
        mins = None
        if fmt == QuantFormat.Q8_0:
            qs = (b[:, :, 2:] ^ np.uint8(0x80)).reshape(n, nb * QK)  # int8 q -> q + 128
        elif fmt == QuantFormat.Q4_0:
            qs = b[:, :, 2:].reshape(n, nb * QK // 2)
        else:
            mins = b[:, :, 2:4].copy().view(np.float16).reshape(n, nb)
            qs = b[:, :, 4:].reshape(n, nb * QK // 2)
        return cls(fmt, torch.from_numpy(np.ascontiguousarray(qs)),
                   torch.from_numpy(np.ascontiguousarray(scales)),
                   None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)))

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
        d = self.scales.numpy().view(np.uint8).reshape(n, nb, 2)
        if self.fmt == QuantFormat.Q8_0:
            parts = [d, self.qs.numpy().reshape(n, nb, QK) ^ np.uint8(0x80)]
        elif self.fmt == QuantFormat.Q4_0:
            parts = [d, self.qs.numpy().reshape(n, nb, QK // 2)]
        else:
            assert self.mins is not None
            parts = [d, self.mins.numpy().view(np.uint8).reshape(n, nb, 2),
                     self.qs.numpy().reshape(n, nb, QK // 2)]
        return np.concatenate(parts, axis=2).reshape(n, -1)

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 ``[N, K]`` (the ``gguf`` package's dequantizer)."""
        from gguf import quants
        n, k = self.shape
        return torch.from_numpy(
            np.array(quants.dequantize(self.to_blocks(), self.fmt.ggml_type),
                     dtype=np.float32).reshape(n, k))

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight rows ``index`` (a permutation or a slice), in the same format."""
        return QuantizedWeight(self.fmt, self.qs[index].contiguous(),
                               self.scales[index].contiguous(),
                               None if self.mins is None else self.mins[index].contiguous())

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of ``parts`` one after another (fused projections).

        Raises:
            ValueError: parts in different formats or with different K.
        """
        if len({(p.fmt, p.shape[1]) for p in parts}) != 1:
            raise ValueError("fused weights must share one format and K")
        mins = [p.mins for p in parts if p.mins is not None]
        return QuantizedWeight(parts[0].fmt, torch.cat([p.qs for p in parts]),
                               torch.cat([p.scales for p in parts]),
                               torch.cat(mins) if mins else None)
