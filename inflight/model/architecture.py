"""What each decoder family does differently from Llama, written once (issue 52).

One model implementation (``model/llama.py``) serves every family: a family is a small
description of where it departs from Llama 2/3, read by the loader (tensor names, the Q/K
row order llama.cpp stores) and by the layers (norm placement and rounding, activation,
Q/K norms, embedding scale, the window and RoPE base of each layer). Sources: HF
transformers' ``modeling_{llama,mistral,qwen2,qwen3,phi3,gemma3}.py`` (the numerics the tests
compare against) and llama.cpp's ``convert_hf_to_gguf.py`` (what a GGUF holds).

- ``llama``: pre-norm, SiLU-gated MLP, rotate-half RoPE; GGUF Q/K rows permuted (llama.cpp's
  interleaved RoPE). Mistral is Llama with an optional sliding window (GGUF arch ``llama``).
- ``qwen2``: Q/K/V bias; ``qwen3``: no bias, RMSNorm on each query and key head before RoPE.
- ``phi3``: Q/K/V and gate/up stored fused (``qkv_proj``, ``gate_up_proj``).
- ``gemma3``: norms before and after attention and MLP (four a layer), RMSNorm multiplying by
  ``1 + w`` in float32 before rounding (GGUF stores ``1 + w``), Q/K norms, GELU (tanh) gate,
  embeddings scaled by ``sqrt(hidden)``, sliding-window layers with their own RoPE base
  (``rope_local_base_freq``) and global layers every ``sliding_window_pattern``-th, the LM
  head tied.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """A decoder family's departures from Llama.

    Attributes:
        name: ``ModelConfig.architecture``.
        gguf_arches: ``general.architecture`` values a GGUF of this family carries.
        hf_model_types: HF ``config.json`` ``model_type`` values.
        qkv_bias: Q/K/V projections carry a bias.
        qk_norm: RMSNorm over each query and key head (``head_dim``) before RoPE.
        sandwich_norms: norms after attention and after the MLP as well (Gemma 2/3).
        norm_offset: an HF norm weight ``w`` multiplies as ``w + norm_offset`` (Gemma: 1);
            a GGUF stores the multiplier itself.
        norm_scale_in_float32: the weight multiplies the float32 normalized value before it
            is rounded to the activation dtype (Gemma), not after (Llama).
        activation: the MLP gate's ``silu`` or ``gelu_tanh``.
        embed_scale: embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the dtype).
        gguf_permuted_qk: llama.cpp stores Q/K rows permuted for interleaved RoPE.
        fused_gguf: GGUF tensors stored fused (``attn_qkv``; ``ffn_up`` holding gate and up).
        windowed: the family may carry a sliding window (``sliding_window`` in its config).
    """

    name: str
    gguf_arches: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_offset: float = 0.0
    norm_scale_in_float32: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    gguf_permuted_qk: bool = False
    fused_gguf: bool = False
    windowed: bool = False


ARCHITECTURES = {a.name: a for a in (
    Architecture("llama", ("llama",), ("llama", "mistral"), gguf_permuted_qk=True, windowed=True),
    Architecture("qwen2", ("qwen2",), ("qwen2",), qkv_bias=True),
    Architecture("qwen3", ("qwen3",), ("qwen3",), qk_norm=True),
    Architecture("phi3", ("phi3",), ("phi3",), fused_gguf=True, windowed=True),
    Architecture("gemma3", ("gemma3",), ("gemma3_text",), qk_norm=True,
                 sandwich_norms=True, norm_offset=1.0, norm_scale_in_float32=True,
                 activation="gelu_tanh", embed_scale=True, windowed=True),
)}


def architecture(name: str) -> Architecture:
    """The family called ``name``.

    Raises:
        ValueError: an unknown family, naming the supported ones.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def from_gguf_arch(arch: str) -> Architecture:
    """The family of a GGUF's ``general.architecture``.

    Raises:
        ValueError: a GGUF architecture no family reads.
    """
    return _family_naming(arch, "gguf_arches", "GGUF architecture")


def from_hf_model_type(model_type: str) -> Architecture:
    """The family of an HF ``config.json``'s ``model_type``.

    Raises:
        ValueError: a model type no family reads.
    """
    return _family_naming(model_type, "hf_model_types", "model_type")


def _family_naming(name: str, field: str, what: str) -> Architecture:
    """The family whose ``field`` (a tuple of names) holds ``name``; ValueError naming every
    name the families read where none does."""
    for a in ARCHITECTURES.values():
        if name in getattr(a, field):
            return a
    known = ", ".join(n for a in ARCHITECTURES.values() for n in getattr(a, field))
    raise ValueError(f"{what} {name!r} is not supported ({known})")
