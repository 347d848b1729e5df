"""The native skinny linear kernel equals ``F.linear`` on the rows it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.model.kernels import skinny_linear, skinny_max_rows
from inflight.model.kernels.native_lib import isa_path, native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 37])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 576), (64, 40), (7, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_float64_reference(dtype, m, n, k, with_bias):
    # Shapes cover the vector paths (K a multiple of 32 / 16), their tails (N % 4 != 0) and
    # the plain-C path (K = 33); M = 5, 16 and 37 go in groups of rows (4 or 8 a group).
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    ours = skinny_linear(x, w, b)
    assert ours is not None and ours.dtype == dtype and ours.shape == (m, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 accumulation of K products; bfloat16 adds one rounding of the output.
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(ours.double(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_threads_give_identical_output(dtype, threads):
    g = torch.Generator().manual_seed(threads)
    x, w = torch.randn(2, 576, generator=g).to(dtype), torch.randn(110, 576, generator=g).to(dtype)
    one = skinny_linear(x, w, num_threads=1)
    assert torch.equal(skinny_linear(x, w, num_threads=threads), one)  # rows are independent


def test_unsupported_inputs_fall_back():
    w = torch.randn(8, 16)
    assert skinny_linear(torch.randn(1, 16, dtype=torch.bfloat16), w) is None  # dtype mismatch
    assert skinny_linear(torch.randn(1, 16), w.t().contiguous().t()) is None  # strided weight
    assert skinny_linear(torch.randn(1, 16, dtype=torch.float16),
                         w.half()) is None                                    # float16


def test_row_limit_follows_the_instruction_set():
    # AVX-512: oneDNN's GEMM wins from 3 rows; AVX2 alone: the kernel keeps 8 (its AVX2 path).
    # The path the library was built for: this CPU's own, or the one emulated.
    path = isa_path()
    if path is None:
        pytest.skip("this CPU takes none of the AMX / AVX-512 / AVX2 paths")
    assert skinny_max_rows() == (8 if path == "avx2" else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(960, 576), (1536, 576), (576, 1536), (7, 33)])
def test_a_row_does_not_depend_on_the_rows_beside_it(dtype, n, k):
    # Batch invariance: every row is reduced in the same order whatever M is and wherever
    # the row sits, so a prompt's rows are the same bits in one chunk or many, a decode row
    # alone or among 300 others, and a recomputed row after preemption equals its decode.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    full = skinny_linear(x, w)
    assert full is not None
    for lo, hi in [(0, 1), (0, 2), (0, 5), (0, 8), (0, 9), (0, 16), (3, 4), (7, 40),
                   (11, 300), (299, 300), (100, 229)]:
        part = skinny_linear(x[lo:hi], w)
        assert part is not None and torch.equal(part, full[lo:hi]), (lo, hi)
    for threads in (1, 3):
        assert torch.equal(skinny_linear(x, w, num_threads=threads), full)
