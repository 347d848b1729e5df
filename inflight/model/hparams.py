"""Architecture hyper-parameters of a decoder-only model, read from GGUF metadata or an HF
``config.json``. Names follow HF transformers' ``LlamaConfig`` / ``Qwen2Config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family model.

    Attributes:
        architecture: ``"llama"`` (Llama 2/3, SmolLM2, TinyLlama, Mistral) or ``"qwen2"``.
        head_dim: per-head size; ``hidden_size // num_attention_heads`` unless overridden.
        rope_scaling: HF's ``rope_scaling`` dict (``rope_type`` "llama3" or "linear"), or None.
        attention_bias: Q/K/V projections carry a bias (Qwen2).
        max_position_embeddings: the context length the model was trained for (tokens).
        eos_token_ids: ids that end generation, from the model's metadata.
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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

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
            ValueError: unsupported ``model_type``, or sliding-window attention in use.
        """
        model_type = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise ValueError(f"model_type {model_type!r} is not supported (llama, mistral, qwen2)")
        if model_type == "mistral" and cfg.get("sliding_window") not in (None, 0):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise ValueError("Mistral with sliding-window attention is not supported")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("Qwen2 with sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 nests theta and scaling under ``rope_parameters``.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
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
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
