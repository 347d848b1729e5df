"""GGUF loading: names, llama.cpp's Q/K permutation and dequantization, on files written
here with the ``gguf`` package the way llama.cpp's ``convert_hf_to_gguf.py`` writes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from inflight.model.loader import load_model

Q = gguf.GGMLQuantizationType
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: rotate-half pairs -> interleaved pairs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.{i}.{module...}.weight
    return f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def _encode(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_weights_match_the_hf_weights_they_were_made_from(tmp_path, qtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(64)
    for name, array in state.items():
        if name.endswith("q_proj.weight"):
            array = _permute(array, 4)
        elif name.endswith("k_proj.weight"):
            array = _permute(array, 2)
        t = qtype if array.ndim == 2 else Q.F32
        w.add_tensor(_gguf_name(name), _encode(array, t), raw_dtype=t if t not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    config, loaded = load_model(path)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert not config.tie_word_embeddings
    assert set(loaded) == set(state)
    for name, array in state.items():
        # Quantization works row by row, so it commutes with the row permutation: the
        # expected tensor is the HF tensor through the same quantize/dequantize.
        t = qtype if array.ndim == 2 else Q.F32
        expected = gguf.quants.dequantize(_encode(array, t), t) if t != Q.F32 else array
        np.testing.assert_array_equal(loaded[name].numpy(), np.asarray(expected, np.float32).reshape(array.shape),
                                      err_msg=name)
        if t == Q.F32:
            np.testing.assert_array_equal(loaded[name].numpy(), array)
