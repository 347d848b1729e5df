"""A LoRA adapter read from a Hugging Face PEFT directory and fused into the model's layout.

PEFT (``peft.LoraConfig``, ``peft.tuners.lora.layer.Linear``) adds to a linear layer
``y = x W^T`` the low-rank term ``scale * x A^T B^T`` with ``A`` [r, in], ``B`` [out, r] and
``scale = lora_alpha / r`` (``use_rslora``: ``lora_alpha / sqrt(r)``, Kalajdzievski 2023),
``r`` and ``lora_alpha`` per module where ``rank_pattern`` / ``alpha_pattern`` name it.
Our model (``model/llama.py``, ``model/llama_weights.py``) fuses HF's q/k/v projections into
``qkv_proj`` and gate/up into ``gate_up_proj``, so an adapter is fused the same way:

    qkv_proj  A_f = [A_q; A_k; A_v]          (r_q + r_k + r_v, hidden)
              B_f = | s_q B_q    0       0     |   rows [0, q_size)
                    |   0     s_k B_k    0     |   rows [q_size, q_size + kv_size)
                    |   0        0    s_v B_v  |   rows [q_size + kv_size, q_size + 2 kv_size)

so ``x A_f^T B_f^T`` is PEFT's delta of each part, concatenated in the fused order. A part
the adapter does not target has no rows in ``A_f`` and zero rows in ``B_f``. vLLM's LoRA
loader (``vllm/lora/models.py``, ``peft_helper.py``) reads the same files.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["FUSED_MODULES", "TARGET_MODULES", "LoRAAdapter", "LoRAError", "ModelShape",
           "load_peft_adapter"]

# Fused module -> the HF modules it is made of, in row order (as llama_weights._FUSED_PARTS).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
TARGET_MODULES = tuple(p for parts in FUSED_MODULES.values() for p in parts)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_FUSED_OF = {p: f for f, parts in FUSED_MODULES.items() for p in parts}
CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<key>(?:model\.)?layers\.(?P<layer>\d+)\."
                     r"(?P<parent>\w+)\.(?P<module>\w+))\.lora_(?P<ab>[AB])\.weight$")
# PEFT's LoraConfig defaults for keys an old or hand-written config leaves out.
_DEFAULT_R = 8
_DEFAULT_ALPHA = 8


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


_Fail = Callable[[str], LoRAError]


class ModelShape(Protocol):
    """The model sizes an adapter is checked against (``model.hparams.ModelConfig`` is one)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...


def part_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """HF module -> its weight's (out_features, in_features) in a model of ``shape``."""
    h, i = shape.hidden_size, shape.intermediate_size
    return {"q_proj": (shape.q_size, h), "k_proj": (shape.kv_size, h),
            "v_proj": (shape.kv_size, h), "o_proj": (h, shape.q_size),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


@dataclass
class LoRAAdapter:
    """One adapter in the model's fused layout, float32 on the CPU.

    Attributes:
        name: the name requests use.
        path: where it was read from (re-read from there after eviction).
        rank: the largest rank over its modules.
        weights: ``(layer, fused module) -> (A_f, B_f)`` for each fused module
            (``FUSED_MODULES``) the adapter targets at least one part of: ``A_f``
            [sum of the targeted parts' ranks, in_features], ``B_f`` [out_features of
            the fused module, same sum], float32, scaling folded into ``B_f``, ``B_f``
            block-diagonal (see the module docstring). Its delta of the fused output for
            input ``x`` [T, in] is ``x @ A_f.T @ B_f.T``. Absent keys: no delta.
    """

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def delta_weight(self, layer: int, module: str) -> torch.Tensor:
        """``B_f @ A_f``: the adapter's change to ``layer``'s fused ``module`` weight,
        [out_features, in_features] float32 (PEFT's ``get_delta_weight`` of each part,
        stacked in the fused order).

        Raises:
            KeyError: the adapter does not target ``module`` in ``layer``.
        """
        a, b = self.weights[(layer, module)]
        return b @ a

    @property
    def num_bytes(self) -> int:
        """Bytes its tensors take."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(path: str, config: ModelShape, max_rank: int, name: str) -> LoRAAdapter:
    """Read, check and fuse the PEFT adapter in directory ``path`` for a model of ``config``.

    The directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
    ``adapter_model.bin``, read with ``torch.load(weights_only=True)``), as PEFT's
    ``save_pretrained`` writes them. The modules adapted are read from the tensor names
    (``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in], ``...lora_B.weight``
    [out, r]), not from ``target_modules``. ``r`` / ``lora_alpha`` / ``use_rslora`` /
    ``rank_pattern`` / ``alpha_pattern`` give each module's scale as PEFT computes it.

    Args:
        path: the adapter directory.
        config: the base model's sizes.
        max_rank: the largest rank accepted (``--max-lora-rank``).
        name: the adapter's name, for messages and the result.

    Raises:
        LoRAError: the directory or a file missing or unreadable, a GGUF file, a feature
            we do not serve (DoRA, biases, ``fan_in_fan_out``, ``modules_to_save``...), a
            module other than the seven projections (named), a rank over ``max_rank``, a
            tensor of the wrong shape (named, with the expected shape), a layer index out
            of range, an ``A`` without its ``B`` or the reverse, non-finite values.
    """
    fail = _fail_for(name, path)
    cfg = _read_config(path, fail)
    _check_features(cfg, fail)
    pairs = _pair_tensors(_read_tensors(path, fail), config, cfg, fail)
    shapes = part_shapes(config)
    scaled: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, part), pair in sorted(pairs.items()):
        r, scale = _rank_and_scale(cfg, pair.key, fail)
        _check_pair(pair, r, shapes[part], max_rank, fail)
        rank = max(rank, r)
        a32, b32 = pair.a.to(torch.float32), pair.b.to(torch.float32)
        scaled.setdefault((layer, _FUSED_OF[part]), {})[part] = (a32, b32 * scale)
    weights = {(layer, fused): _fuse(fused, parts, shapes)
               for (layer, fused), parts in scaled.items()}
    return LoRAAdapter(name=name, path=path, rank=rank, weights=weights)


def check_adapter_dir(name: str, path: str) -> None:
    """What can be checked of an adapter without the model: its directory, its
    ``adapter_config.json`` and the features it declares (``load_peft_adapter`` checks the
    tensors against the model later). ``inflight serve`` calls it for ``--lora-modules``
    before loading the model, so a wrong path fails in a second, not after the load.

    Raises:
        LoRAError: as ``load_peft_adapter`` for the directory, the config file or a feature.
    """
    fail = _fail_for(name, path)
    _check_features(_read_config(path, fail), fail)


def _fail_for(name: str, path: str) -> _Fail:
    """The error every check of adapter ``name`` raises, its message prefixed alike."""
    return lambda msg: LoRAError(f"LoRA adapter {name!r} ({path}): {msg}")


def _read_config(path: str, fail: _Fail) -> dict[str, Any]:
    if path.lower().endswith(".gguf"):
        raise fail("GGUF LoRA adapters are not supported yet; give a Hugging Face PEFT "
                   f"directory ({CONFIG_FILE} + {SAFETENSORS_FILE})")
    if not os.path.isdir(path):
        raise fail("no such directory (expected a Hugging Face PEFT adapter directory)")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise fail(f"{CONFIG_FILE} is missing")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"{CONFIG_FILE} is unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    return cfg


# adapter_config.json keys whose set value changes the forward beyond x A^T B^T.
_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (use_dora) adapters are not supported"),
    ("fan_in_fan_out", "fan_in_fan_out adapters (Conv1D weights) are not supported"),
    ("lora_bias", "lora_bias (a bias on lora_B) is not supported"),
    ("modules_to_save", "modules_to_save (fully trained modules) is not supported"),
    ("trainable_token_indices", "trainable_token_indices is not supported"),
    ("target_parameters", "target_parameters is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("use_qalora", "QALoRA (use_qalora) is not supported"),
)


def _check_features(cfg: dict[str, Any], fail: _Fail) -> None:
    """Refuse a config that asks for more than PEFT's plain LoRA linear layers."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {cfg['peft_type']!r} is not LORA")
    for key, msg in _UNSUPPORTED:
        if cfg.get(key):
            raise fail(f"{msg} (adapter_config.json {key}: {cfg[key]!r})")
    if cfg.get("bias", "none") not in ("none", None):
        raise fail(f"bias {cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):  # full paths or bare names; a str is PEFT's regex form
        bad = sorted({str(t) for t in targets if str(t).rpartition(".")[2] not in TARGET_MODULES})
        if bad:
            raise fail(f"target module(s) {', '.join(bad)} not supported (only "
                       f"{', '.join(TARGET_MODULES)})")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise fail(f"{key} must be a positive number, got {value!r}")


def _read_tensors(path: str, fail: _Fail) -> dict[str, torch.Tensor]:
    st, bin_ = os.path.join(path, SAFETENSORS_FILE), os.path.join(path, BIN_FILE)
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file
            tensors: object = load_file(st, device="cpu")
        elif os.path.isfile(bin_):
            tensors = torch.load(bin_, map_location="cpu", weights_only=True)
        else:
            raise fail(f"no weights: neither {SAFETENSORS_FILE} nor {BIN_FILE}")
    except LoRAError:
        raise
    except Exception as e:  # safetensors and torch.load raise several unrelated types
        raise fail(f"adapter weights are unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise fail(f"{BIN_FILE} is not a dict of named tensors")
    if not tensors:
        raise fail("the weights file holds no tensors")
    return tensors


class _Pair(NamedTuple):
    key: str  # PEFT's module key, "model.layers.3.self_attn.q_proj" (rank_pattern matches it)
    a_name: str
    a: torch.Tensor
    b_name: str
    b: torch.Tensor


def _pair_tensors(tensors: dict[str, torch.Tensor], shape: ModelShape, cfg: dict[str, Any],
                  fail: _Fail) -> dict[tuple[int, str], _Pair]:
    """``(layer, HF module) -> its A and B`` from the tensor names."""
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    keys: dict[tuple[int, str], str] = {}
    allowed = _allowed_layers(cfg, fail)
    matches = {tname: _TENSOR.match(tname) for tname in tensors}
    bad = [tname for tname, m in matches.items()
           if m is None or _PARENT.get(m["module"]) != m["parent"]]
    if bad:  # the most telling first: DoRA, then a LoRA on a module we lack
        raise fail(min((_unknown_tensor(tname) for tname in bad), key=lambda pm: pm[0])[1])
    for tname, t in tensors.items():
        m = matches[tname]
        assert m is not None
        layer, part = int(m["layer"]), m["module"]
        if layer >= shape.num_hidden_layers:
            raise fail(f"tensor {tname}: layer {layer} is out of range (the model has "
                       f"{shape.num_hidden_layers} layers)")
        if allowed is not None and layer not in allowed:
            raise fail(f"tensor {tname}: layer {layer} is not in layers_to_transform "
                       f"{sorted(allowed)}")
        key = m["key"] if m["key"].startswith("model.") else "model." + m["key"]
        keys[(layer, part)] = key
        found.setdefault((layer, part), {})[m["ab"]] = (tname, t)
    out = {}
    for (layer, part), ab in found.items():
        for have, miss in (("A", "B"), ("B", "A")):
            if miss not in ab:
                raise fail(f"{keys[(layer, part)]} has lora_{have} but no lora_{miss}")
        out[(layer, part)] = _Pair(keys[(layer, part)], *ab["A"], *ab["B"])
    return out


def _unknown_tensor(tname: str) -> tuple[int, str]:
    """(priority, why) a tensor name is refused, naming the module it adapts if it can."""
    if "lora_magnitude_vector" in tname:
        return 0, f"tensor {tname}: DoRA (use_dora) adapters are not supported"
    m = re.search(r"(?:^|\.)(\w+)\.lora_(?:embedding_)?[AB]\b", tname)
    if m is not None and m[1] in TARGET_MODULES:
        return 1, f"tensor {tname}: {m[1]} is not under {_PARENT[m[1]]} in a decoder layer"
    if m is not None:
        return 1, (f"tensor {tname}: target module {m[1]} is not supported (only "
                   f"{', '.join(TARGET_MODULES)} in the decoder layers)")
    return 2, f"unexpected tensor {tname} (not a LoRA A/B weight of a decoder-layer projection)"


def _allowed_layers(cfg: dict[str, Any], fail: _Fail) -> set[int] | None:
    value = cfg.get("layers_to_transform")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return set(value)
    raise fail(f"layers_to_transform {value!r} is not supported (an int or a list of ints)")


def _pattern_value(patterns: Any, key: str, default: float) -> float:
    """PEFT's ``get_pattern_key``: the first pattern matching the end of ``key`` at a
    dot boundary (``re.match(rf"(.*\\.)?({pattern})$", key)``) gives the value."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return float(value)
    return default


def _rank_and_scale(cfg: dict[str, Any], key: str, fail: _Fail) -> tuple[int, float]:
    """Module ``key``'s rank per the config, and its scale (alpha/r or alpha/sqrt(r))."""
    try:
        r = _pattern_value(cfg.get("rank_pattern"), key, cfg.get("r", _DEFAULT_R))
        alpha = _pattern_value(cfg.get("alpha_pattern"), key,
                               cfg.get("lora_alpha", _DEFAULT_ALPHA))
    except (re.error, TypeError, ValueError) as e:
        raise fail(f"rank_pattern / alpha_pattern unreadable ({e})") from None
    if r != int(r) or r < 1:
        raise fail(f"{key}: rank {r:g} from the config is not a positive integer")
    return int(r), alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _check_pair(pair: _Pair, r: int, out_in: tuple[int, int], max_rank: int,
                fail: _Fail) -> None:
    """A [r, in] and B [out, r] for this model and config, r <= max_rank, all finite."""
    out_f, in_f = out_in
    if pair.a.dim() == 2 and pair.a.shape[0] > max_rank:
        raise fail(f"{pair.key} has rank {pair.a.shape[0]}, over the cap of {max_rank} "
                   f"(--max-lora-rank {max_rank}); restart with --max-lora-rank >= "
                   f"{pair.a.shape[0]}")
    for name, t, want in ((pair.a_name, pair.a, (r, in_f)), (pair.b_name, pair.b, (out_f, r))):
        if tuple(t.shape) != want:
            raise fail(f"tensor {name} has shape {tuple(t.shape)}, expected {want} for "
                       f"this model (rank {r} per adapter_config.json)")
        if not t.is_floating_point():
            raise fail(f"tensor {name} has dtype {t.dtype}, not floating point")
        if not bool(torch.isfinite(t).all()):
            raise fail(f"tensor {name} has non-finite values (inf or nan)")


def _fuse(fused: str, parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
          shapes: dict[str, tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_f, B_f)`` of ``fused`` from its targeted parts' ``(A, scale * B)``."""
    names = FUSED_MODULES[fused]
    a_f = torch.cat([parts[p][0] for p in names if p in parts]).contiguous()
    b_f = torch.zeros(sum(shapes[p][0] for p in names), a_f.shape[0], dtype=torch.float32)
    row = col = 0
    for p in names:
        if p in parts:
            b = parts[p][1]
            b_f[row:row + b.shape[0], col:col + b.shape[1]] = b
            col += b.shape[1]
        row += shapes[p][0]
    return a_f, b_f
