"""LoRARegistry: names, stable ids, LRU eviction with lazy re-reads, add/remove, threads."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from inflight.lora.adapter import LoRAError, load_peft_adapter
from inflight.lora.lora_config import LoRAConfig, LoRAModule
from inflight.lora.registry import BASE_MODEL_ID, LoRARegistry

from .conftest import build_peft, save_peft


@pytest.fixture(scope="module")
def paths(full_adapter, tmp_path_factory) -> dict[str, str]:
    """Three different adapters on disk: a (all targets), b (q/v), c (o, seed 2)."""
    return {"a": full_adapter[1],
            "b": save_peft(build_peft(seed=1, target_modules=["q_proj", "v_proj"]),
                           tmp_path_factory.mktemp("b")),
            "c": save_peft(build_peft(seed=2, target_modules=["o_proj"]),
                           tmp_path_factory.mktemp("c"))}


class CountingLoader:
    def __init__(self):
        self.reads: list[str] = []

    def __call__(self, path, model_config, max_rank, name):
        self.reads.append(name)
        return load_peft_adapter(path, model_config, max_rank, name)


def make(paths, model_config, names=("a", "b"), **cfg):
    loader = CountingLoader()
    modules = tuple(LoRAModule(n, paths[n]) for n in names)
    return LoRARegistry(LoRAConfig(lora_modules=modules, **cfg), model_config, loader), loader


def test_lru_evicts_and_rereads_with_stable_ids(paths, model_config):
    reg, loader = make(paths, model_config, max_loras=1, max_cpu_loras=1)
    assert loader.reads == ["a", "b"]  # validated eagerly at start
    assert reg.loaded_names() == ["b"]
    ids = {n: reg.id_of(n) for n in reg.names()}
    assert ids == {"a": 1, "b": 2} and BASE_MODEL_ID == 0
    first_a = reg.get("a")
    assert loader.reads == ["a", "b", "a"] and reg.loaded_names() == ["a"]
    b = reg.get("b")  # evicts a
    assert reg.loaded_names() == ["b"] and loader.reads[-1] == "b"
    again_a = reg.get("a")  # re-read from its path
    assert again_a is not first_a and loader.reads[-1] == "a"
    for key, (a_f, b_f) in first_a.weights.items():
        a2, b2 = again_a.weights[key]
        assert torch.equal(a2, a_f) and torch.equal(b2, b_f)
    assert reg.get("a") is again_a and loader.reads.count("a") == 3  # a hit reads nothing
    assert {n: reg.id_of(n) for n in reg.names()} == ids
    assert b.name == "b" and sorted(b.weights) == [(0, "qkv_proj"), (1, "qkv_proj")]


def test_lru_order_follows_use(paths, model_config):
    reg, loader = make(paths, model_config, names=("a", "b", "c"), max_loras=1,
                       max_cpu_loras=2)
    assert reg.loaded_names() == ["b", "c"]
    reg.get("b")  # b most recent: c is evicted next
    reg.get("a")
    assert reg.loaded_names() == ["b", "a"]
    n = len(loader.reads)
    reg.get("b")
    assert len(loader.reads) == n


def test_add_remove_and_ids_never_reused(paths, model_config):
    reg, _ = make(paths, model_config, names=("a",), max_cpu_loras=2)
    assert reg.add("b", paths["b"], base_model_name="base") == 2
    assert reg.names() == ["a", "b"] and "b" in reg and len(reg) == 2
    assert reg.modules()[1] == LoRAModule("b", paths["b"], "base")
    assert reg.name_of(2) == "b"
    with pytest.raises(LoRAError, match="'a' has already been loaded"):
        reg.add("a", paths["c"])
    assert reg.remove("b") is True and reg.remove("b") is False
    assert "b" not in reg and reg.loaded_names() == ["a"]
    for lookup in (reg.get, reg.id_of):
        with pytest.raises(KeyError):
            lookup("b")
    with pytest.raises(KeyError):
        reg.name_of(2)
    assert reg.add("b", paths["c"]) == 3  # a new id: KV cached under id 2 stays apart
    assert sorted(reg.get("b").weights) == [(0, "o_proj"), (1, "o_proj")]


def test_bad_adapter_fails_start_up_and_add_by_name(paths, model_config, tmp_path):
    with pytest.raises(LoRAError, match="'broken'"):
        LoRARegistry(LoRAConfig(lora_modules=(LoRAModule("broken", str(tmp_path / "no")),)),
                     model_config)
    with pytest.raises(LoRAError, match=r"'a'.*rank 8, over the cap of 4"):
        LoRARegistry(LoRAConfig(max_lora_rank=4, lora_modules=(LoRAModule("a", paths["a"]),)),
                     model_config)
    reg, _ = make(paths, model_config, names=())
    with pytest.raises(LoRAError, match="'bad'"):
        reg.add("bad", str(tmp_path / "no"))
    with pytest.raises(LoRAError, match="a name and a path"):
        reg.add("", paths["a"])
    assert reg.names() == [] and reg.add("a", paths["a"]) == 1


def test_evicted_adapter_whose_files_vanished(paths, model_config, tmp_path):
    path = shutil.copytree(paths["c"], tmp_path / "c")
    reg, _ = make({"a": paths["a"], "c": str(path)}, model_config, names=("c", "a"))
    shutil.rmtree(path)
    with pytest.raises(LoRAError, match="'c'.*no such directory"):
        reg.get("c")
    assert reg.names() == ["c", "a"]  # still registered: the operator may restore it


def test_threads_adding_removing_and_getting(paths, model_config):
    """The event loop adds/removes while the engine thread gets: no lost or torn state."""
    reg, _ = make(paths, model_config, names=("a",), max_cpu_loras=1)
    errors: list[BaseException] = []

    def engine():
        try:
            for _ in range(40):
                assert reg.get("a").name == "a"
                try:
                    assert reg.get("b").name == "b"
                except KeyError:
                    pass  # removed between the checks: allowed
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=engine)
    t.start()
    ids = []
    for _ in range(10):
        ids.append(reg.add("b", paths["b"]))
        assert reg.remove("b")
    t.join()
    assert errors == [] and ids == list(range(2, 12)) and reg.names() == ["a"]
