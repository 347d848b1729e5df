"""The pieces batch invariance rests on (issue 34; ``model/linear.py``, ``GENERATED_ROWS``):
a dense Linear sends a step's leading generated rows to the skinny kernel and the rest to
oneDNN's GEMM, and a row's result on either path does not depend on the rows beside it.
The skinny kernel reduces each row alone by construction (tests/model/test_linear_kernel.py);
oneDNN's GEMM is a library, so what the model relies on is checked here, on this host's
instruction set, for the bundled model's shapes."""

from __future__ import annotations

import pytest
import torch

import inflight.model.linear as linear
from inflight.model.kernels import skinny_linear
from inflight.model.kernels.native_lib import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernels")

# SmolLM2-135M: qkv, o_proj, gate_up, down_proj ([N, K] as nn.Linear keeps them).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def make_linear(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = linear.Linear(k, n, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
    m = m.to(dtype)
    m.prepack()
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_gemm_gives_a_row_the_same_bits_in_any_batch(dtype, n, k):
    m = make_linear(n, k, dtype)
    x = torch.randn(400, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        full = m._gemm(x)
        for lo, hi in [(0, 1), (0, 3), (5, 6), (0, 16), (7, 40), (100, 229), (0, 399)]:
            assert torch.equal(m._gemm(x[lo:hi]), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generated_rows_take_the_row_kernel_and_prompt_rows_the_gemm(dtype):
    m = make_linear(960, 576, dtype)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        for generated in (0, 1, 9, 40):
            token = linear.GENERATED_ROWS.set(generated)
            try:
                y = m(x)
            finally:
                linear.GENERATED_ROWS.reset(token)
            assert torch.equal(y[:generated], skinny_linear(x[:generated], m.weight)
                               if generated else y[:0])
            assert torch.equal(y[generated:], m._gemm(x[generated:]))
        # A generated row is the same bits alone and among 40.
        token = linear.GENERATED_ROWS.set(1)
        try:
            alone = m(x[17:18])
        finally:
            linear.GENERATED_ROWS.reset(token)
        assert torch.equal(alone[0], skinny_linear(x, m.weight)[17])
