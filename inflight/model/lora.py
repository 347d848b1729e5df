"""LoRA adapters in the flattened batch: slots of stacked low-rank weights per linear layer,
and the step's row-to-slot map (multi-LoRA serving as Punica / S-LoRA, vLLM's LoRA slots).

Each adapted ``Linear`` holds ``max_loras`` slots side by side: ``lora_a`` ``[in, slots *
W]`` (A transposed) and ``lora_b`` ``[slots * W, out]`` (B transposed), ``W = parts *
max_rank`` (3 parts for the fused q/k/v, 2 for gate/up, else 1). An adapter's fused A and
block-diagonal B, its scaling folded into B, fill the first columns of its slot, zeros the
rest. The base weights (dense or block-quantized) are untouched: a step with adapter rows
adds each row's ``(x @ A_s) @ B_s`` to the layer's output.

On CPU the native kernel (``kernels/lora.c``) computes each row alone over its own slot's
columns, the same bits in any batch, and the one-call decode path runs it too. Elsewhere
(CUDA) two GEMMs over the slots in use, with a mask keeping each row's own slot's columns.
A base row gets nothing added: the same bits as without adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from inflight.model.kernels.native_lib import native_for, thread_count

# Fused module name -> how many HF projections it stacks (llama_weights.fuse_hf_weights).
FUSED_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


class Adapter(Protocol):
    """What a slot is filled from (``inflight.lora.adapter.LoRAAdapter``)."""

    name: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoRAStep:
    """One step's rows' slots. ``row_slots`` ``[num_tokens]`` int64, -1 for a base-model
    row; ``num_slots`` slots of rank ``max_rank``; only the first ``num_used`` take part
    (the highest slot a row uses, plus one: slots fill from 0, so one adapter reads one
    slot); the PyTorch path's masks ``[num_tokens, num_used * W]`` (model dtype) are built
    once per width ``W``."""

    row_slots: torch.Tensor
    num_slots: int
    max_rank: int
    num_used: int
    dtype: torch.dtype
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, width: int) -> torch.Tensor:
        m = self._masks.get(width)
        if m is None:
            cols = torch.arange(self.num_used * width, device=self.row_slots.device) // width
            m = (self.row_slots[:, None] == cols[None, :]).to(self.dtype)
            self._masks[width] = m
        return m


# The running step's LoRA rows (set by the runner around the forward); None: no adapter row.
LORA_STEP: ContextVar[LoRAStep | None] = ContextVar("lora_step", default=None)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             step: LoRAStep) -> torch.Tensor:
    """``y`` ``[T, out]`` (the layer's output for ``x`` ``[T, in]``) plus each row's
    adapter's low-rank product; ``lora_a`` ``[in, slots * W]``, ``lora_b`` ``[slots * W,
    out]``. On CPU ``y`` (fresh, contiguous) is updated in place and returned."""
    width = lora_b.shape[0] // step.num_slots
    lib = native_for(x, y, lora_a, lora_b)
    if lib is not None and x.dim() == 2 and y.is_contiguous():
        x = x.contiguous()
        rc = lib.lora_add(int(x.dtype == torch.bfloat16), x.data_ptr(), y.data_ptr(),
                          x.shape[0], y.shape[1], x.shape[1], lora_a.data_ptr(),
                          lora_b.data_ptr(), step.num_slots, width, step.row_slots.data_ptr(),
                          thread_count(None))
        if rc == -3:
            raise MemoryError("lora_add: out of memory")
        if rc == 0:
            return y
    used = step.num_used * width
    xa = (x @ lora_a[:, :used]) * step.mask(width)
    return y + xa @ lora_b[:used]


class LoRASlots:
    """The ``max_loras`` slots of every adapted linear layer and which adapter is in each.

    Args:
        model: the loaded ``LlamaForCausalLM`` (its decoder layers' linear layers get
            ``lora_a`` / ``lora_b`` slot tensors in the model dtype).
        max_loras: slots, the most adapters one step may use (``--max-loras``).
        max_rank: the largest rank an adapter may have (``--max-lora-rank``).
    """

    def __init__(self, model: Any, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self._last_used: list[int] = [0] * max_loras
        self._clock = 0
        model._decode_table = None  # the one-call path's table gains the slots' addresses
        for i, layer in enumerate(model.layers):
            for name, module in _adapted(layer):
                w = FUSED_PARTS[name] * max_rank * max_loras
                module.lora_a = torch.zeros(module.in_features, w, dtype=model.dtype,
                                            device=model.device)
                module.lora_b = torch.zeros(w, module.out_features, dtype=model.dtype,
                                            device=model.device)

    def step(self, row_ids: Sequence[int], get: Callable[[int], Adapter]) -> LoRAStep | None:
        """The slots of one step whose rows belong to adapters ``row_ids`` (one id per
        row, 0 = base), loading adapters not in a slot (``get(id)``) into the least
        recently used slots no row of this step needs; None when every row is base.

        Raises:
            RuntimeError: the step uses more adapters than slots (the scheduler's
                ``max_loras`` cap prevents it).
        """
        ids = sorted(set(row_ids) - {0})
        if not ids:
            return None
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step with {len(ids)} adapters, {self.max_loras} slots")
        self._clock += 1
        needed = {self.slot_of[i] for i in ids if i in self.slot_of}
        for adapter_id in ids:
            if adapter_id not in self.slot_of:
                # an empty slot, lowest first (fewer slots to read), else the least
                # recently used one this step does not need
                taken = set(self.slot_of.values())
                slot = min((s for s in range(self.max_loras) if s not in needed),
                           key=lambda s: (s in taken, self._last_used[s], s))
                self._load(slot, adapter_id, get(adapter_id))
                needed.add(slot)
            self._last_used[self.slot_of[adapter_id]] = self._clock
        slots = [self.slot_of[i] if i else -1 for i in row_ids]
        return LoRAStep(torch.tensor(slots, dtype=torch.long, device=self.model.device),
                        self.max_loras, self.max_rank, max(slots) + 1, self.model.dtype)

    def evict(self, adapter_id: int) -> None:
        """Forget ``adapter_id``'s slot (an unloaded adapter; its id is never reused)."""
        self.slot_of.pop(adapter_id, None)

    def _load(self, slot: int, adapter_id: int, adapter: Adapter) -> None:
        for old, s in list(self.slot_of.items()):
            if s == slot:
                del self.slot_of[old]
        for i, layer in enumerate(self.model.layers):
            for name, module in _adapted(layer):
                w = module.lora_b.shape[0] // self.max_loras
                cols = slice(slot * w, (slot + 1) * w)
                module.lora_a[:, cols].zero_()
                module.lora_b[cols].zero_()
                pair = adapter.weights.get((i, name))
                if pair is not None:
                    a, b = pair  # [r, in], [out, r]
                    r = a.shape[0]
                    module.lora_a[:, slot * w:slot * w + r].copy_(a.t())
                    module.lora_b[slot * w:slot * w + r].copy_(b.t())
        self.slot_of[adapter_id] = slot


def _adapted(layer: Any) -> list[tuple[str, Any]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
            ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)]
