"""What the loader and the model choose on CPUs without the fast paths: the block kernels'
SIMD paths (AVX-512 VNNI, AVX2) and oneDNN's bfloat16 GEMM (AVX-512 BF16 or AVX-NE-CONVERT)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import inflight.engine.loading as loading
import inflight.model.placement as placement
from inflight.model.kernels.native_lib import use_native_kernels
from inflight.model.linear import Linear


@pytest.mark.parametrize("vectorized,expected", [(True, "gguf"), (False, "none")])
def test_auto_quantization_keeps_dense_weights_where_block_kernels_are_scalar(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vectorized: bool, expected: str) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(placement, "quantized_kernels_vectorized", lambda: vectorized)
    cpu = torch.device("cpu")
    assert loading.resolve_quantization("auto", gguf, cpu) == expected
    # An explicit choice is kept either way, and a directory is never block-quantized.
    assert loading.resolve_quantization("gguf", gguf, cpu) == "gguf"
    assert loading.resolve_quantization("auto", tmp_path, cpu) == "none"


def test_a_weight_onednn_cannot_prepack_stays_on_the_plain_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the native library (no compiler) the prompt GEMM is oneDNN's, and oneDNN
    # refuses to reorder bfloat16 weights on a CPU without bf16 support (AVX2): the layer
    # must still load and compute, through F.linear.
    def refuse(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    lin = Linear(64, 32, bias=False).to(torch.bfloat16)
    with use_native_kernels(False):
        lin.prepack()
        assert lin.packed is None and lin.gemm_packed is None
        x = torch.randn(5, 64).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
