"""--enable-lora and its flags, with vLLM's forms and rules."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from inflight.lora.lora_config import (LoRAConfig, LoRAModule, add_lora_cli_args,
                                       lora_config_from_args, parse_lora_modules)


def parse(cmd: str) -> LoRAConfig | None:
    parser = argparse.ArgumentParser()
    add_lora_cli_args(parser)
    return lora_config_from_args(parser.parse_args(shlex.split(cmd)))


def test_both_lora_modules_forms():
    obj = json.dumps({"name": "chat", "path": "/a/chat", "base_model_name": "base"})
    assert parse_lora_modules(["sql=/a/sql", obj, "", "x=/p=q"]) == (
        LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "base"),
        LoRAModule("x", "/p=q"))
    listed = json.dumps([{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}])
    assert parse_lora_modules([listed]) == (LoRAModule("a", "/a"), LoRAModule("b", "/b"))


@pytest.mark.parametrize("values,expected", [
    (["a=/x", '{"name": "a", "path": "/y"}'], "given twice: a"),
    (["just-a-path"], "expected name=path"),
    (["=/x"], "expected name=path"),
    (["a="], "expected name=path"),
    (['{"name": "a", "path": '], "invalid JSON"),
    (['{"name": "a", "path": "/x", "rank": 8}'], "unknown key(s) rank"),
    (['{"name": "a"}'], "'path' must be a non-empty string"),
    (['{"name": "", "path": "/x"}'], "'name' must be a non-empty string"),
    (['{"name": "a", "path": "/x", "base_model_name": 3}'], "'base_model_name' must be"),
    (["[1]"], "expected a JSON object"),
])
def test_bad_lora_modules(values, expected):
    with pytest.raises(ValueError, match="^lora_modules: ") as info:
        parse_lora_modules(values)
    assert expected in str(info.value)


def test_flags_into_a_config():
    cfg = parse("--enable-lora --lora-modules sql=/a/sql "
                "'{\"name\": \"chat\", \"path\": \"/a/chat\"}' "
                "--max-loras 2 --max-lora-rank 64 --max-cpu-loras 4")
    assert cfg == LoRAConfig(max_loras=2, max_lora_rank=64, max_cpu_loras=4,
                             lora_modules=(LoRAModule("sql", "/a/sql"),
                                           LoRAModule("chat", "/a/chat")))
    assert cfg.num_cpu_loras == 4
    default = parse("--enable-lora")
    assert default == LoRAConfig() and default.num_cpu_loras == 1
    assert (default.max_loras, default.max_lora_rank, default.lora_modules) == (1, 16, ())


def test_no_enable_lora_no_config_and_modules_need_it():
    assert parse("") is None
    assert parse("--max-loras 4") is None
    with pytest.raises(ValueError, match="add --enable-lora"):
        parse("--lora-modules sql=/a/sql")


@pytest.mark.parametrize("kwargs,field", [
    ({"max_loras": 0}, "max_loras"),
    ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"max_loras": 3, "max_cpu_loras": 2}, "max_cpu_loras"),
    ({"lora_modules": (LoRAModule("a", "/x"), LoRAModule("a", "/y"))}, "lora_modules"),
    ({"lora_modules": (LoRAModule("", "/x"),)}, "lora_modules"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LoRAConfig(**kwargs)
    assert LoRAConfig(max_loras=3, max_cpu_loras=3).num_cpu_loras == 3


def test_config_import_is_torch_free():
    import subprocess
    import sys
    code = ("import sys, inflight.lora.lora_config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_flags_check_adapter_dirs_before_any_model_loads(tmp_path):
    # EngineConfig.from_cli_args is what `inflight serve` (one engine or replicas) reads its
    # flags with: a wrong --lora-modules path fails there, before the model loads.
    from inflight.config import EngineConfig
    from inflight.lora.adapter import CONFIG_FILE, LoRAError

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)

    def config(modules: str) -> EngineConfig:
        return EngineConfig.from_cli_args(parser.parse_args(
            shlex.split(f"--enable-lora --max-lora-rank 8 --lora-modules {modules}")))

    good, dora = tmp_path / "good", tmp_path / "dora"
    for d, extra in ((good, {}), (dora, {"use_dora": True})):
        d.mkdir()
        (d / CONFIG_FILE).write_text(json.dumps({"r": 8, "lora_alpha": 16, **extra}))
    assert config(f"sql={good}").lora_config.lora_modules == (LoRAModule("sql", str(good)),)
    with pytest.raises(LoRAError, match=r"^LoRA adapter 'sql' \(.*missing\): no such directory"):
        config(f"ok={good} sql={tmp_path / 'missing'}")
    with pytest.raises(LoRAError, match=r"^LoRA adapter 'x' \(.*\): adapter_config.json is missing"):
        config(f"x={tmp_path}")
    with pytest.raises(LoRAError, match="DoRA"):
        config(f"d={dora}")
