"""PEFT adapters read into the model's fused layout equal PEFT's own deltas.

Reference: PEFT 0.13+ (``LoraLayer.get_delta_weight``, the LoRA module's forward and
``merge_and_unload``) on a tiny random HF Llama, fused with the model's own
``fuse_hf_weights``. Tolerance: 1e-6 of the largest |delta| (float32; only the place the
scale is multiplied in differs), 1e-5 for products with an input (summation order)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inflight.lora.adapter import FUSED_MODULES, load_peft_adapter
from inflight.model.llama_weights import fuse_hf_weights

from .conftest import TINY, build_peft, save_peft

_FUSED_NAMES = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
                "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}


def _part(peft_model, layer: int, part: str) -> torch.nn.Module:
    decoder = peft_model.base_model.model.model.layers[layer]
    return getattr(decoder.self_attn if part[0] in "qkvo" else decoder.mlp, part)


def _is_lora(module) -> bool:
    return hasattr(module, "lora_A") and "default" in module.lora_A


def peft_fused_delta(peft_model, layer: int, fused: str) -> torch.Tensor:
    """PEFT's delta of each part, stacked in the fused order; zeros where not targeted."""
    out = []
    for part in FUSED_MODULES[fused]:
        m = _part(peft_model, layer, part)
        out.append(m.get_delta_weight("default") if _is_lora(m) else torch.zeros_like(m.weight))
    return torch.cat(out).detach()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ref.abs().max() > 1e-3, "reference delta is ~zero: the comparison could not fail"
    return float((ours - ref).abs().max() / ref.abs().max())


def _check_all(adapter, peft_model, n_layers: int = 2) -> None:
    for layer in range(n_layers):
        for fused in FUSED_MODULES:
            if (layer, fused) not in adapter.weights:
                assert peft_fused_delta(peft_model, layer, fused).abs().max() == 0
                continue
            ref = peft_fused_delta(peft_model, layer, fused)
            assert rel_err(adapter.delta_weight(layer, fused), ref) < 1e-6, (layer, fused)


def test_every_fused_delta_equals_peft(full_adapter, model_config):
    peft_model, path = full_adapter
    adapter = load_peft_adapter(path, model_config, max_rank=16, name="full")
    assert (adapter.name, adapter.path, adapter.rank) == ("full", path, 8)
    assert sorted(adapter.weights) == sorted((i, m) for i in range(2) for m in FUSED_MODULES)
    a, b = adapter.weights[(0, "qkv_proj")]
    assert a.dtype == b.dtype == torch.float32
    assert tuple(a.shape) == (24, 64) and tuple(b.shape) == (64 + 2 * 32, 24)
    assert tuple(adapter.weights[(1, "gate_up_proj")][1].shape) == (256, 16)
    _check_all(adapter, peft_model)


def test_low_rank_product_equals_peft_forward(full_adapter, model_config):
    """x @ A_f.T @ B_f.T is PEFT's LoRA term of each part, concatenated in fused order."""
    peft_model, path = full_adapter
    adapter = load_peft_adapter(path, model_config, max_rank=16, name="full")
    g = torch.Generator().manual_seed(5)
    for (layer, fused), (a, b) in adapter.weights.items():
        x = torch.randn(5, a.shape[1], generator=g)
        with torch.no_grad():
            ref = torch.cat([m(x) - m.base_layer(x) for m in
                             (_part(peft_model, layer, p) for p in FUSED_MODULES[fused])], dim=1)
        assert rel_err(x @ a.T @ b.T, ref) < 1e-5, (layer, fused)


def test_merged_hf_weights_minus_base_in_the_models_fused_layout(tmp_path, model_config):
    """PEFT's merge_and_unload, fused by the model's own loader, minus the fused base."""
    peft_model = build_peft(seed=3)
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 16, "m")
    torch.manual_seed(3)  # the base model build_peft made
    base = fuse_hf_weights(LlamaForCausalLM(LlamaConfig(**TINY)).state_dict(), model_config)
    merged = fuse_hf_weights(peft_model.merge_and_unload().state_dict(), model_config)
    for layer in range(2):
        for fused, name in _FUSED_NAMES.items():
            key = f"model.layers.{layer}.{name}.weight"
            ref = (merged[key] - base[key]).detach()
            assert rel_err(adapter.delta_weight(layer, fused), ref) < 1e-6, key


def test_rslora_scales_by_alpha_over_sqrt_r(tmp_path, model_config):
    peft_model = build_peft(seed=4, use_rslora=True, r=8, lora_alpha=16)
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 16, "rs")
    _check_all(adapter, peft_model)
    raw_b = _part(peft_model, 0, "o_proj").lora_B["default"].weight.detach()
    torch.testing.assert_close(adapter.weights[(0, "o_proj")][1], raw_b * (16 / 8 ** 0.5),
                               rtol=1e-6, atol=0)


def test_rank_and_alpha_patterns(tmp_path, model_config):
    peft_model = build_peft(seed=5, rank_pattern={"q_proj": 4, "down_proj": 2,
                                                  "layers.1.mlp.up_proj": 4},
                            alpha_pattern={"o_proj": 32, "k_proj": 3})
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 8, "pat")
    assert adapter.rank == 8
    assert tuple(adapter.weights[(0, "qkv_proj")][0].shape) == (4 + 8 + 8, 64)
    assert tuple(adapter.weights[(1, "down_proj")][0].shape) == (2, 128)
    assert tuple(adapter.weights[(0, "gate_up_proj")][0].shape) == (16, 64)
    assert tuple(adapter.weights[(1, "gate_up_proj")][0].shape) == (12, 64)
    _check_all(adapter, peft_model)
    raw_b = _part(peft_model, 1, "o_proj").lora_B["default"].weight.detach()
    torch.testing.assert_close(adapter.weights[(1, "o_proj")][1], raw_b * (32 / 8),
                               rtol=1e-6, atol=0)


def test_q_and_v_only_leave_k_rows_zero(tmp_path, model_config):
    peft_model = build_peft(seed=6, target_modules=["q_proj", "v_proj"])
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 16, "qv")
    assert sorted(adapter.weights) == [(0, "qkv_proj"), (1, "qkv_proj")]
    a, b = adapter.weights[(1, "qkv_proj")]
    assert tuple(a.shape) == (16, 64) and tuple(b.shape) == (128, 16)
    q, kv = model_config.q_size, model_config.kv_size
    assert b[q:q + kv].abs().max() == 0  # k rows
    assert b[:q, 8:].abs().max() == 0 and b[q + kv:, :8].abs().max() == 0  # block-diagonal
    assert b[:q, :8].abs().max() > 0 and b[q + kv:, 8:].abs().max() > 0
    _check_all(adapter, peft_model)


def test_layers_to_transform(tmp_path, model_config):
    peft_model = build_peft(seed=7, target_modules=["o_proj", "up_proj"], layers_to_transform=[1])
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 16, "l1")
    assert sorted(adapter.weights) == [(1, "gate_up_proj"), (1, "o_proj")]
    assert adapter.weights[(1, "gate_up_proj")][1][:128].abs().max() == 0  # gate rows
    _check_all(adapter, peft_model)


def test_regex_target_modules(tmp_path, model_config):
    peft_model = build_peft(seed=9, target_modules=r".*layers\.0\.self_attn\.(k_proj|o_proj)")
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 16, "re")
    assert sorted(adapter.weights) == [(0, "o_proj"), (0, "qkv_proj")]
    assert tuple(adapter.weights[(0, "qkv_proj")][0].shape) == (8, 64)
    _check_all(adapter, peft_model)


def test_bin_file_reads_like_safetensors(full_adapter, tmp_path, model_config):
    peft_model, st_path = full_adapter
    bin_path = save_peft(peft_model, tmp_path, safe_serialization=False)
    assert (tmp_path / "adapter_model.bin").exists()
    assert not (tmp_path / "adapter_model.safetensors").exists()
    from_bin = load_peft_adapter(bin_path, model_config, 16, "bin")
    from_st = load_peft_adapter(st_path, model_config, 16, "st")
    for key, (a, b) in from_st.weights.items():
        assert torch.equal(from_bin.weights[key][0], a) and torch.equal(from_bin.weights[key][1], b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_come_out_float32(tmp_path, model_config, dtype):
    peft_model = build_peft(seed=8, target_modules=["o_proj"]).to(dtype)
    adapter = load_peft_adapter(save_peft(peft_model, tmp_path), model_config, 16, "half")
    a, b = adapter.weights[(0, "o_proj")]
    assert a.dtype == b.dtype == torch.float32
    raw_a = _part(peft_model, 0, "o_proj").lora_A["default"].weight.detach().float()
    assert torch.equal(a, raw_a)
