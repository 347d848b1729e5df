"""The native paged decode-attention kernel equals the PyTorch path (gather + SDPA)."""

from __future__ import annotations

import os

import pytest
import torch

from inflight.model.attention import decode_attention_torch
from inflight.model.kernels import paged_decode_attention
from inflight.model.kernels.native_lib import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernel")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 4), (14, 2, 64, 1)])
def test_native_decode_attention_matches_torch(dtype, atol, heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    batch = 7
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 5, 40])
    width = -(-int(lens.max()) // block_size)
    num_blocks = batch * width + 5
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    ours = paged_decode_attention(q, cache, tables, lens, scale)
    ref = decode_attention_torch(q.float(), cache.float(), tables, lens, scale)
    assert ours is not None and ours.dtype == dtype and ours.shape == q.shape
    torch.testing.assert_close(ours.float(), ref, atol=atol, rtol=0)


def test_unsupported_inputs_fall_back():
    q = torch.randn(2, 4, 32)
    cache = torch.randn(2, 4, 8, 4, 32, dtype=torch.bfloat16)   # dtype mismatch
    tables = torch.zeros(2, 1, dtype=torch.long)
    assert paged_decode_attention(q, cache, tables, torch.tensor([1, 1]), 1.0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3, 16])
def test_threads_give_identical_output(dtype, threads, monkeypatch):
    import inflight.model.kernels as kernels
    g = torch.Generator().manual_seed(threads)
    lens = torch.tensor([40, 1, 17, 33, 2, 64, 5, 16, 31])
    batch, width, bs = lens.shape[0], 4, 16
    cache = torch.randn(2, 3, batch * width, bs, 64, generator=g).to(dtype)
    tables = torch.randperm(batch * width, generator=g).view(batch, width)
    q = torch.randn(batch, 9, 64, generator=g).to(dtype)
    whole = paged_decode_attention(q, cache, tables, lens, 0.125, num_threads=1)
    monkeypatch.setattr(kernels, "MIN_KEYS_PER_THREAD", 1)  # split even this small batch
    split = paged_decode_attention(q, cache, tables, lens, 0.125, num_threads=threads)
    assert torch.equal(split, whole)  # (sequence, head) pairs are independent: bit-identical


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_kernels_run_on_pytorchs_openmp_runtime():
    # The kernels' threads must come from the OpenMP runtime PyTorch loaded: a second
    # runtime would bring a second pool whose threads fight PyTorch's for the cores.
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes  # the kernels are built with -fopenmp
