"""Paged attention over a block-structured KV cache, in plain PyTorch.

Follows PagedAttention (Kwon et al., SOSP 2023): each layer's cache is one preallocated
tensor ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` (keys, values); a request's
tokens live in the blocks its block table names, token ``p`` at slot
``block_table[p // block_size] * block_size + p % block_size``. Heads come before blocks so
that gathering a batch's blocks (one ``index_select``) yields ``[heads, batch, tokens, dim]``
with no transposing copy before the attention matmuls.

The step's tokens arrive flattened, decodes first (one query token each), then prefill
chunks (one or more tokens each, with ``num_computed`` tokens already cached before them)::

    tokens:   [ d0 d1 ... d(B-1) | p0 p0 p0 p0 | p1 p1 ... ]
               decode rows         prefill chunk  prefill chunk
                                   q_start..q_end

Decodes attend in one batched call over their gathered blocks; each prefill chunk attends
causally, offset by what it already has cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inflight.model import kv_quant
from inflight.model.kernels import (paged_decode_attention, paged_prefill_attention,
                                   reshape_and_cache)
from inflight.profiling import NULL_TIMER, StepTimer


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens in the flattened batch.

    Attributes:
        q_start, q_end: rows ``[q_start, q_end)`` of the flattened batch (tokens).
        num_computed: tokens of this request already in the KV cache before the chunk.
        block_table: ``[num_blocks]`` int64 block ids covering ``num_computed + chunk`` tokens.
    """

    q_start: int
    q_end: int
    num_computed: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where each token's K/V go and what each query attends to, for one step.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, cache slot of every new token.
        num_decodes: the first ``num_decodes`` rows are single-token decodes.
        num_generated: the first ``num_generated`` of those compute generated (output)
            tokens, the rest a prompt's last token; linear layers with block-quantized
            weights use them for these rows only (``linear.GENERATED_ROWS``).
        decode_block_tables: ``[num_decodes, max_blocks]`` int64, padded with block 0.
        decode_seq_lens: ``[num_decodes]`` int64, context length including the new token.
        prefills: the prefill chunks, in row order after the decodes.
        timer: the step's timer (``attention`` phase); a disabled one by default.
    """

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    num_generated: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    timer: StepTimer = NULL_TIMER


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    if reshape_and_cache(k, v, kv_cache, slot_mapping):  # native, on CPU
        return
    _, h, num_blocks, block_size, row = kv_cache.shape
    quantized = kv_quant.is_8bit(kv_cache.dtype)
    # As bytes where 8-bit: PyTorch's index ops have no float8 kernels.
    flat = (kv_cache.view(torch.uint8) if quantized else kv_cache).view(
        2, h, num_blocks * block_size, row)
    for i, x in enumerate((k, v)):
        x = x.transpose(0, 1)
        stored = (kv_quant.quantize_rows(x, kv_cache.dtype).view(torch.uint8) if quantized
                  else x.to(kv_cache.dtype))
        flat[i].index_copy_(1, slot_mapping, stored)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """Attention for one layer over the paged cache (``k``/``v`` already written).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` queries, RoPE applied.
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` the step's new keys/values (used
            directly for prefill chunks with nothing cached before them).
        kv_cache: this layer's cache, ``[2, num_kv_heads, num_blocks, block_size, head_dim]``
            (or an 8-bit one: ``kv_quant``).
        meta: the step's ``AttentionMetadata``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: a sliding window: a query at position ``p`` sees keys ``p - window + 1 ..
            p`` (HF's ``sliding_window``); None: all keys up to ``p``.

    Returns:
        ``[num_tokens, num_heads * head_dim]`` in ``q``'s dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    if meta.num_decodes == num_tokens:  # a pure decode step: no copy into a shared output
        return _decode_attention(q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                 scale, window).view(num_tokens, -1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
    if meta.num_decodes:
        nd = meta.num_decodes
        out[:nd] = _decode_attention(q[:nd], kv_cache, meta.decode_block_tables,
                                     meta.decode_seq_lens, scale, window)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, chunk, scale, window)
    return out.view(num_tokens, num_heads * head_dim)


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Cache rows of ``block_ids`` (flat ``[n]``): ``[2, num_kv_heads, n * block_size, row]``
    (``row``: ``head_dim``, or an 8-bit cache's codes and scale)."""
    h, d = kv_cache.shape[1], kv_cache.shape[4]
    if kv_quant.is_8bit(kv_cache.dtype):  # as bytes: PyTorch's index ops have no float8 kernels
        rows = kv_cache.view(torch.uint8).index_select(2, block_ids).view(kv_cache.dtype)
        return rows.view(2, h, -1, d)
    return kv_cache.index_select(2, block_ids).view(2, h, -1, d)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    out = paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, window=window)
    if out is not None:  # the native kernel reads the blocks in place, without a gather
        return out
    return decode_attention_torch(q, kv_cache, block_tables, seq_lens, scale, window)


def decode_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """Decode attention in PyTorch (any device): gather the blocks, then one batched SDPA.

    Shapes as ``inflight.model.kernels.paged_decode_attention``; ``window`` as
    ``paged_attention``'s (the query sits at position ``seq_len - 1``).
    """
    b, num_heads, d = q.shape
    h_kv, row = kv_cache.shape[1], kv_cache.shape[4]
    kv = _gather_blocks(kv_cache, block_tables.reshape(-1)).view(2, h_kv, b, -1, row)
    keys, values = kv_quant.as_values(kv[0], q.dtype), kv_quant.as_values(kv[1], q.dtype)
    # Query heads sharing a KV head become that head's "query rows", so grouped-query
    # attention needs no repeated K/V: q [Hkv, B, G, D] against k [Hkv, B, L, D].
    qg = q.view(b, h_kv, num_heads // h_kv, d).transpose(0, 1)
    pos = torch.arange(kv.shape[3], device=q.device)[None, :]
    mask = pos < seq_lens[:, None]
    if window is not None:
        mask &= pos >= seq_lens[:, None] - window
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask[None, :, None, :],
                                       scale=scale)
    return o.transpose(0, 1).reshape(b, num_heads, d)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                       window: int | None) -> torch.Tensor:
    out = paged_prefill_attention(q, kv_cache, chunk.block_table, chunk.num_computed, scale,
                                  window=window)
    if out is not None:  # the native kernel reads the cached blocks in place
        return out
    t = q.shape[0]
    # An 8-bit cache is read back even for a fresh prompt, as the native kernel reads it: a
    # prompt then attends to the same values whether it was cut into chunks or not.
    if chunk.num_computed == 0 and not kv_quant.is_8bit(kv_cache.dtype) and window is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        mask, causal = None, True
    else:
        total = chunk.num_computed + t
        kv = _gather_blocks(kv_cache, chunk.block_table)[:, :, :total]
        keys, values = kv_quant.as_values(kv[0], q.dtype), kv_quant.as_values(kv[1], q.dtype)
        # Query i sits at position num_computed + i and sees keys 0..num_computed + i (the
        # last ``window`` of them in a windowed layer).
        q_pos = torch.arange(chunk.num_computed, total, device=q.device)
        key_pos = torch.arange(total, device=q.device)[None, :]
        mask = key_pos <= q_pos[:, None]
        if window is not None:
            mask &= key_pos > q_pos[:, None] - window
        causal = False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0).to(q.dtype),
        values.unsqueeze(0).to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=True)
    return o[0].transpose(0, 1)
