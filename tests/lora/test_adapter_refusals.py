"""Adapters we cannot serve are refused with a LoRAError naming the adapter and the problem."""

from __future__ import annotations

import pathlib
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.lora.adapter import LoRAError, load_peft_adapter

from .conftest import TINY, build_peft, edit_config, save_peft

NAME = "my-adapter"
ST = "adapter_model.safetensors"


def refused(path, model_config, max_rank: int = 16) -> str:
    with pytest.raises(LoRAError) as info:
        load_peft_adapter(str(path), model_config, max_rank, NAME)
    msg = str(info.value)
    assert f"'{NAME}'" in msg, msg
    return msg


@pytest.fixture
def copy(full_adapter, tmp_path) -> pathlib.Path:
    """A writable copy of the all-targets adapter."""
    return pathlib.Path(shutil.copytree(full_adapter[1], tmp_path / "copy"))


def _rewrite_tensors(path: pathlib.Path, change) -> None:
    tensors = load_file(str(path / ST))
    change(tensors)
    save_file(tensors, str(path / ST), metadata={"format": "pt"})


def test_the_copy_itself_loads(copy, model_config):
    assert load_peft_adapter(str(copy), model_config, 16, NAME).rank == 8


def test_missing_directory_and_files(copy, model_config, tmp_path):
    assert "no such directory" in refused(tmp_path / "absent", model_config)
    assert "GGUF LoRA adapters are not supported" in refused(tmp_path / "a.gguf", model_config)
    (copy / ST).unlink()
    assert "no weights" in refused(copy, model_config)
    (copy / "adapter_config.json").unlink()
    assert "adapter_config.json is missing" in refused(copy, model_config)


def test_unreadable_config_and_weights(copy, model_config):
    (copy / ST).write_bytes(b"\x00garbage" * 8)
    assert "adapter weights are unreadable" in refused(copy, model_config)
    (copy / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json is unreadable" in refused(copy, model_config)
    (copy / "adapter_config.json").write_text("[1, 2]")
    assert "not a JSON object" in refused(copy, model_config)


def test_rank_over_the_cap_names_rank_cap_and_flag(full_adapter, model_config):
    msg = refused(full_adapter[1], model_config, max_rank=4)
    assert "rank 8" in msg and "cap of 4" in msg and "--max-lora-rank" in msg


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_unsupported_target_module_is_named(module, tmp_path, model_config):
    path = save_peft(build_peft(target_modules=["q_proj", module]), tmp_path)
    assert re.search(rf"target module\(s\) {module} not supported", refused(path, model_config))
    edit_config(path, target_modules=".*")  # regex form: found from the tensors instead
    assert re.search(rf"tensor \S*{module}\S*: target module {module} is not supported",
                     refused(path, model_config))


def test_dora_is_refused(tmp_path, model_config):
    path = save_peft(build_peft(use_dora=True, target_modules=["v_proj"]), tmp_path)
    assert "DoRA (use_dora)" in refused(path, model_config)
    edit_config(path, use_dora=False)  # its magnitude tensors still give it away
    assert re.search(r"tensor \S*lora_magnitude_vector\S*: DoRA", refused(path, model_config))


def test_adapter_of_another_model_size_names_tensor_and_shapes(tmp_path, model_config):
    path = save_peft(build_peft(hf=dict(TINY, hidden_size=32)), tmp_path)
    msg = refused(path, model_config)
    assert re.search(r"tensor base_model\.model\.model\.layers\.0\.\w+\.\w+\.lora_[AB]\.weight "
                     r"has shape \(\d+, \d+\), expected \(\d+, \d+\)", msg), msg
    assert "(32, 8), expected (64, 8)" in msg or "(8, 32), expected (8, 64)" in msg, msg


def test_config_rank_disagreeing_with_tensors(copy, model_config):
    edit_config(copy, r=4)
    assert re.search(r"lora_A\.weight has shape \(8, \d+\), expected \(4, \d+\)",
                     refused(copy, model_config))


def test_layer_index_out_of_range(tmp_path, model_config):
    path = save_peft(build_peft(hf=dict(TINY, num_hidden_layers=3)), tmp_path)
    assert re.search(r"tensor \S*layers\.2\.\S*: layer 2 is out of range \(the model has 2 "
                     r"layers\)", refused(path, model_config))


@pytest.mark.parametrize("drop,have", [("B", "A"), ("A", "B")])
def test_half_of_a_pair_missing(copy, model_config, drop, have):
    key = f"base_model.model.model.layers.1.mlp.up_proj.lora_{drop}.weight"
    _rewrite_tensors(copy, lambda t: t.pop(key))
    assert (f"model.layers.1.mlp.up_proj has lora_{have} but no lora_{drop}"
            in refused(copy, model_config))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values(copy, model_config, value):
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"

    def poison(t):
        t[key][3, 1] = value
    _rewrite_tensors(copy, poison)
    assert (f"tensor {key} has non-finite values"
            in refused(copy, model_config))


def test_unexpected_tensor(copy, model_config):
    _rewrite_tensors(copy, lambda t: t.update({"base_model.model.model.norm.weight":
                                               torch.ones(64)}))
    assert "unexpected tensor base_model.model.model.norm.weight" in refused(copy, model_config)


@pytest.mark.parametrize("changes,expected", [
    ({"fan_in_fan_out": True}, "fan_in_fan_out adapters"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    ({"layers_to_transform": [0]}, "layer 1 is not in layers_to_transform [0]"),
    ({"layers_to_transform": "0-1"}, "layers_to_transform '0-1' is not supported"),
    ({"lora_alpha": "sixteen"}, "lora_alpha must be a positive number"),
    ({"rank_pattern": {"q_proj": 2.5}}, "rank 2.5 from the config is not a positive integer"),
])
def test_config_features_we_do_not_serve(copy, model_config, changes, expected):
    edit_config(copy, **changes)
    assert expected in refused(copy, model_config)
