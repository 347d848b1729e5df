"""The wrappers of ``quant_linear.c``: a linear layer over a block-quantized weight, and rows
of one dequantized (token embeddings read from the blocks). None where the library is not
built or the kernel does not take the inputs; the callers then use dense values."""

from __future__ import annotations

import torch

from inflight.model.kernels.native_lib import native_for, native_library, thread_count
from inflight.model.quant import QuantizedParts, QuantizedWeight


def quant_linear(x: torch.Tensor, weight: QuantizedWeight | QuantizedParts,
                 bias: torch.Tensor | None = None, num_threads: int | None = None,
                 ) -> torch.Tensor | None:
    """``x @ W.T + bias`` with ``W`` in a block format, for a few rows (``quant_linear.c``):
    each 32-value block of ``x`` quantized to int8 (ggml's Q8_0), integer dot products per
    block, both scales applied in float32 (llama.cpp's CPU scheme). The dot products run on
    AVX512-VNNI, or from 24 rows on AMX-INT8 tiles where the CPU has them (the same bits).

    Args:
        x: ``[M, K]`` float32 or bfloat16, CPU, K a multiple of 32.
        weight: ``[N, K]`` packed blocks (``model/quant.QuantizedWeight``), or parts in
            different formats (``QuantizedParts``: each part's call in turn, side by side).
        bias: ``[N]`` in x's dtype, or None.
        num_threads: as ``skinny_linear``; results do not depend on it.

    Returns:
        ``[M, N]`` in x's dtype (float32 sums, one rounding), or None where the kernel does
        not take these inputs (then the caller multiplies the dequantized weight).
    """
    if isinstance(weight, QuantizedParts):
        outs, r0 = [], 0
        for part in weight.parts:
            r1 = r0 + part.num_rows
            outs.append(quant_linear(x, part, None if bias is None else bias[r0:r1], num_threads))
            r0 = r1
        return None if any(y is None for y in outs) else torch.cat(outs, dim=1)
    lib = native_for(x, *([] if bias is None else [bias]))
    if lib is None or x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != weight.shape[1]:
        return None
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    m, (n, k) = x.shape[0], weight.shape
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.quant_linear(int(weight.fmt), int(x.dtype == torch.bfloat16), x.data_ptr(),
                          weight.qs.data_ptr(), weight.scales.data_ptr(),
                          None if weight.mins is None else weight.mins.data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                          thread_count(num_threads))
    return y if rc == 0 else None


def quant_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows ``ids`` of a block-quantized weight, dequantized (``quant_linear.c``'s
    ``quant_rows``): the token embeddings of a model that keeps its embedding matrix as the
    (tied) LM head's blocks.

    Args:
        weight: ``[N, K]`` packed blocks.
        ids: int64 row indices, any shape.

    Returns:
        float32 ``[*ids.shape, K]``, each value the ``gguf`` package's ``dequantize`` to the
        bit (``weight.dequantize()[ids]``), or None without the native library.

    Raises:
        IndexError: an id outside ``[0, N)``.
    """
    lib = native_library()
    if lib is None:
        return None
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    n, k = weight.shape
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    if lib.quant_rows(int(weight.fmt), weight.qs.data_ptr(), weight.scales.data_ptr(),
                      None if weight.mins is None else weight.mins.data_ptr(), flat.data_ptr(),
                      flat.numel(), n, k, out.data_ptr()):
        raise IndexError(f"token ids outside [0, {n}): "
                         f"{sorted({int(i) for i in flat if not 0 <= i < n})[:5]}")
    return out.reshape(*ids.shape, k)
