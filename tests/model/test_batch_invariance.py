"""The pieces batch invariance rests on (issue 34; ``model/linear.py``, ``GENERATED_ROWS``):
a dense Linear sends a step's leading generated rows to the skinny kernel and the rest to
the prompt GEMM (``kernels/gemm.c``), and a row's result on either path does not depend on
the rows beside it. The skinny kernel's own tests are in tests/model/test_linear_kernel.py.

Each GEMM path is named and run wherever this CPU can run it (``gemm_max_path`` caps the
library at a path): AMX-BF16 tiles (bfloat16 on a Xeon with AMX), AVX-512, AVX2 + FMA,
plain C. A path this CPU cannot run is reported as a skip that names it, never passed in
silence; an AMX host runs all four. oneDNN's GEMM, which the model no longer uses for it,
gave the first 16 rows other bits alone than inside 400 with AMX (issue 50)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import inflight.model.linear as linear
from inflight.model.kernels import skinny_linear
from inflight.model.kernels.gemm import PATHS, gemm_linear, gemm_pack, gemm_path
from inflight.model.kernels.native_lib import isa_path, native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernels")

# SmolLM2-135M: qkv, o_proj, gate_up, down_proj ([N, K] as nn.Linear keeps them); then tails
# in N and K (K not a multiple of 32: bfloat16 reads a padded copy).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 45)]
# Slices of a 400-row batch: a row alone, short and long runs, a partial 32-row AMX block,
# the register blocks' tails, and all but one.
SLICES = [(0, 1), (0, 3), (5, 6), (0, 16), (7, 40), (100, 229), (0, 399)]


@contextlib.contextmanager
def gemm_capped(name: str, dtype: torch.dtype):
    """The library held to the path called ``name`` for ``dtype``; skips, naming the path,
    where this CPU cannot run it."""
    lib = native_library()
    level = next(k for k, v in PATHS.items() if v == name)
    before = lib.gemm_max_path(level)
    try:
        if gemm_path(dtype) != name:
            pytest.skip(f"the kernels here ({isa_path()} path) cannot run the {name} path for "
                        f"{dtype} (they take {gemm_path(dtype)} at most); a host that has it "
                        f"runs this case")
        yield
    finally:
        lib.gemm_max_path(before)


def make_linear(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = linear.Linear(k, n, bias=True)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        m.bias.copy_(torch.randn(n, generator=g))
    m = m.to(dtype)
    m.prepack()
    return m


@pytest.mark.parametrize("path", list(PATHS.values()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_gemm_gives_a_row_the_same_bits_in_any_batch(path, dtype, n, k):
    if path == "AMX-BF16" and dtype == torch.float32:
        pytest.skip("AMX-BF16 takes bfloat16 alone: float32 runs AVX-512 on an AMX host")
    m = make_linear(n, k, dtype)
    x = torch.randn(400, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode(), gemm_capped(path, dtype):
        full = m._gemm(x)
        for lo, hi in SLICES:
            assert torch.equal(m._gemm(x[lo:hi]), full[lo:hi]), (lo, hi)
        assert torch.equal(gemm_linear(x, m.gemm_packed, n, m.bias, num_threads=1), full)
        # and it is the product: float32 sums of K products against float64, then the
        # output's rounding (bfloat16: half an ulp of values up to ~5)
        ref = x.double() @ m.weight.double().T + m.bias.double()
        tol = 1e-5 * k ** 0.5 if dtype == torch.float32 else 2e-2
        assert (full.double() - ref).abs().max().item() < tol


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
            assert torch.equal(y[:generated], skinny_linear(x[:generated], m.weight, m.bias)
                               if generated else y[:0])
            assert torch.equal(y[generated:], gemm_linear(x[generated:], m.gemm_packed, 960,
                                                          m.bias) if generated < 40 else y[:0])
        # A generated row is the same bits alone and among 40.
        token = linear.GENERATED_ROWS.set(1)
        try:
            alone = m(x[17:18])
        finally:
            linear.GENERATED_ROWS.reset(token)
        assert torch.equal(alone[0], skinny_linear(x, m.weight, m.bias)[17])


def test_the_gemm_refuses_a_packed_weight_of_another_shape():
    m = make_linear(64, 96, torch.float32)
    with pytest.raises(ValueError, match="not \\[64, 95\\]"):
        gemm_linear(torch.randn(3, 95), m.gemm_packed, 64)
    assert gemm_pack(torch.randn(4, 8, dtype=torch.float16)) is None
