"""The 8-bit KV cache (``--kv-cache-dtype int8`` / ``fp8``; ``model/kv_quant.py``, ``kv8.h``):
the format's values, the native write path bit for bit against PyTorch's, decode attention
over 8-bit rows against the PyTorch path, the pool's size in bytes, and accuracy on the
bundled model against a bfloat16 cache (teacher-forced top-1 agreement on held-out text).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from inflight.model import kv_quant
from inflight.model.attention import (AttentionMetadata, PrefillChunk, decode_attention_torch,
                                      write_kv)
from inflight.model.hparams import ModelConfig
from inflight.model.kernels import paged_decode_attention, reshape_and_cache
from inflight.model.kernels.native_lib import native_library
from inflight.runner import kv_block_bytes
from tests.conftest import require_data

native = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernels")
FORMATS = [torch.int8, torch.float8_e4m3fn]


def test_int8_codes_and_scale_of_an_unrotated_row():
    # head size 6 is not a power of two: stored as is, so the codes can be worked out by hand
    x = torch.tensor([[1.27, -0.5, 0.126, 0.0, 0.333, -1.0]])
    row = kv_quant.quantize_rows(x, torch.int8)
    assert row.shape == (1, 10) and row.dtype == torch.int8
    assert row[0, :6].tolist() == [127, -50, 13, 0, 33, -100]
    assert row[0, 6:].clone().view(torch.float32).item() == pytest.approx(0.01, rel=1e-6)
    zero = kv_quant.quantize_rows(torch.zeros(1, 6), torch.int8)
    assert zero.view(torch.uint8).eq(0).all()  # codes 0 and scale 0.0


@pytest.mark.parametrize("d", [2, 16, 64, 128])
def test_rotation_is_the_normalized_hadamard_transform(d):
    h = torch.ones(1, 1)
    while h.shape[0] < d:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(d))
    y = kv_quant.rotate(x)
    torch.testing.assert_close(y, x @ h.T / math.sqrt(d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kv_quant.rotate(y), x, rtol=1e-5, atol=1e-6)  # its own inverse
    assert not kv_quant.is_rotated(80) and kv_quant.rotate(torch.ones(3, 80)).eq(1).all()


@pytest.mark.parametrize("dtype,bound", [(torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 1 / 16)])
@pytest.mark.parametrize("d", [64, 80])
def test_round_trip_error_is_within_the_format(dtype, bound, d):
    x = torch.randn(200, d, generator=torch.Generator().manual_seed(3)) * 3
    x[0, 5] = 40.0  # an outlier channel
    back = kv_quant.dequantize_rows(kv_quant.quantize_rows(x, dtype), torch.float32)
    # error in the stored (rotated) space is at most half a step of the row's scale (int8) or
    # 1/16 of the row's largest value (e4m3's 3 mantissa bits); rotation keeps the norm
    amax = kv_quant.rotate(x).abs().amax(-1)
    err = (back - x).norm(dim=-1)
    assert (err <= bound * amax * math.sqrt(d) * 1.001).all()
    assert err.max() > 0


def _k_v(t, h_kv, d, dtype, seed, width=None):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (width or 2 * h_kv) * d, generator=g).to(dtype)
    qkv[:, :d] *= 20  # a large head, and rows of zeros, of tiny and of huge values
    k = qkv[:, :h_kv * d].view(t, h_kv, d)
    v = qkv[:, -h_kv * d:].view(t, h_kv, d)
    k[1] = 0
    v[2] = 1e-30
    k[3, 0] = 3e4
    return k, v


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_native_write_equals_the_pytorch_write_bit_for_bit(fmt, dtype, d):
    h_kv, nb, bs, t = 3, 12, 16, 41
    k, v = _k_v(t, h_kv, d, dtype, seed=d, width=3 * h_kv)  # strided views of a wider row
    assert not k.is_contiguous()
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(0))[:t]
    ours = torch.zeros(2, h_kv, nb, bs, d + 4, dtype=fmt)
    theirs = ours.clone()
    assert reshape_and_cache(k, v, ours, slots)
    flat = theirs.view(torch.uint8).view(2, h_kv, nb * bs, d + 4)
    for i, x in enumerate((k, v)):
        flat[i].index_copy_(1, slots, kv_quant.quantize_rows(x.transpose(0, 1), fmt)
                            .view(torch.uint8))
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@native
def test_a_slot_outside_the_cache_stores_nothing():
    cache = torch.zeros(2, 2, 4, 16, 68, dtype=torch.int8)
    k, v = _k_v(4, 2, 64, torch.float32, seed=1)
    with pytest.raises(IndexError):
        reshape_and_cache(k, v, cache, torch.tensor([0, 5, 9, 64]))
    assert cache.eq(0).all()


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,g", [(64, 3), (128, 1), (80, 4)])
def test_native_decode_attention_equals_the_pytorch_path(fmt, dtype, d, g):
    h_kv, nb, bs = 2, 40, 16
    cache = torch.zeros(2, h_kv, nb, bs, d + 4, dtype=fmt)
    gen = torch.Generator().manual_seed(d + g)
    lens = torch.tensor([1, 17, 300, 48])  # one key, a partial block, past 512 keys in all
    tables = torch.stack([torch.randperm(nb, generator=gen)[:19] for _ in lens])
    slots = torch.cat([tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
                       for b, n in enumerate(lens.tolist())])
    k = torch.randn(len(slots), h_kv, d, generator=gen).to(dtype)
    v = torch.randn(len(slots), h_kv, d, generator=gen).to(dtype)
    write_kv(cache, k, v, slots)
    q = torch.randn(len(lens), h_kv * g, d, generator=gen).to(dtype)
    ours = paged_decode_attention(q, cache, tables, lens, d ** -0.5)
    theirs = decode_attention_torch(q, cache, tables, lens, d ** -0.5)
    assert ours is not None and ours.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, theirs, **tol)


@native
def test_every_fp8_code_decodes_as_pytorch_decodes_it():
    # One key per sequence: the output is that sequence's value row, exactly
    codes = [c for c in range(256) if c & 0x7F != 0x7F]  # 0x7f, 0xff: NaN, never written
    n = -(-len(codes) // 64)
    cache = torch.zeros(2, 1, n, 1, 68, dtype=torch.float8_e4m3fn)
    raw = cache.view(torch.uint8)
    padded = codes + [0] * (64 * n - len(codes))
    raw[1, 0, :, 0, :64] = torch.tensor(padded, dtype=torch.uint8).view(n, 64)
    raw[:, 0, :, 0, 64:].view(torch.float32).fill_(1.0)
    tables = torch.arange(n)[:, None]
    out = paged_decode_attention(torch.zeros(n, 1, 64), cache, tables, torch.ones(n, dtype=torch.int64), 1.0)
    expected = kv_quant.dequantize_rows(cache[1, 0, :, 0], torch.float32)
    torch.testing.assert_close(out[:, 0], expected, rtol=1e-6, atol=0)


def test_a_block_takes_its_bytes_and_the_pool_holds_about_twice_the_tokens():
    c = ModelConfig(architecture="llama", vocab_size=10, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                    tie_word_embeddings=True, attention_bias=False)
    assert kv_block_bytes(c, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2 == 368_640
    assert kv_block_bytes(c, 16, torch.int8) == 2 * 30 * 16 * 3 * 68 == 195_840
    assert kv_block_bytes(c, 16, torch.float8_e4m3fn) == 195_840
    budget = 64 * 2**20
    assert budget // 195_840 == 342 and budget // 368_640 == 182  # 1.88x the blocks


# --- accuracy on the bundled model ---------------------------------------------------------

BS = 16


def teacher_forced_top1(model, seqs, first, kv_dtype):
    """Each sequence's first ``first`` tokens prefilled, then every later token fed as the
    next decode step's input: the model's top-1 prediction at each fed position,
    ``[num_seqs, len - 1 - first]``."""
    c, n, length = model.config, len(seqs), len(seqs[0])
    per = -(-length // BS)
    caches = [torch.zeros(2, c.num_key_value_heads, per * n, BS,
                          kv_quant.row_width(c.head_dim, kv_dtype), dtype=kv_dtype)
              for _ in range(c.num_hidden_layers)]
    tables = [torch.arange(s * per, (s + 1) * per) for s in range(n)]
    chunks = [PrefillChunk(q_start=s * first, q_end=(s + 1) * first, num_computed=0,
                           block_table=tables[s][:-(-first // BS)]) for s in range(n)]
    slots = torch.tensor([s * per * BS + p for s in range(n) for p in range(first)])
    top1 = []
    with torch.inference_mode():
        model(torch.tensor([t for s in seqs for t in s[:first]]), torch.arange(first).repeat(n),
              caches, AttentionMetadata(slot_mapping=slots, prefills=chunks))
        for p in range(first, length - 1):
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([s * per * BS + p for s in range(n)]), num_decodes=n,
                num_generated=n, decode_block_tables=torch.stack(tables),
                decode_seq_lens=torch.full((n,), p + 1))
            hidden = model(torch.tensor([s[p] for s in seqs]), torch.full((n,), p), caches, meta)
            top1.append(model.compute_logits(hidden).argmax(-1))
    return torch.stack(top1, 1)


@pytest.fixture(scope="module")
def model_and_text():
    from inflight.config import EngineConfig
    from inflight.engine.loading import load

    # float32, dense weights: the same numbers on every host's path
    loaded = load(EngineConfig(dtype="float32", quantization="none", num_kv_blocks=1,
                               max_model_len=16))
    turns = [t for line in require_data("mt_bench_questions.jsonl").read_text().splitlines()
             for t in json.loads(line)["turns"]]
    ids = loaded.tokenizer.encode("\n\n".join(turns), add_special_tokens=False)
    return loaded.runner.model, [ids[i * 512:(i + 1) * 512] for i in range(8)]


@pytest.fixture(scope="module")
def bfloat16_reference(model_and_text):
    model, seqs = model_and_text
    return teacher_forced_top1(model, seqs, 256, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype,floor", [(torch.int8, 0.99), (torch.float8_e4m3fn, 0.95)])
def test_teacher_forced_top1_agrees_with_a_bfloat16_cache(model_and_text, bfloat16_reference,
                                                          kv_dtype, floor):
    # MT-Bench's questions (text no setting was tuned on), 8 x 512 tokens, the last 255 of
    # each predicted: 2,040 predictions, about 20 s a cache dtype. Measured: int8 99.2 %, fp8
    # 97.0 % (3 mantissa bits; docs/performance.md); a float32 cache agrees with the bfloat16
    # one on 99.8 %. Fewer predictions are too coarse for a 1 % bound: at 1,016 one host
    # path gave int8 99.2 % and another 98.9 %.
    model, seqs = model_and_text
    reference = bfloat16_reference
    ours = teacher_forced_top1(model, seqs, 256, kv_dtype)
    assert (ours == reference).float().mean().item() >= floor


def test_the_dtype_is_reported_by_its_flag_name():
    # what the start-up line and cache_config_info{cache_dtype} say
    assert [kv_quant.dtype_name(d) for d in (torch.int8, torch.float8_e4m3fn, torch.bfloat16,
                                             torch.float32)] == ["int8", "fp8_e4m3", "bfloat16",
                                                                 "float32"]
