"""The native RMSNorm equals HF's LlamaRMSNorm arithmetic (normalize in float32, round to
the input dtype, then scale by the weight) and, with ``scale_in_float32``, Gemma3RMSNorm's
(scale in float32, one rounding)."""

from __future__ import annotations

import pytest
import torch

from inflight.model.kernels import rms_norm
from inflight.model.kernels.native_lib import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernel")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                scale_in_float32: bool = False) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:  # Gemma3RMSNorm, its 1 + w already in the weight
        return (h * weight.float()).to(x.dtype)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("scale_in_float32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 576), (7, 64), (300, 576), (3, 33), (5, 256)])
def test_rms_norm_matches_hf(dtype, t, d, scale_in_float32):
    g = torch.Generator().manual_seed(t + d)
    x = (3 * torch.randn(t, d, generator=g)).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    ours = rms_norm(x, w, 1e-5, scale_in_float32=scale_in_float32)
    ref = hf_rms_norm(x, w, 1e-5, scale_in_float32)
    assert ours is not None and ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-6)
    else:  # the sum of squares is added in another order: at most one bfloat16 step apart
        diff = (ours.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2 ** -7 + 1e-6).all()
        assert (ours == ref).float().mean() > 0.99


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_identical_output(threads):
    x, w = torch.randn(500, 576), torch.randn(576)  # 288K elements: up to 4 threads
    assert torch.equal(rms_norm(x, w, 1e-6, num_threads=threads), rms_norm(x, w, 1e-6, num_threads=1))


def test_unsupported_inputs_fall_back():
    assert rms_norm(torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16), 1e-6) is None
    assert rms_norm(torch.randn(2, 3, 8), torch.randn(8), 1e-6) is None
