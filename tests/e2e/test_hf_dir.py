"""An HF model directory (config.json, *.safetensors, tokenizer.json) through ``LLM``:
greedy tokens equal HF ``generate`` on the same tiny random Llama."""

from __future__ import annotations

import json

import torch
import transformers

from inflight import LLM, SamplingParams


def test_llm_loads_an_hf_directory(tmp_path, bundled):
    tokenizer = bundled[2]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "chat_template": tokenizer.chat_template}))

    llm = LLM(str(tmp_path), num_kv_blocks=64, dtype="float32")
    assert llm.engine.max_model_len == 512
    prompt = "The quick brown fox"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) <= 4
