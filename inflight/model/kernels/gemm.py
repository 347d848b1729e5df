"""The prompt rows' GEMM (``gemm.c``): a dense weight packed once, then any number of input
rows, each row's result the same bits whatever the batch (batch invariance on every CPU
path, including AMX, where oneDNN's GEMM changes a row's bits with the row count: issue 50).
"""

from __future__ import annotations

import torch

from inflight.model.kernels.native_lib import native_for, native_library, thread_count

# gemm_path's answers, by name (docs/architecture.md, "Batch invariance").
PATHS = {3: "AMX-BF16", 2: "AVX-512", 1: "AVX2", 0: "plain C"}


def gemm_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[N, K]`` (``nn.Linear``'s layout), float32 or bfloat16 on CPU, in
    ``gemm.c``'s panels of 32 rows (a flat tensor of the same dtype, N padded to 32 and, for
    bfloat16, K to 32). None where the library is not built or the dtype is another."""
    lib = native_for(weight)
    if lib is None or weight.dim() != 2:
        return None
    n, k = weight.shape
    is_bf16 = int(weight.dtype == torch.bfloat16)
    packed = torch.empty(int(lib.gemm_packed_size(is_bf16, n, k)), dtype=weight.dtype)
    rc = lib.gemm_pack(is_bf16, weight.detach().contiguous().data_ptr(), packed.data_ptr(), n, k)
    return packed if rc == 0 else None


def gemm_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None,
                num_threads: int | None = None) -> torch.Tensor | None:
    """``x @ W.T + bias`` over ``gemm_pack(W)``: every output one chain of products over k in
    ascending order (float32 sums, one rounding), so a row is the same bits alone or among
    thousands, on whichever path this CPU takes (``gemm_path``).

    Args:
        x: ``[M, K]`` in the packed weight's dtype, CPU, ``M >= 1``.
        packed: ``gemm_pack(W)`` of ``W`` ``[out_features, K]``; bias ``[out_features]``.
        num_threads: threads of PyTorch's pool, each over its own panels of 32 weight rows
            (default ``torch.get_num_threads()``). Results do not depend on it.

    Returns:
        ``[M, out_features]`` in x's dtype, or None where the kernel cannot take the inputs.
    """
    lib = native_for(x, packed, *([] if bias is None else [bias]))
    if lib is None or x.dim() != 2 or x.shape[0] < 1:
        return None
    x = x.contiguous()
    (m, k), n = x.shape, out_features
    is_bf16 = int(x.dtype == torch.bfloat16)
    if packed.numel() != lib.gemm_packed_size(is_bf16, n, k):
        raise ValueError(f"a packed weight of {packed.numel()} values is not [{n}, {k}]")
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.gemm_linear(is_bf16, x.data_ptr(), packed.data_ptr(),
                         None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                         thread_count(num_threads))
    return y if rc == 0 else None


def gemm_path(dtype: torch.dtype) -> str | None:
    """The path ``gemm_linear`` takes here for ``dtype`` (a name from ``PATHS``), or None
    without the library."""
    lib = native_library()
    if lib is None:
        return None
    return PATHS[int(lib.gemm_path(int(dtype == torch.bfloat16)))]
