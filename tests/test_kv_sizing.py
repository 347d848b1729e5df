"""KV pool sizing: explicit sizes, and vLLM's gpu_memory_utilization arithmetic for CUDA."""

from __future__ import annotations

import pytest
import torch

from inflight.config import EngineConfig
from inflight.engine import loading
from inflight.model.hparams import ModelConfig
from inflight.runner import kv_block_bytes

GiB = 1 << 30


def test_cuda_budget_takes_what_is_in_use_and_activations_off_the_share():
    # 80 GiB device, 3 GiB in use (weights, context), 0.9 utilization, 1 GiB activations.
    assert loading.cuda_kv_budget(77 * GiB, 80 * GiB, 0.9, 1 * GiB) == 72 * GiB - 3 * GiB - 1 * GiB
    # 60 GiB in use (another process too): what is left of the 72 GiB share.
    assert loading.cuda_kv_budget(20 * GiB, 80 * GiB, 0.9, 1 * GiB) == 11 * GiB
    assert loading.cuda_kv_budget(20 * GiB, 80 * GiB, 0.2, 1 * GiB) < 0


def _smollm_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def test_activation_estimate_for_the_bundled_shapes():
    c = _smollm_config()
    cfg = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192)
    per_token = 3 * 576 + 576 + 2 * 192 + 576 + 3 * 1536
    expected = 2 * 4 * (2048 * per_token + 9 * 2048 * 8192 + 3 * 256 * 49152)
    assert loading.activation_bytes(c, cfg) == expected


def test_num_kv_blocks_on_cuda_uses_the_utilization(monkeypatch):
    c = _smollm_config()
    cfg = EngineConfig(gpu_memory_utilization=0.5, max_num_batched_tokens=256, max_num_seqs=16,
                       max_model_len=2048)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (38 * GiB, 40 * GiB))
    per_block = kv_block_bytes(c, 16, torch.bfloat16)
    budget = 20 * GiB - 2 * GiB - loading.activation_bytes(c, cfg)
    assert loading.num_kv_blocks(cfg, c, torch.bfloat16, torch.device("cuda")) == budget // per_block
    tight = EngineConfig(gpu_memory_utilization=0.05)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        loading.num_kv_blocks(tight, c, torch.bfloat16, torch.device("cuda"))
    # An explicit size wins on any device.
    sized = EngineConfig(kv_cache_memory_bytes=per_block * 10)
    assert loading.num_kv_blocks(sized, c, torch.bfloat16, torch.device("cuda")) == 10
