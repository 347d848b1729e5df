"""The one-call decode path (decode_layers.c) is bit-identical to the per-module path.

A tiny random model prefills two prompts through the modules; then decode steps of one and
of two sequences run through the C stack on one copy of the KV cache and through the modules
on another. Hidden states and every layer's cache must match exactly, in float32 and
bfloat16, with and without a QKV bias (Qwen2), with dense weights and with every block
format of ``--quantization`` (then for any number of sequences), with a GGUF's mix of
K-quant and legacy formats as Q4_K_M files have them (fused layers of parts in different
formats too), and for every family's layer: Q/K norms (Qwen3), sliding windows shorter than
the sequences (Mistral), and Gemma 3's sandwich norms, tanh GELU, windowed layers with a
RoPE base of their own beside a global one.
"""

from __future__ import annotations

import pytest
import torch

import inflight.model.llama as llama
from inflight.model.attention import AttentionMetadata, PrefillChunk
from inflight.model.hparams import ModelConfig
from inflight.model.kernels.native_lib import native_library
from inflight.model.llama import LlamaForCausalLM
from inflight.model.quant import QuantFormat, QuantizedParts
from inflight.profiling import NULL_TIMER, StepTimer
from tests.model.quant_blocks import sample_blocks

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernels")

BS, NUM_BLOCKS, BLOCKS_PER_SEQ = 4, 120, 6


# A Q4_K_M file's choices per projection (llama.cpp's llama-quant.cpp: Q6_K for half the
# down projections, Q5_0 where a row is not whole 256-value super-blocks), with Q5_K in.
MIXED_FORMATS = {"q_proj": QuantFormat.Q5_0, "k_proj": QuantFormat.Q5_0,
                 "v_proj": QuantFormat.Q5_0, "o_proj": QuantFormat.Q4_K,
                 "gate_proj": QuantFormat.Q5_K, "up_proj": QuantFormat.Q5_K,
                 "down_proj": (QuantFormat.Q6_K, QuantFormat.Q4_K), "lm_head": QuantFormat.Q8_0}


# Each family's departures from the tiny Llama below (windows of 5 keys: the prompts and
# decodes run past them).
FAMILIES = {
    "llama": {},
    "qwen3": dict(architecture="qwen3"),
    "mistral_window": dict(sliding_window=5),
    "gemma3": dict(architecture="gemma3", sliding_window=5, rope_theta=1e6,
                   rope_local_theta=10000.0, query_pre_attn_scalar=24.0,
                   layer_types=("sliding_attention", "full_attention", "sliding_attention")),
}


def make_model(dtype, bias, quantization="none", family="llama"):
    """A tiny random model of ``family`` (``FAMILIES``); ``quantization`` ``mixed``: its
    weights as GGUF blocks in ``MIXED_FORMATS`` (sizes in whole super-blocks), loaded with
    ``gguf``, the values those blocks hold; ``mixed_parts``: the same with Q8_0 values
    beside Q5_0 queries and keys in odd layers (fused layers of parts in different
    formats)."""
    mixed = quantization.startswith("mixed")
    formats = dict(MIXED_FORMATS)
    if quantization == "mixed_parts":
        formats["v_proj"] = (QuantFormat.Q5_0, QuantFormat.Q8_0)
    size = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64,
                vocab_size=160) if mixed else dict(hidden_size=64, intermediate_size=96,
                                                   num_attention_heads=6, head_dim=16,
                                                   vocab_size=101)
    config = ModelConfig(**{**dict(
        architecture="llama", num_hidden_layers=3, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
        attention_bias=bias, **size), **FAMILIES[family]})
    model = LlamaForCausalLM(config, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    state = {}
    for name, p in model.named_parameters():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q, kv = config.q_size, config.kv_size
            rest = name.removesuffix("qkv_proj.weight").removesuffix("qkv_proj.bias")
            suffix = name.rpartition(".")[2]
            for part, size in (("q", q), ("k", kv), ("v", kv)):
                state[f"model.{rest}{part}_proj.{suffix}"] = torch.randn(
                    (size, *p.shape[1:]), generator=g) * 0.2
        elif name.endswith("gate_up_proj.weight"):
            rest = name.removesuffix("gate_up_proj.weight")
            for part in ("gate", "up"):
                state[f"model.{rest}{part}_proj.weight"] = torch.randn(
                    (p.shape[0] // 2, p.shape[1]), generator=g) * 0.2
        else:
            hf = name if name.startswith("lm_head") else "model." + name
            state[hf] = torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 1.0)
    if not mixed:
        model.load_weights(state, quantization)
        return model
    blocks = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        proj = name.rpartition(".weight")[0].rpartition(".")[2]
        if w.dim() != 2 or proj not in formats:
            continue
        fmt = formats[proj]
        if isinstance(fmt, tuple):  # by layer, as Q4_K_M alternates them
            fmt = fmt[int(name.split(".")[2]) % 2]
        rows = sample_blocks(fmt, w.shape[0], w.shape[1], seed=i, scale=0.2)
        blocks[name] = (fmt.ggml_type, torch.from_numpy(rows))
        from gguf import quants
        state[name] = torch.from_numpy(quants.dequantize(rows, fmt.ggml_type).reshape(w.shape))
    model.load_weights(state, "gguf", blocks)
    model.dense_state = state  # the values the blocks hold, for a dense twin
    return model


def table(seq):
    return torch.arange(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ)


def slot(seq, pos):
    return int(table(seq)[pos // BS]) * BS + pos % BS


def prefill(model, prompts, kv_caches):
    ids = torch.cat([torch.tensor(p) for p in prompts])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    chunks, start = [], 0
    for s, p in enumerate(prompts):
        chunks.append(PrefillChunk(q_start=start, q_end=start + len(p), num_computed=0,
                                   block_table=table(s)[:-(-len(p) // BS)]))
        start += len(p)
    slots = torch.tensor([slot(s, i) for s, p in enumerate(prompts) for i in range(len(p))])
    model.fused_decode = False
    model(ids, positions, kv_caches, AttentionMetadata(slot_mapping=slots, prefills=chunks))


def decode(model, tokens, lens, kv_caches, fused):
    positions = lens[:len(tokens)]
    model.fused_decode = fused
    return model(torch.tensor(tokens), torch.tensor(positions), kv_caches, decode_meta(positions))


def decode_meta(positions, timer=NULL_TIMER):
    """A pure decode step: sequence s's new token at positions[s]."""
    seqs = range(len(positions))
    return AttentionMetadata(
        slot_mapping=torch.tensor([slot(s, positions[s]) for s in seqs]),
        num_decodes=len(positions), num_generated=len(positions), decode_block_tables=torch.stack([table(s) for s in seqs]),
        decode_seq_lens=torch.tensor([p + 1 for p in positions]), timer=timer)


def one_call_equals_modules(model, caches, prompts, batch, steps, monkeypatch):
    """Prefill ``prompts`` through the modules, then ``steps`` decode steps of ``batch``
    sequences through the one-call path on one copy of ``caches`` and the modules on
    another: hidden states and every layer's cache equal to the bit (an 8-bit cache as
    bytes), and the one-call path ran (and did not decline) every step."""
    prefill(model, prompts, caches)
    ours, theirs = [t.clone() for t in caches], [t.clone() for t in caches]
    calls = []
    real = llama.decode_layers
    monkeypatch.setattr(llama, "decode_layers", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    lens, tokens = [len(p) for p in prompts], [7 + i for i in range(batch)]
    for step in range(steps):
        a = decode(model, tokens, lens, ours, fused=True)
        b = decode(model, tokens, lens, theirs, fused=False)
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max()}"
        for x, y in zip(ours, theirs):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        lens = [n + 1 for n in lens]
        tokens = [(t * 31 + 5) % model.config.vocab_size for t in tokens]
    assert calls == [True] * steps


PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], [2, 7, 1, 8], [28, 18, 28, 45, 9],
           [90, 45]] + [[(7 * i + j) % 101 for j in range(3 + i % 5)] for i in range(13)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization,batch", [("none", 1), ("none", 2), ("q4_0", 1),
                                                ("q4_1", 2), ("q8_0", 5), ("q4_1", 5),
                                                ("q4_0", 18), ("q5_0", 2), ("q5_1", 5),
                                                ("mixed", 1), ("mixed", 5)])  # 18: past skinny's 16 rows
def test_one_call_decode_equals_modules(dtype, bias, quantization, batch, monkeypatch):
    model = make_model(dtype, bias, quantization)
    c = model.config
    caches = [torch.zeros(2, c.num_key_value_heads, NUM_BLOCKS, BS, c.head_dim, dtype=dtype)
              for _ in range(c.num_hidden_layers)]
    # 6 steps cross block boundaries; past 8 keys the kernel's 16-key tiles
    one_call_equals_modules(model, caches, PROMPTS[:max(2, batch)], batch, 6, monkeypatch)


@pytest.mark.parametrize("family", ["qwen3", "mistral_window", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization,batch", [("none", 1), ("none", 2), ("q4_0", 3),
                                                ("mixed_parts", 1), ("mixed_parts", 3)])
def test_every_familys_layer_decodes_in_one_call(family, dtype, quantization, batch,
                                                  monkeypatch):
    model = make_model(dtype, False, quantization, family)
    assert model.config.windowed == (family != "qwen3")
    if quantization == "mixed_parts":
        assert any(isinstance(m.quant, QuantizedParts) for m in model._layer_linears())
    c = model.config
    caches = [torch.zeros(2, c.num_key_value_heads, NUM_BLOCKS, BS, c.head_dim, dtype=dtype)
              for _ in range(c.num_hidden_layers)]
    # 5 and 7 tokens, then 8 decodes: windows of 5 bind
    one_call_equals_modules(model, caches, PROMPTS[:max(2, batch)], batch, 8, monkeypatch)


@pytest.mark.parametrize("num_seqs,timed,quantization,one_call", [
    (None, False, "none", False), (1, True, "none", False), (1, False, "none", True),
    (3, False, "q4_0", True), (5, True, "q4_0", False), (9, False, "q4_0", False)])
def test_the_modules_run_timed_steps_and_more_rows_than_the_kernels_take(
        monkeypatch, num_seqs, timed, quantization, one_call):
    model = make_model(torch.float32, False, quantization)
    if num_seqs is None:  # one row past the skinny kernel's limit on this CPU (2 or 8)
        num_seqs = model.fused_decode_rows + 1
    if quantization != "none":
        assert model.fused_decode_rows > 256  # every generated row
        model.fused_decode_rows = 8  # the rule, at a size this test's cache holds
    c = model.config
    caches = [torch.zeros(2, c.num_key_value_heads, NUM_BLOCKS, BS, c.head_dim)
              for _ in range(c.num_hidden_layers)]
    prefill(model, [[1, 2, 3]] * num_seqs, caches)
    calls = []
    monkeypatch.setattr(llama, "decode_layers", lambda *a, **k: calls.append(1) or False)
    model.fused_decode = True
    timer = StepTimer(enabled=True) if timed else NULL_TIMER
    model(torch.tensor([4] * num_seqs), torch.tensor([3] * num_seqs), caches,
          decode_meta([3] * num_seqs, timer))
    # Rows past the skinny kernel's limit take the modules (quantized models take the
    # one-call path up to fused_decode_rows); a timed step must time attention apart.
    assert len(calls) == int(one_call)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype,quantization,batch", [(torch.float32, "none", 2),
                                                      (torch.bfloat16, "q4_0", 5)])
def test_one_call_decode_equals_modules_over_an_8bit_cache(dtype, quantization, batch, kv_dtype,
                                                            monkeypatch):
    model = make_model(dtype, False, quantization)
    c = model.config
    caches = [torch.zeros(2, c.num_key_value_heads, NUM_BLOCKS, BS, c.head_dim + 4,
                          dtype=kv_dtype) for _ in range(c.num_hidden_layers)]
    one_call_equals_modules(model, caches, PROMPTS[:batch], batch, 5, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mix_of_k_quants_is_ggmls_arithmetic_on_its_dense_twins_values(dtype, monkeypatch):
    """The mixed model (every linear layer on its blocks) against the same values dense:
    decode logits equal ggml's arithmetic emulated (the input's int8 blocks times the
    dequantized weights, tests/e2e/test_quant_model.py) to float32 rounding, and the greedy
    tokens those of the dense twin except at its near ties (a random model amplifies the
    int8 blocks' error to a few per cent of the logits' scale, 8.5 % measured, which is why
    the emulation is the exact check, not a distance to the twin)."""
    from inflight.model import linear
    from tests.e2e.test_quant_model import _ggml_arithmetic

    model = make_model(dtype, False, "mixed_parts")
    quants = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    parts = [q for q in quants if isinstance(q, QuantizedParts)]
    assert [q.formats for q in parts] == [(QuantFormat.Q5_0, QuantFormat.Q5_0, QuantFormat.Q8_0)]
    assert {q.fmt for q in quants if not isinstance(q, QuantizedParts)} == (
        set(QuantFormat) - {QuantFormat.Q4_0, QuantFormat.Q4_1, QuantFormat.Q5_1})
    assert model.all_quantized
    dense = LlamaForCausalLM(model.config, dtype=dtype)
    dense.load_weights(model.dense_state, "none")
    c, prompts = model.config, PROMPTS[:4]

    def logits(m):
        caches = [torch.zeros(2, c.num_key_value_heads, NUM_BLOCKS, BS, c.head_dim, dtype=dtype)
                  for _ in range(c.num_hidden_layers)]
        prefill(m, prompts, caches)
        hidden = decode(m, [7, 8, 9, 10], [len(p) for p in prompts], caches, fused=False)
        return m.compute_logits(hidden).double()

    ours, exact = logits(model), logits(dense)
    monkeypatch.setattr(linear, "quant_linear", _ggml_arithmetic())
    emulated = logits(model)
    scale = exact.abs().max().item()
    # float32: summation order alone; bfloat16: a rounding step of the layers' outputs
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ours - emulated).abs().max().item() < tol * scale
    # greedy tokens part from the twin's only where its own margin is inside that error
    for row in (ours.argmax(-1) != exact.argmax(-1)).nonzero().flatten().tolist():
        margin = exact[row].max() - exact[row, ours[row].argmax()]
        assert margin <= 2 * (ours[row] - exact[row]).abs().max(), row
