"""Architecture hyper-parameters of a decoder-only model, read from GGUF metadata or an HF
``config.json``. Names follow HF transformers' configs (``LlamaConfig``, ``Gemma3TextConfig``,
...); what a family does differently is ``model/architecture.py``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inflight.model.architecture import ARCHITECTURES, Architecture, from_hf_model_type

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family model.

    Attributes:
        architecture: a family of ``model/architecture.py`` (``llama`` for Llama 2/3,
            SmolLM2, TinyLlama and Mistral; ``qwen2``, ``qwen3``, ``phi3``, ``gemma3``).
        head_dim: per-head size; ``hidden_size // num_attention_heads`` unless overridden.
        rope_scaling: HF's ``rope_scaling`` dict (``rope_type`` "llama3" or "linear"), or None.
        attention_bias: Q/K/V projections carry a bias (Qwen2).
        max_position_embeddings: the context length the model was trained for (tokens).
        eos_token_ids: ids that end generation, from the model's metadata.
        sliding_window: keys a windowed layer's query sees (itself included), or None.
        layer_types: ``"sliding_attention"`` / ``"full_attention"`` per layer; empty: every
            layer windowed when ``sliding_window`` is set (Mistral, Phi-3), else full.
        rope_local_theta: the RoPE base of windowed layers where it differs (Gemma 3).
        query_pre_attn_scalar: the softmax scale is its inverse square root (Gemma);
            None: ``head_dim``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, not {self.sliding_window}")

    @property
    def arch(self) -> Architecture:
        """The family's departures from Llama."""
        return ARCHITECTURES[self.architecture]

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys its queries see, itself included), or None
        where it attends to the whole sequence."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windowed(self) -> bool:
        """Some layer has a sliding window."""
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5`` or ``head_dim ** -0.5``."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a parsed HF ``config.json``.

        Raises:
            ValueError: an unsupported ``model_type``, or a feature of it not served yet
                (Qwen2's per-layer windows, partial rotary, logit soft-capping, a
                multimodal Gemma 3 checkpoint).
        """
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3" and "text_config" in cfg:
            raise ValueError("a multimodal Gemma 3 checkpoint (model_type gemma3): serve its "
                             "text model (model_type gemma3_text) or a GGUF of it")
        arch = from_hf_model_type(model_type)
        _refuse_unsupported(model_type, cfg)
        heads = cfg["num_attention_heads"]
        # transformers >= 5 nests theta and scaling under ``rope_parameters``, per layer type
        # where layers differ (Gemma 3).
        rope = cfg.get("rope_parameters") or {}
        local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
        if isinstance(rope.get("full_attention"), dict):
            rope = rope["full_attention"]
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window") if arch.windowed else None
        layer_types = tuple(cfg.get("layer_types") or ())
        if arch.name == "gemma3" and not layer_types:
            pattern = cfg.get("sliding_window_pattern", 6)
            layer_types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(cfg["num_hidden_layers"]))
        return cls(
            architecture=arch.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch.name == "gemma3"),
            attention_bias=arch.qkv_bias or cfg.get("attention_bias", False),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window or None,
            layer_types=layer_types if window else (),
            rope_local_theta=(cfg.get("rope_local_base_freq")
                              or (local or {}).get("rope_theta")) if arch.name == "gemma3" else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if arch.name == "gemma3" else None,
        )


def _refuse_unsupported(model_type: str, cfg: dict[str, Any]) -> None:
    """A clear refusal for what a family's config may ask that the model does not do yet."""
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ValueError(f"{model_type} with use_sliding_window (windows on some layers, "
                         "max_window_layers) is not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {cfg['partial_rotary_factor']} (RoPE on part "
                         "of each head) is not supported")
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su", "yarn", "dynamic"):
        raise ValueError(f"rope_scaling {scaling.get('rope_type', scaling.get('type'))!r} is "
                         "not supported (linear, llama3)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            raise ValueError(f"{key} (Gemma 2's logit soft-capping) is not supported")
