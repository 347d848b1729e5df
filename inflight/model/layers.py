"""The decoder's layers, one implementation for every family (``model/architecture.py`` says
where a family departs from Llama), over a paged KV cache.

References: HF transformers' ``modeling_llama.py``, ``modeling_qwen3.py``, ``modeling_phi3.py``
and ``modeling_gemma3.py``, whose numerics the tests compare against (RMSNorm in float32,
rotate-half RoPE, gated MLP). All non-attention work runs on one flattened ``[num_tokens,
hidden]`` tensor for the whole step (selective batching, Orca OSDI 2022); attention is per
request over its blocks (``model.attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.attention import AttentionMetadata, paged_attention, write_kv
from inflight.model.hparams import ModelConfig
from inflight.model.kernels import act_and_mul, rms_norm
from inflight.model.linear import Linear
from inflight.model.rope import apply_rope


class RMSNorm(nn.Module):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """RMSNorm (Zhang and Sennrich, 2019) with HF's rounding; ``[..., size]`` in and out.

    ``weight`` is the multiplier itself (Gemma's ``1 + w`` already added at load). With
    ``scale_in_float32`` (Gemma) it multiplies the float32 normalized value before the one
    rounding to the input's dtype; else (Llama, Qwen) the normalized value is rounded first.
    """

    def __init__(self, size: int, eps: float, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # None off CPU or without the kernels
        y = rms_norm(flat, self.weight, self.eps, scale_in_float32=self.scale_in_float32)
        if y is not None:
            return y.view(x.shape)
        if self.scale_in_float32:
            return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
                    * self.weight.float()).to(x.dtype)
        # HF's order: normalize in float32, cast back, then scale. One fused op where the
        # input is float32 already (the same arithmetic, without six dispatches).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(nn.Module):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """Self-attention with fused Q/K/V, optional Q/K norms, RoPE, an optional sliding window
    and the paged KV cache; ``[T, hidden]`` in and out."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        arch = config.arch
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, arch.norm_scale_in_float32)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, arch.norm_scale_in_float32)
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Q and K heads are adjacent: one RoPE over both.
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        with meta.timer.section("attention"):
            write_kv(kv_cache, k, v, meta.slot_mapping)
            o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(o)


class MLP(nn.Module):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """The gated MLP with fused gate/up (SiLU, or GELU with tanh for Gemma); ``[T, hidden]``
    in and out."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.activation = config.arch.activation
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = act_and_mul(gate_up, self.activation)  # one native pass on CPU; None elsewhere
        if h is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            h = (F.silu(gate) if self.activation == "silu"
                 else F.gelu(gate, approximate="tanh")) * up
        return self.down_proj(h)


class DecoderLayer(nn.Module):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """Pre-norm attention and MLP blocks, each added to the residual stream; with sandwich
    norms (Gemma) each block's output is normed again before the add."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        arch = config.arch
        eps, f32 = config.rms_norm_eps, arch.norm_scale_in_float32
        self.input_layernorm = RMSNorm(config.hidden_size, eps, f32)
        self.self_attn = Attention(config, layer)
        # Llama's (and HF's) name for the norm before the MLP
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, f32)
        self.mlp = MLP(config)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if arch.sandwich_norms:  # post_attention_layernorm then follows attention
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, f32)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, f32)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decoder layer over ``x`` ``[T, hidden]``: attention, then the MLP, each added
        to the residual stream."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
