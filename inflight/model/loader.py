"""Weight loading: a GGUF file (dequantized with the ``gguf`` package) or an HF model
directory (``config.json`` + ``*.safetensors``), into HF-named float tensors.

GGUF tensor names and the Q/K row permutation follow llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel.permute``, Llama-arch files only), which this module inverts so one model
implementation (``inflight.model.llama``, HF's rotate-half RoPE) serves both sources. Norm
weights are read as multipliers: a GGUF of Gemma stores ``1 + w``, so its HF folders get
``norm_offset`` added (``model/architecture.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inflight.model.architecture import Architecture, from_gguf_arch
from inflight.model.hparams import ModelConfig

logger = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where a family names a layer tensor otherwise: Gemma's ffn_norm is the norm before the MLP
# and post_attention_norm the one after attention; fused files (Phi-3) hold Q/K/V and
# gate/up whole.
_GGUF_FAMILY_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm":
               "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GGUF_LAYER_NAMES.update({"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def load_model(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a model's config and weights.

    Args:
        path: a ``.gguf`` file or an HF model directory.

    Returns:
        ``(config, state_dict)``: HF parameter names (``model.layers.0.self_attn.q_proj.weight``,
        ...) to float32 (GGUF) or stored-dtype (safetensors) CPU tensors. A GGUF file with
        llama3 RoPE factors adds ``rope_freqs`` of shape ``[head_dim // 2]``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: unsupported architecture or tensor type.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
    if p.is_dir():
        return _load_hf_dir(p)
    return _load_gguf(p)


def read_gguf_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """``ModelConfig`` from a GGUF's metadata (``{arch}.*`` keys) and its tensor names.

    Raises:
        ValueError: an architecture no family of ``model/architecture.py`` reads.
    """
    arch = metadata.get("general.architecture")
    family = from_gguf_arch(str(arch))

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    layers = get("block_count")
    window = get("attention.sliding_window") if family.windowed else None
    layer_types: tuple[str, ...] = ()
    local_theta = None
    if family.name == "gemma3" and window:
        # llama.cpp's gemma3: every sixth layer global, local layers at RoPE base 10,000 (the
        # file carries neither; HF's config for the model says the same)
        layer_types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                            for i in range(layers))
        local_theta = 10000.0
    return ModelConfig(
        architecture=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=scaling,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        sliding_window=window or None,
        layer_types=layer_types,
        rope_local_theta=local_theta,
    )


def _load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    from inflight.model.gguf_file import read_gguf_tensors

    metadata, tensors = read_gguf_tensors(path)
    config = read_gguf_config(metadata, {t.name for t in tensors})
    state: dict[str, torch.Tensor] = {}
    for t in tensors:
        name = _hf_name(t.name, config.arch)
        if name is None:
            logger.warning("ignoring unknown GGUF tensor %s", t.name)
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.qtype)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name}: type {t.qtype.name} unsupported") from e
        # A copy: unquantized tensors come back as read-only views of the mapped file.
        tensor = torch.from_numpy(np.array(array, dtype=np.float32).reshape(t.shape))
        if config.arch.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = (config.num_attention_heads if "q_proj" in name
                      else config.num_key_value_heads)
            tensor = _unpermute_qk(tensor, n_head)
        state[name] = tensor
    return config, state


def read_gguf_blocks(path: str | os.PathLike[str], config: ModelConfig,
                     types: set[str] | None = None) -> dict[str, tuple[Any, torch.Tensor]]:
    """The raw blocks of a GGUF file's tensors, for ``--quantization gguf``: HF parameter
    names to ``(ggml type, uint8 [rows, bytes a row])`` copies, Q/K rows in HF's order (the
    same row permutation ``load_model`` applies to the values; a row's blocks stay whole).

    Args:
        types: the ggml type names to read (``{"Q4_0", ...}``); None reads every 2-D tensor.

    Raises:
        ValueError: not a GGUF v2/v3 file, or a corrupt header.
    """
    from inflight.model.gguf_file import read_gguf_tensors

    _, tensors = read_gguf_tensors(path)
    blocks: dict[str, tuple[Any, torch.Tensor]] = {}
    for t in tensors:
        name = _hf_name(t.name, config.arch)
        if name is None or t.data.ndim != 2 or (types is not None and t.qtype.name not in types):
            continue
        rows = torch.from_numpy(np.array(t.data, dtype=np.uint8))
        if config.arch.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = (config.num_attention_heads if "q_proj" in name
                      else config.num_key_value_heads)
            rows = rows[_qk_row_order(rows.shape[0], n_head)].contiguous()
        blocks[name] = (t.qtype, rows)
    return blocks


def _hf_name(gguf_name: str, arch: Architecture) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        return None
    names = {**_GGUF_LAYER_NAMES, **_GGUF_FAMILY_NAMES.get(arch.name, {})}
    if m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _qk_row_order(rows: int, n_head: int) -> torch.Tensor:
    """Row ``i`` of HF's Q/K weight is row ``order[i]`` of llama.cpp's, whose RoPE pairs are
    interleaved where HF's are rotate-half halves."""
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    return w[_qk_row_order(w.shape[0], n_head)].contiguous()


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    config = ModelConfig.from_hf_config(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    if config.arch.norm_offset:  # HF's w multiplies as w + offset; the model holds the multiplier
        for name in [n for n in state if n.endswith("norm.weight")]:
            state[name] = state[name].float() + config.arch.norm_offset
    return config, state
