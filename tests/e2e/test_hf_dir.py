"""An HF model directory (config.json, *.safetensors, tokenizer.json) through ``LLM``:
greedy tokens equal HF ``generate`` on the same tiny random Llama."""

from __future__ import annotations

import torch

from inflight import LLM, SamplingParams
from tests.e2e.tiny_hf import save_tiny_llama


def test_llm_loads_an_hf_directory(tmp_path, bundled):
    tokenizer = bundled[2]
    hf = save_tiny_llama(tmp_path, tokenizer)

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
