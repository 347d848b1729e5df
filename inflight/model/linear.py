"""The model's linear layer and the rule that picks a row's kernel (batch invariance).

A step's rows are its generated tokens' rows first, then prompt rows (the runner's order,
``core.output.split_rows``); ``GENERATED_ROWS`` counts the first. They take the row kernels,
the rest the prompt GEMM (``kernels/gemm.c``), whatever else the step holds: docs/
architecture.md, "Batch invariance"; "Defeating Nondeterminism in LLM Inference" (Thinking
Machines, 2025).
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.kernels import quant_linear, quant_rows, skinny_linear, skinny_max_rows
from inflight.model.kernels.gemm import gemm_linear, gemm_pack
from inflight.model.kernels.native_lib import quantized_kernels_vectorized
from inflight.model.lora import LORA_STEP, add_lora
from inflight.model.quant import QuantizedParts, QuantizedWeight


def _can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# The leading rows of this step that take the row kernels: a block-quantized Linear's int8
# kernel (``quant_linear``), a dense one's skinny kernel (``skinny_linear``); the other rows
# take the dequantized or dense weights through the prompt GEMM (``gemm_linear``, packed
# once). The model's forward sets the step's generated (output) tokens' rows
# (AttentionMetadata.num_generated: decodes, drafts, and output tokens recomputed after a
# preemption, all placed first by the runner), or every row where prompts are quantized too
# (``quantized_prompts``). A token thus takes the same path whatever the batch, the
# chunking, a prefix-cache hit or a preemption, and every path gives a row the same bits
# whatever rows share its call (each kernel reduces a row alone, in an order fixed by its
# code: tests/model/test_batch_invariance.py on each CPU path). So greedy output does not
# depend on who else is in the batch ("Defeating Nondeterminism in LLM Inference", Thinking
# Machines, 2025). oneDNN's GEMM is not used for it: with AMX tiles it changes a row's bits
# with the row count (issue 50). Measured, the int8 kernel is faster than a bfloat16 GEMM
# for a decode step of every size up to 256 rows (docs/performance.md); prompts, hundreds of
# rows at once, go to the GEMM where it has AMX-BF16 tiles, to the int8 kernel elsewhere.
GENERATED_ROWS: ContextVar[int] = ContextVar("generated_rows", default=0)

# False: the rule before batch invariance, for benchmarks: a dense Linear's rows go to the
# skinny kernel when there are at most ``kernels.skinny_max_rows`` of them, else to oneDNN
# (its weight reordered on first use), generated or not.
BATCH_INVARIANT = True


class Linear(nn.Linear):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """``nn.Linear`` whose weight, on CPU, is also packed once for the prompt GEMM
    (``kernels.gemm``), and optionally kept in a block format (``quant``,
    ``--quantization``).

    With ``quant`` set, the step's generated rows read the blocks (``GENERATED_ROWS``;
    ``kernels.quant_linear``). Where those kernels are vectorized (``blocks_only``), the
    blocks are the weight: ``weight`` keeps only its shape (a ``meta`` tensor), and prompt
    rows read the blocks too, or a bfloat16 copy packed for the prompt GEMM where
    ``prepack(repack=True)`` made one (AMX-BF16 tiles: 1.6x the prefill throughput on
    Gemma 3 270M, at two bytes a weight). Elsewhere ``weight`` holds the blocks'
    dequantized values, so every path computes with the same weights. Without the native library (or off CPU) the
    prompt rows take oneDNN's prepacked weight (plain ``F.linear`` hands oneDNN a row-major
    weight it may reorder every call), or ``F.linear``.
    """

    weight: torch.Tensor  # a meta tensor of the shape where the blocks are the weight
    gemm_packed: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN's layout, where gemm_packed is not had
    quant: QuantizedWeight | QuantizedParts | None = None
    # LoRA slots (``model.lora.LoRASlots``), added to the step's adapter rows.
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def prepack(self, repack: bool = False) -> None:
        """Pack the weight for the prompt GEMM; for a quantized layer whose blocks serve
        every row (``blocks_only``), drop the dense weight, first packing a copy of it for
        the prompt GEMM where ``repack``."""
        self.packed = self.gemm_packed = None
        cpu = self.weight.device.type == "cpu"
        if self.quant is not None and (self.weight.is_meta or blocks_serve_every_row(self.weight)):
            if repack and not self.weight.is_meta:
                self.gemm_packed = gemm_pack(self.weight)
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype,
                                                   device="meta"), requires_grad=False)
            return
        self.gemm_packed = gemm_pack(self.weight) if cpu else None
        if self.gemm_packed is None:
            self.packed = onednn_pack(self.weight)

    @property
    def blocks_only(self) -> bool:
        """The blocks are the weight (``prepack``): no dense values are kept."""
        return self.quant is not None and self.weight.is_meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        if self.lora_a is not None and self.lora_b is not None:
            step = LORA_STEP.get()
            if step is not None:
                y = add_lora(x, y, self.lora_a, self.lora_b, step)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks_only and self.gemm_packed is None:
            return self._on_blocks(x)  # every row: one call
        rows = GENERATED_ROWS.get()
        if x.dim() != 2 or rows <= 0:
            return self._gemm(x)
        head = self._rows(x[:rows] if rows < x.shape[0] else x)
        if head is None:  # no native kernel for these inputs: PyTorch's path for all
            return self._gemm(x)
        # generated rows first, then prompt rows
        return head if rows >= x.shape[0] else torch.cat([head, self._gemm(x[rows:])])

    def _rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The row kernel: each row reduced alone, the same bits in any batch."""
        if self.quant is not None:
            return quant_linear(x, self.quant, self.bias)
        if not BATCH_INVARIANT and x.shape[0] > skinny_max_rows():
            return self._gemm(x)
        # Streams the weight once for a decode step's few rows, in groups over blocks of
        # it for many (skinny_linear; None off CPU or for another dtype). It needs no
        # packed weight: a CPU whose oneDNN cannot reorder bfloat16 (AVX2) still gets it.
        return skinny_linear(x, self.weight, self.bias)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows: the packed GEMM, a row the same bits in any batch."""
        if BATCH_INVARIANT and self.gemm_packed is not None and x.dim() == 2 and x.shape[0]:
            y = gemm_linear(x, self.gemm_packed, self.out_features, self.bias)
            if y is not None:
                return y
        if self.blocks_only:
            return self._on_blocks(x)
        return self._onednn(x)

    def _on_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Any rows on the blocks, for a layer that keeps no dense weight.

        Raises:
            RuntimeError: inputs the kernel does not take (another device or dtype): the
                layer has no other weights to multiply.
        """
        assert self.quant is not None
        flat = x.reshape(-1, x.shape[-1])
        y = quant_linear(flat, self.quant, self.bias) if flat.shape[0] else flat.new_empty(
            0, self.out_features)
        if y is None:
            raise RuntimeError(f"a {tuple(x.shape)} {x.dtype} input on {x.device}: the "
                               "block kernels do not take it, and this layer keeps no "
                               "dense weight")
        return y.reshape(*x.shape[:-1], self.out_features)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's GEMM (or the rule before batch invariance's skinny rows): where the
        library is not built, and for ``benchmarks/batch_invariance.py``'s baseline."""
        if not BATCH_INVARIANT:
            if x.dim() == 2 and x.shape[0] <= skinny_max_rows():
                y = skinny_linear(x, self.weight, self.bias)
                if y is not None:
                    return y
            if self.packed is None:
                self.packed = onednn_pack(self.weight)
        if self.packed is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):  # type: ignore[misc]  # nn.* is Any: torch is not followed
    """``nn.Embedding`` whose matrix may be a block-quantized weight's rows (``quant``,
    ``set_blocks``): a tied LM head's blocks, or the file's own, gathered and dequantized a
    token at a time (``kernels.quant_rows``), the values of the dense matrix to the bit."""

    weight: torch.Tensor
    quant: QuantizedWeight | None = None

    def set_blocks(self, quant: QuantizedWeight | None) -> None:
        """Read rows from ``quant`` (``[num_embeddings, embedding_dim]``) and drop the dense
        matrix, where the block kernels serve this CPU; else keep it."""
        self.quant = None
        if quant is None or not blocks_serve_every_row(self.weight):
            return
        if quant.shape != tuple(self.weight.shape):
            raise ValueError(f"embedding blocks {quant.shape}, expected {tuple(self.weight.shape)}")
        self.quant = quant
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype,
                                               device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return super().forward(ids)
        rows = quant_rows(self.quant, ids)
        assert rows is not None  # set_blocks: only where the library is built
        return rows.to(self.weight.dtype)


def blocks_serve_every_row(weight: torch.Tensor) -> bool:
    """Whether a layer of this dense ``weight``'s device and dtype, once quantized, can run
    every row on its blocks: on CPU, float32 or bfloat16, with the vectorized block kernels
    (``quantized_kernels_vectorized``; the scalar fallback keeps the dense weight for
    prompt rows)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and quantized_kernels_vectorized())


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered into oneDNN's blocked layout, or None where oneDNN cannot
    (another device or dtype; bfloat16 on a CPU without a bf16 path, AVX2)."""
    if not _can_prepack(weight.device, weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:
        return None
