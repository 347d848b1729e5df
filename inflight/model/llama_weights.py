"""Weights for :class:`~inflight.model.llama.LlamaForCausalLM`: HF-named tensors fused into
the model's Q/K/V and gate/up projections, block-quantized for ``--quantization``, and set
as the modules' parameters."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inflight.config import QUANTIZATIONS
from inflight.model.hparams import ModelConfig
from inflight.model.quant import QuantFormat, QuantizedParts, QuantizedWeight, format_of

__all__ = ["fuse_hf_weights", "quantize_fused", "set_parameters"]

# Fused linear layers and the HF weights each is made of, in order.
# (A file may hold a fused one whole: Phi-3's qkv_proj and gate_up_proj.)
_FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}


def fuse_hf_weights(state: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights by their HF-style names (``model.layers.{i}.self_attn.qkv_proj``,
    ``mlp.gate_up_proj``...) from HF-named ``state``: Q/K/V (and their biases) and gate/up
    concatenated along the output rows (or taken whole where the file holds them fused); the
    family's norms (``architecture.py``); ``lm_head.weight`` the embeddings where tied or
    absent.

    Raises:
        ValueError: a weight the config needs is missing from ``state``.
    """
    fused: dict[str, torch.Tensor] = {}
    arch = c.arch
    norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if arch.sandwich_norms:
        norms += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if arch.qk_norm:
        norms += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for fused_name, parts in _FUSED_PARTS.items():
            fused[p + fused_name + ".weight"] = (
                state[p + fused_name + ".weight"] if p + fused_name + ".weight" in state  # Phi-3
                else torch.cat([_take(state, p + part + ".weight") for part in parts]))
        if c.attention_bias:
            fused[p + "self_attn.qkv_proj.bias"] = torch.cat(
                [_take(state, p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        for n in norms:
            fused[p + n] = _take(state, p + n)
    fused["model.embed_tokens.weight"] = _take(state, "model.embed_tokens.weight")
    fused["model.norm.weight"] = _take(state, "model.norm.weight")
    if "lm_head.weight" in state and not c.tie_word_embeddings:
        fused["lm_head.weight"] = state["lm_head.weight"]
    else:
        fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
    return fused


def quantize_fused(fused: dict[str, torch.Tensor], c: ModelConfig, quantization: str,
                   blocks: dict[str, tuple[object, torch.Tensor]],
                   ) -> dict[str, QuantizedWeight | QuantizedParts]:
    """``{fused weight name: QuantizedWeight}`` for ``load_weights``' ``quantization``: every
    linear layer in the format named (the LM head in Q8_0), or for ``gguf`` the layers whose
    parts ``blocks`` holds in formats the kernel has, in those (``QuantizedParts`` where a
    fused layer's parts differ); ``{}`` for ``none``.

    Raises:
        ValueError: an unknown ``quantization``.
    """
    if quantization == "none":
        return {}
    if quantization not in QUANTIZATIONS or quantization == "auto":
        raise ValueError(f"quantization {quantization!r}: use one of {QUANTIZATIONS[1:]}")
    names = {f"model.layers.{i}.{fused_name}.weight":
             [f"model.layers.{i}.{fused_name}.weight"]
             if f"model.layers.{i}.{fused_name}.weight" in blocks  # fused in the file
             else [f"model.layers.{i}.{p}.weight" for p in parts]
             for i in range(c.num_hidden_layers) for fused_name, parts in _FUSED_PARTS.items()}
    names["lm_head.weight"] = (["model.embed_tokens.weight"] if c.tie_word_embeddings
                               else ["lm_head.weight"])
    out: dict[str, QuantizedWeight | QuantizedParts] = {}
    for name, parts in names.items():
        if quantization == "gguf":
            kinds = [k for p in parts if p in blocks and (k := format_of(blocks[p][0])) is not None]
            if len(kinds) < len(parts):
                continue  # a type the kernel has not: this layer stays dense
            if len(set(kinds)) == 1:
                out[name] = QuantizedWeight.from_blocks(   # fused: the parts' rows, in order
                    kinds[0], np.concatenate([blocks[p][1].numpy() for p in parts]))
            else:
                out[name] = QuantizedParts(tuple(QuantizedWeight.from_blocks(k, blocks[p][1].numpy())
                                                 for k, p in zip(kinds, parts)))
        else:
            fmt = QuantFormat[quantization.upper()]
            out[name] = QuantizedWeight.quantize(
                fused[name], QuantFormat.Q8_0 if name == "lm_head.weight" else fmt)
    return out


def embedding_blocks(blocks: dict[str, tuple[object, torch.Tensor]]) -> QuantizedWeight | None:
    """The file's token embeddings as blocks (``gguf``, a model whose LM head is not tied to
    them), where the kernels have the tensor's format; else None (they stay dense)."""
    entry = blocks.get("model.embed_tokens.weight")
    fmt = None if entry is None else format_of(entry[0])
    if entry is None or fmt is None:
        return None
    try:
        return QuantizedWeight.from_blocks(fmt, entry[1].numpy())
    except ValueError:  # rows that are not whole blocks of the format
        return None


def set_parameters(model: nn.Module, fused: dict[str, torch.Tensor], device: torch.device,
                   dtype: torch.dtype) -> None:
    """Make each of ``fused`` (``model.``-prefixed names allowed) the parameter of that name
    in ``model``, frozen, contiguous, on ``device`` in ``dtype``.

    Raises:
        ValueError: a name ``model`` has no parameter for, or a shape other than its own.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in fused.items():
        key = name.removeprefix("model.")
        if key not in params:
            raise ValueError(f"unexpected weight {name}")
        if tuple(params[key].shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[key].shape)}")
        module_name, _, attr = key.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(
            tensor.to(device=device, dtype=dtype).contiguous(), requires_grad=False))


def _take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"missing weight {name}")
    return state[name]
