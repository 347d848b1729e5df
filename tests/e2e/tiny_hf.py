"""A tiny random Llama saved as an HF model directory (config, safetensors, the bundled
tokenizer): the reference for tests that compare us with transformers (and PEFT)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers


def save_tiny_llama(path: Path, tokenizer: Any, seed: int = 0) -> transformers.LlamaForCausalLM:
    """Write a 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with N(0, 0.3) weights and
    the bundled tokenizer into ``path``; returns the HF model (float32, eval)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "chat_template": tokenizer.chat_template}))
    return hf
