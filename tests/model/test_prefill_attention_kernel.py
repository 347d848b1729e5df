"""The native paged prefill-attention kernel equals causal SDPA over the gathered keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.model.kernels import paged_prefill_attention
from inflight.model.kernels.native_lib import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernel")


def reference(q, cache, table, num_computed, scale):
    """float64 SDPA of the chunk against keys 0 .. num_computed + T - 1, gathered."""
    t, h, d = q.shape
    h_kv, bs = cache.shape[1], cache.shape[3]
    total = num_computed + t
    kv = cache.double()[:, :, table].reshape(2, h_kv, -1, d)[:, :, :total]
    k, v = kv[0].repeat_interleave(h // h_kv, 0), kv[1].repeat_interleave(h // h_kv, 0)
    mask = torch.arange(total)[None, :] <= torch.arange(num_computed, total)[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


def kernel_applies() -> bool:
    q, cache = torch.randn(1, 1, 64), torch.randn(2, 1, 1, 16, 64)
    return paged_prefill_attention(q, cache, torch.zeros(1, dtype=torch.long), 0, 1.0) is not None


needs_kernel = pytest.mark.skipif(not kernel_applies(), reason="no native prefill kernel here")


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,num_computed", [(1, 0), (5, 0), (16, 0), (40, 0), (1, 33), (17, 7),
                                            (33, 48)])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(9, 3, 16), (4, 4, 4), (14, 2, 16)])
def test_prefill_kernel_matches_sdpa(dtype, atol, t, num_computed, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(t * 100 + num_computed + heads)
    total = num_computed + t
    width = -(-total // block_size)
    num_blocks = width + 6
    cache = torch.randn(2, kv_heads, num_blocks, block_size, 64, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:width]
    # q as the model hands it over: a strided view of a fused projection output
    qk = torch.randn(t, heads + kv_heads, 64, generator=g).to(dtype)
    q = qk[:, :heads]
    ours = paged_prefill_attention(q, cache, table, num_computed, 0.125)
    assert ours is not None and ours.dtype == dtype and ours.shape == q.shape
    torch.testing.assert_close(ours.double(), reference(q, cache, table, num_computed, 0.125),
                               atol=atol, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_threads_give_identical_output(threads, dtype):
    g = torch.Generator().manual_seed(threads)
    cache = torch.randn(2, 3, 20, 16, 64, generator=g).to(dtype)
    table = torch.randperm(20, generator=g)
    q = torch.randn(70, 9, 64, generator=g).to(dtype)
    one = paged_prefill_attention(q, cache, table, 100, 0.125, num_threads=1)
    assert torch.equal(paged_prefill_attention(q, cache, table, 100, 0.125, num_threads=threads), one)


def test_other_head_sizes_take_the_portable_kernel_up_to_256():
    g = torch.Generator().manual_seed(3)
    q, cache = torch.randn(3, 2, 32, generator=g), torch.randn(2, 2, 4, 16, 32, generator=g)
    ours = paged_prefill_attention(q, cache, torch.arange(4), 20, 1.0)
    assert ours is not None
    torch.testing.assert_close(ours.double(), reference(q, cache, torch.arange(4), 20, 1.0),
                               atol=1e-5, rtol=0)
    q, cache = torch.randn(3, 2, 264), torch.randn(2, 2, 4, 16, 264)
    assert paged_prefill_attention(q, cache, torch.arange(4), 0, 1.0) is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_however_the_prompt_was_cut(dtype):
    # Batch invariance: keys go in tiles from position 0 whatever the chunk, so a prompt's
    # rows in one chunk equal its rows computed in chunks after a prefix (cut, prefix hit).
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 3, 20, 16, 64, generator=g).to(dtype)
    table = torch.randperm(20, generator=g)
    q = torch.randn(150, 9, 64, generator=g).to(dtype)
    whole = paged_prefill_attention(q, cache, table, 0, 0.125)
    for cuts in ([0, 1, 150], [0, 17, 64, 65, 150], [0, 100, 149, 150], [0, 48, 96, 150]):
        parts = [paged_prefill_attention(q[a:b], cache, table, a, 0.125)
                 for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts
