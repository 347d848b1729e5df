"""Tiny random Llama models with PEFT LoRA adapters saved to disk, for tests/lora.

PEFT initialises lora_B to zero, so every adapter here gets a fixed-seed random B (and A):
a delta of zeros would make every comparison pass."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from inflight.model.hparams import ModelConfig

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft(seed: int = 0, hf: dict | None = None, **lora: object) -> PeftModel:
    """A tiny random HF Llama wrapped with a LoRA adapter ``default`` of random A and B."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(hf or TINY))).eval()
    kw = {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS, "init_lora_weights": False}
    peft_model = get_peft_model(model, LoraConfig(**{**kw, **lora}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft_model


def save_peft(peft_model: PeftModel, path: pathlib.Path, **kw: object) -> str:
    peft_model.save_pretrained(str(path), **kw)
    return str(path)


def edit_config(path: str, **changes: object) -> None:
    """Rewrite keys of ``path``'s adapter_config.json."""
    file = pathlib.Path(path) / "adapter_config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg))


@pytest.fixture(scope="session")
def model_config() -> ModelConfig:
    return ModelConfig.from_hf_config(LlamaConfig(**TINY).to_dict())


@pytest.fixture(scope="session")
def full_adapter(tmp_path_factory) -> tuple[PeftModel, str]:
    """All seven projections, r=8, alpha=16: the PEFT model and its saved directory."""
    peft_model = build_peft()
    return peft_model, save_peft(peft_model, tmp_path_factory.mktemp("full"))
