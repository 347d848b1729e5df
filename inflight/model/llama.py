"""The decoder stack and LM head of every family served (Llama 2/3, SmolLM2, TinyLlama,
Mistral, Qwen2/3, Phi-3, Gemma 3: ``model/architecture.py``), over a paged KV cache.

References: Touvron et al., "Llama 2" (2023); HF transformers' modeling files (the numerics the
tests compare against); ``modeling_rope_utils.py`` for llama3 RoPE scaling. The layers are
``model/layers.py``; Q/K/V and gate/up projections are fused at load time
(``model/llama_weights``); RoPE is ``model/rope``. A decode step runs
the whole stack in one native call (``decode_layers.c``), every family's layer.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model import kv_quant
from inflight.model.attention import AttentionMetadata
from inflight.model.hparams import ModelConfig
from inflight.model.kernels import (DECODE_LAYER_COLUMNS, FMT_PARTS, SKINNY_MAX_ROWS,
                                    decode_layers, skinny_max_rows)
from inflight.model.kernels.gemm import gemm_path
from inflight.model.layers import DecoderLayer, RMSNorm
from inflight.model.linear import GENERATED_ROWS, Embedding, Linear
from inflight.model.llama_weights import (embedding_blocks, fuse_hf_weights, quantize_fused,
                                          set_parameters)
from inflight.model.lora import LORA_STEP
from inflight.model.quant import QuantizedParts, QuantizedWeight
from inflight.model.rope import rope_inv_freq


class LlamaForCausalLM(nn.Module):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """The decoder stack and LM head.

    Args:
        config: the architecture.
        dtype: parameter and activation dtype (``torch.float32`` or ``torch.bfloat16``).
        device: where parameters live.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        with torch.device("meta"):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                config.arch.norm_scale_in_float32)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.device = torch.device(device)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # windowed layers with a RoPE base of their own (Gemma 3's local layers)
        self.local_inv_freq: torch.Tensor | None = (
            None if config.rope_local_theta is None else
            rope_inv_freq(config, theta=config.rope_local_theta, scaled=False))
        arch = config.arch
        # Gemma scales embeddings by sqrt(hidden), the factor rounded to the dtype as HF's is
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5).to(dtype)
                            if arch.embed_scale else None)

    def load_weights(self, state: dict[str, torch.Tensor], quantization: str = "none",
                     blocks: dict[str, tuple[object, torch.Tensor]] | None = None,
                     repack: bool = True) -> None:
        """Load HF-named weights (``inflight.model.loader``), fusing Q/K/V and gate/up.

        Args:
            state: HF parameter names to float tensors.
            quantization: ``none``; ``gguf`` to keep the file's own block formats
                (``blocks``) where the kernel has them; ``q8_0``, ``q4_0``, ``q4_1`` to
                quantize every linear layer (the LM head at 8 bits, as llama.cpp keeps the
                output layer at 6 or more). Where the block kernels serve every row, a
                quantized layer keeps only its blocks, and the token embeddings are read
                from the tied LM head's blocks (or the file's own); elsewhere its dense
                weight holds the dequantized values (``linear.Linear``).
            blocks: for ``gguf``, HF names to ``(ggml type, uint8 rows)`` of the file's
                tensors (``loader.load_model(..., keep_blocks=True)``).
            repack: where the prompt GEMM has AMX-BF16 tiles, keep a bfloat16 copy of each
                quantized decoder layer packed for it (1.6x the prefill throughput on Gemma 3
                270M; two bytes a weight more); False: the blocks alone (llama.cpp's
                ``--no-repack``).

        Raises:
            ValueError: a missing tensor, a shape that does not match the config, or an
                unknown ``quantization``.
        """
        c = self.config
        if "rope_freqs" in state:
            self.inv_freq = rope_inv_freq(c, state["rope_freqs"])
        fused = fuse_hf_weights(state, c)
        quantized = quantize_fused(fused, c, quantization, blocks or {})
        for name, qw in quantized.items():
            if quantization != "gguf":  # gguf: the state holds these blocks' values already
                fused[name] = qw.dequantize()
        if c.tie_word_embeddings and "lm_head.weight" in quantized:
            fused["model.embed_tokens.weight"] = fused["lm_head.weight"]
        set_parameters(self, fused, self.device, self.dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = self.inv_freq.to(self.device)
        if self.local_inv_freq is not None:
            self.local_inv_freq = self.local_inv_freq.to(self.device)
        self._decode_table = None
        head = quantized.get("lm_head.weight")
        self._attach_quantized(quantized, repack and gemm_path(self.dtype) == "AMX-BF16")
        self.embed_tokens.set_blocks(
            head if c.tie_word_embeddings and isinstance(head, QuantizedWeight)
            else embedding_blocks(blocks or {}) if quantization == "gguf" else None)

    def _attach_quantized(self, quantized: dict[str, QuantizedWeight | QuantizedParts],
                          repack: bool) -> None:
        """Give the ``quantized`` linear layers their blocks, prepack every linear layer
        (``repack``: the decoder layers' quantized ones get a copy for the prompt GEMM), and
        set the paths that follow (``all_quantized``, ``fused_decode_rows``,
        ``quantized_prompts``)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quant = None
        for name, qw in quantized.items():
            module = self.get_submodule(name.removeprefix("model.").rpartition(".")[0])
            module.quant = qw
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(repack and module is not self.lm_head)
        linears = self._layer_linears()
        self.all_quantized = bool(linears) and all(m.quant is not None for m in linears)
        self.fused_decode_rows = sys.maxsize if self.all_quantized else skinny_max_rows()
        self.quantized_prompts = self.all_quantized and all(
            m.blocks_only and m.gemm_packed is None for m in linears)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes the weights hold, each storage once (a tied LM head's blocks serve the
        embeddings too): ``blocks`` (block-quantized layers), ``dense`` (parameters and
        buffers with storage: norms, dense layers, RoPE tables), ``packed`` (copies for the
        prompt GEMM or oneDNN)."""
        seen: set[int] = set()
        out = {"blocks": 0, "dense": 0, "packed": 0}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is None or t.is_meta:
                return
            if t.is_mkldnn:  # oneDNN's opaque layout: no storage to name
                out[kind] += t.numel() * t.element_size()
            elif t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                out[kind] += t.untyped_storage().nbytes()
        for m in self.modules():
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                add("dense", t)
            quant = getattr(m, "quant", None)
            for part in (() if quant is None else getattr(quant, "parts", (quant,))):
                for t in (part.qs, part.scales, part.mins):
                    add("blocks", t)
            add("packed", getattr(m, "gemm_packed", None))
            add("packed", getattr(m, "packed", None))
        return out

    def _layer_linears(self) -> list[Linear]:
        return [m for layer in self.layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    def rope_cos_sin(self, positions: torch.Tensor, local: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``[T, 1, head_dim]`` in the model dtype; ``local``: with
        the windowed layers' own base (``rope_local_theta``)."""
        inv_freq = self.local_inv_freq if local and self.local_inv_freq is not None else self.inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # Decode steps of 1-2 tokens run the whole stack in one native call (decode_layers.c),
    # bit-identical to the modules; False forces the modules (tests compare the two).
    fused_decode: bool = True
    # Most rows a decode step may have for the one-call path: the quantized kernel stays
    # ahead of oneDNN's GEMM for more rows than the skinny one (kernels/__init__.py).
    fused_decode_rows: int = SKINNY_MAX_ROWS
    _step_quant_rows = 0  # the last forward's rule for the LM head (see GENERATED_ROWS)
    # Prompt rows read the blocks too (where the prompt GEMM has no AMX-BF16 tiles for the
    # model's dtype; see GENERATED_ROWS).
    quantized_prompts = False
    # Every decoder layer's linear layers quantized: the one-call path then runs them all
    # on the blocks, so it serves only steps whose rows are all generated tokens.
    all_quantized = False
    # (the KV cache list the table was built for, the table or None, the parts descriptors
    # it points to); holding the list keeps the caches the table points into alive. Cleared
    # by load_weights.
    _decode_table: tuple[list[torch.Tensor], torch.Tensor | None, list[torch.Tensor]] | None = None

    def _decode_layer_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        """The per-layer address table ``decode_layers`` takes, built once per KV cache
        list (the runner keeps one for its life); None where the modules would not run the
        native kernels the C path repeats (another dtype, off CPU)."""
        if self._decode_table is not None and self._decode_table[0] is kv_caches:
            return self._decode_table[1]
        table = None
        # (a layer whose blocks are its weight keeps a meta tensor of the weight's shape)
        tensors = [p for layer in self.layers for p in layer.parameters() if not p.is_meta]
        # The caches in the model's dtype, or all in one 8-bit format, read as the kernels do.
        kv_ok = (len({kv.dtype for kv in kv_caches}) == 1
                 and (kv_caches[0].dtype == self.dtype or kv_quant.is_8bit(kv_caches[0].dtype)))
        parts: list[torch.Tensor] = []  # the descriptors of layers of mixed parts
        if (len(kv_caches) == len(self.layers) and kv_ok
                and all(t.device.type == "cpu" and t.is_contiguous() for t in kv_caches)
                and all(t.device.type == "cpu" and t.dtype == self.dtype and t.is_contiguous()
                        for t in tensors)):
            rows = []
            for layer, kv in zip(self.layers, kv_caches):
                column = _layer_columns(layer, kv, self.local_inv_freq is not None)
                for name, m in (("qkv", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                                ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                    column.update(_linear_columns(name, m, parts))
                rows.append([column[c] for c in DECODE_LAYER_COLUMNS])
            table = torch.tensor(rows, dtype=torch.int64)
        self._decode_table = (kv_caches, table, parts)
        return table

    def _decode_in_one_call(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            local: tuple[torch.Tensor, torch.Tensor] | None,
                            kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        n = x.shape[0]
        if (not self.fused_decode or n > self.fused_decode_rows
                or meta.num_decodes != n
                or (self.all_quantized and self._step_quant_rows != n)
                or meta.timer.enabled or x.device.type != "cpu"):
            return False  # a timed step keeps the modules, so attention can be timed apart
        table = self._decode_layer_table(kv_caches)
        if table is None:
            return False
        c, attn, kv = self.config, self.layers[0].self_attn, kv_caches[0]
        lora = LORA_STEP.get()
        return decode_layers(
            x, table, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate_size=c.intermediate_size,
            eps=self.layers[0].input_layernorm.eps, cos=cos, sin=sin,
            slot_mapping=meta.slot_mapping, block_tables=meta.decode_block_tables,
            seq_lens=meta.decode_seq_lens, block_size=kv.shape[3], num_blocks=kv.shape[2],
            scale=attn.scale, kv_fmt=kv_quant.format_code(kv), activation=c.arch.activation,
            norm_scale_in_float32=c.arch.norm_scale_in_float32, local_cos_sin=local,
            lora=None if lora is None else (lora.row_slots, lora.num_slots, lora.max_rank))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over the flattened step.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
            meta: slot mapping and per-request attention layout.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]`` (normed), model dtype.
        """
        with torch.inference_mode():
            x = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                x = x * self.embed_scale
            cos, sin = self.rope_cos_sin(positions)
            local = self.rope_cos_sin(positions, local=True) if self.local_inv_freq is not None else None
            # The LM head (compute_logits, next) follows the step's rule too: its first rows
            # are the generated ones (each samples).
            self._step_quant_rows = x.shape[0] if self.quantized_prompts else meta.num_generated
            token = GENERATED_ROWS.set(self._step_quant_rows)
            try:
                if not self._decode_in_one_call(x, cos, sin, local, kv_caches, meta):
                    for layer, kv_cache in zip(self.layers, kv_caches):
                        c, s = local if local is not None and layer.self_attn.window else (cos, sin)
                        x = layer(x, c, s, kv_cache, meta)
            finally:
                GENERATED_ROWS.reset(token)
            return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, prompt_rows: bool = False,
                       generated_rows: int | None = None) -> torch.Tensor:
        """``[num_rows, hidden]`` -> ``[num_rows, vocab_size]`` float32 logits of the rows of
        the last ``forward`` (its rule for generated rows applies: the first
        ``generated_rows`` of ``hidden`` are generated tokens' rows, default the forward's
        count), or with ``prompt_rows`` of prompt positions only (prompt logprobs), through
        the dense LM head where one is kept (the more exact of the two), else its blocks: a
        block-quantized LM head whose kernels serve every row keeps no dense copy
        (``Linear.blocks_only``), so every row of it, sampled or scored, reads the blocks."""
        rows = self._step_quant_rows
        if generated_rows is not None and not self.quantized_prompts:
            rows = generated_rows
        with torch.inference_mode():
            token = GENERATED_ROWS.set(0 if prompt_rows else rows)
            try:
                return self.lm_head(hidden).float()
            finally:
                GENERATED_ROWS.reset(token)


def _layer_columns(layer: DecoderLayer, kv: torch.Tensor, local_rope: bool) -> dict[str, int]:
    """A layer's decode-table columns other than its linear layers': norms (0 where the family
    has none), its KV cache, window (0: none) and whether it takes the local RoPE tables."""
    attn = layer.self_attn

    def norm(m: RMSNorm | None) -> int:
        return 0 if m is None else m.weight.data_ptr()
    # Only qkv_proj may have a bias; the other projections are built without.
    return {"input_norm": norm(layer.input_layernorm),
            "qkv_bias": 0 if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data_ptr(),
            "post_norm": norm(layer.post_attention_layernorm), "kv_cache": kv.data_ptr(),
            "q_norm": norm(attn.q_norm), "k_norm": norm(attn.k_norm),
            "pre_ff_norm": norm(layer.pre_feedforward_layernorm),
            "post_ff_norm": norm(layer.post_feedforward_layernorm),
            "window": attn.window or 0, "local_rope": int(local_rope and bool(attn.window))}


def _linear_columns(name: str, m: Linear, parts: list[torch.Tensor]) -> dict[str, int]:
    """A linear layer's six columns of the decode table: the weight (or packed blocks, or a
    parts descriptor, appended to ``parts``, which the caller keeps alive), its format (0 =
    dense), block scales and Q4_1's minimums, its LoRA slots' A and B (0 where unused)."""
    lora = {f"{name}_lora_a": 0 if m.lora_a is None else m.lora_a.data_ptr(),
            f"{name}_lora_b": 0 if m.lora_b is None else m.lora_b.data_ptr()}
    if m.quant is None:
        return {name: m.weight.data_ptr(), f"{name}_fmt": 0, f"{name}_scales": 0,
                f"{name}_mins": 0, **lora}
    q = m.quant
    if isinstance(q, QuantizedParts):  # decode_layers.c's FMT_PARTS descriptor
        parts.append(torch.tensor([len(q.parts)] + [
            v for p in q.parts for v in (int(p.fmt), p.qs.data_ptr(), p.scales.data_ptr(),
                                         0 if p.mins is None else p.mins.data_ptr(), p.num_rows)],
            dtype=torch.int64))
        return {name: parts[-1].data_ptr(), f"{name}_fmt": FMT_PARTS, f"{name}_scales": 0,
                f"{name}_mins": 0, **lora}
    return {name: q.qs.data_ptr(), f"{name}_fmt": int(q.fmt),
            f"{name}_scales": q.scales.data_ptr(),
            f"{name}_mins": 0 if q.mins is None else q.mins.data_ptr(), **lora}
