"""The prefill kernel over an 8-bit KV cache (``prefill_attention_kv8.c``) equals causal SDPA
over the dequantized rows (``kv_quant.dequantize_rows``), for int8 and fp8 rows, float32 and
bfloat16 queries, head sizes rotated (64, 128) and not (80), and 1 to 16 query heads a KV
head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.model import kv_quant
from inflight.model.kernels import paged_prefill_attention
from inflight.model.kernels.native_lib import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernel")
FORMATS = [torch.int8, torch.float8_e4m3fn]


def sequence_cache(g: torch.Generator, fmt: torch.dtype, kv_heads: int, d: int, total: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache holding random keys/values for positions ``0 .. total - 1`` at the
    slots of a shuffled block table, other blocks random bytes; and that table."""
    width = -(-total // block_size)
    num_blocks = width + 3
    table = torch.randperm(num_blocks, generator=g)[:width]
    cache = torch.randint(0, 256, (2, kv_heads, num_blocks * block_size, d + 4), generator=g,
                          dtype=torch.uint8)
    pos = torch.arange(total)
    slots = table[pos // block_size] * block_size + pos % block_size
    kv = torch.randn(2, kv_heads, total, d, generator=g) * 2
    cache[:, :, slots] = kv_quant.quantize_rows(kv, fmt).view(torch.uint8)
    return cache.view(2, kv_heads, num_blocks, block_size, d + 4).view(fmt), table


def reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, num_computed: int,
              scale: float) -> torch.Tensor:
    """float64 SDPA of the chunk against the dequantized keys 0 .. num_computed + T - 1."""
    t, h, d = q.shape
    h_kv, row = cache.shape[1], cache.shape[4]
    total = num_computed + t
    rows = cache.view(torch.uint8)[:, :, table].reshape(2, h_kv, -1, row)[:, :, :total]
    kv = kv_quant.dequantize_rows(rows.view(cache.dtype), torch.float32).double()
    k, v = kv[0].repeat_interleave(h // h_kv, 0), kv[1].repeat_interleave(h // h_kv, 0)
    mask = torch.arange(total)[None, :] <= torch.arange(num_computed, total)[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


def strided_queries(g: torch.Generator, t: int, heads: int, kv_heads: int, d: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """q as the model hands it over: the first heads of a fused q/k/v projection's output."""
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=g).to(dtype)
    return qkv[:, :heads]


# (head size, query heads, KV heads, chunk tokens, cached tokens, block size)
SHAPES = [
    (64, 9, 3, 1, 0, 16),      # one token, nothing cached
    (64, 9, 3, 150, 0, 16),    # a fresh prompt over three query tiles of 64 tokens, G = 3
    (128, 16, 1, 40, 23, 16),  # G = 16 (tiles of 12 tokens), a partial last block
    (80, 3, 3, 70, 5, 16),     # G = 1, a head size stored unrotated, odd in 16s
    (128, 6, 2, 1, 100, 16),   # one token after a cached prefix
    (64, 9, 3, 33, 47, 8),     # small blocks, chunk and prefix both ragged
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,heads,kv_heads,t,num_computed,block_size", SHAPES)
def test_kernel_matches_sdpa_over_dequantized_rows(fmt, dtype, d, heads, kv_heads, t,
                                                   num_computed, block_size):
    g = torch.Generator().manual_seed(d * 1000 + t * 10 + num_computed)
    cache, table = sequence_cache(g, fmt, kv_heads, d, num_computed + t, block_size)
    q = strided_queries(g, t, heads, kv_heads, d, dtype)
    scale = d ** -0.5
    ours = paged_prefill_attention(q, cache, table, num_computed, scale)
    assert ours is not None and ours.dtype == dtype and ours.shape == (t, heads, d)
    want = reference(q, cache, table, num_computed, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    else:  # float32 sums, one rounding to bfloat16 (a relative 2^-9 at most)
        torch.testing.assert_close(ours.double(), want, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_threads_give_identical_output(fmt):
    # Each row's sums run over the same key tiles in the same order whatever the query tiles
    # (fewer tokens a tile where threads would idle), so the bits do not depend on threads.
    g = torch.Generator().manual_seed(7)
    cache, table = sequence_cache(g, fmt, 3, 64, 90, 16)
    q = strided_queries(g, 60, 9, 3, 64, torch.float32)
    outs = [paged_prefill_attention(q, cache, table, 30, 0.125, num_threads=n)
            for n in (1, 2, 5, 64)]
    assert all(o is not None for o in outs)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_more_threads_than_work():
    g = torch.Generator().manual_seed(3)
    cache, table = sequence_cache(g, torch.int8, 1, 64, 20, 16)
    q = strided_queries(g, 1, 2, 1, 64, torch.float32)
    ours = paged_prefill_attention(q, cache, table, 19, 0.125, num_threads=16)
    assert ours is not None
    torch.testing.assert_close(ours.double(), reference(q, cache, table, 19, 0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,heads,kv_heads", [(64, 17, 1), (264, 2, 1)])
def test_unsupported_shapes_fall_back(d, heads, kv_heads):
    # more than 16 query heads a KV head, or a head size over 256: None, the caller's SDPA runs
    g = torch.Generator().manual_seed(d)
    cache, table = sequence_cache(g, torch.int8, kv_heads, d, 4, 16)
    q = strided_queries(g, 4, heads, kv_heads, d, torch.float32)
    assert paged_prefill_attention(q, cache, table, 0, 0.125) is None
