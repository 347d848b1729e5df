"""The model runner: ``SchedulerOutput`` -> tensors -> forward -> logits -> sampled tokens.

Owns the KV cache tensors (one per layer) and the step's input preparation: input ids,
positions, slot mapping, block tables, sequence lengths. Holds no request state of its own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch

from inflight.core.output import SampleResult, ScheduledRequest, SchedulerOutput, split_rows
from inflight.faults import FAULTS
from inflight.model import kv_quant
from inflight.model.attention import AttentionMetadata, PrefillChunk
from inflight.model.hparams import ModelConfig
from inflight.model.llama import LlamaForCausalLM
from inflight.model.lora import LORA_STEP, Adapter, LoRASlots, LoRAStep
from inflight.model.pooler import pool_rows
from inflight.model.thread_team import make_team
from inflight.profiling import NULL_TIMER
from inflight.request import Request
from inflight.sampler import Sampler

logger = logging.getLogger(__name__)

# Prompt rows sent through the LM head at once for prompt logprobs (a row's float32 logits
# are vocab_size * 4 bytes: 256 rows of a 49k vocabulary are 50 MB).
PROMPT_LOGITS_ROWS = 256


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (keys and values), in a cache of ``dtype``
    (an 8-bit one with its per-row scales: ``kv_quant``)."""
    elem: int = torch.empty((), dtype=dtype).element_size()
    row = kv_quant.row_width(config.head_dim, dtype)
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * row * elem


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. Masked KV slots (block-table padding, the unwritten tail of a last
    block) still enter P @ V with weight 0, so they must never hold NaN bit patterns.
    On CPU the zeros come from ``calloc`` (numpy), which maps fresh zero pages lazily:
    ``torch.zeros`` would touch every page up front (~7 s for a 4 GiB pool here)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    """Runs the model for one scheduled step.

    Args:
        model: a loaded ``LlamaForCausalLM``.
        num_blocks: KV blocks to preallocate.
        block_size: tokens per block.
        kv_cache_dtype: element type of the KV cache (``torch.int8`` or
            ``torch.float8_e4m3fn``: the 8-bit formats of ``model.kv_quant``).
        sampler: the sampler applied to the logits.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 kv_cache_dtype: torch.dtype, sampler: Sampler) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = sampler
        c = model.config
        shape = (2, c.num_key_value_heads, num_blocks, block_size,
                 kv_quant.row_width(c.head_dim, kv_cache_dtype))
        self.kv_caches = [_zeros(shape, kv_cache_dtype, self.device)
                          for _ in range(c.num_hidden_layers)]
        self.step_timer = NULL_TIMER  # the engine hands in its own
        # CPU threads sized to the cores other processes leave (model/thread_team.py)
        self.threads = make_team(self.device)
        self.lora_slots: LoRASlots | None = None
        self._lora_adapter: Callable[[int], Adapter] | None = None

    def enable_lora(self, max_loras: int, max_rank: int,
                    adapter: Callable[[int], Adapter]) -> None:
        """Give every decoder linear layer ``max_loras`` adapter slots of rank
        ``max_rank`` (``model.lora.LoRASlots``); ``adapter(id)`` returns the adapter of a
        request's ``lora_id`` when a step needs it in a slot."""
        self.lora_slots = LoRASlots(self.model, max_loras, max_rank)
        self._lora_adapter = adapter

    def release(self, request_id: str) -> None:
        """Forget a finished request's per-request state (its sampler generator)."""
        self.sampler.release(request_id)

    def execute(self, out: SchedulerOutput) -> list[SampleResult]:
        """Run one step; returns the sampled tokens of the requests that completed their
        tokens: one each, or for a request verifying drafts the ones it keeps."""
        FAULTS.check("runner")
        if self.threads is not None:
            self.threads.adapt()
        logits, requests, drafts = self.compute_logits(out)
        if not requests:
            return []
        with self.step_timer.section("sample"):
            return self.sampler.sample(logits, requests,
                                       drafts if any(drafts) else None)

    def compute_logits(self, out: SchedulerOutput
                       ) -> tuple[torch.Tensor | None, list[Request], list[list[int]]]:
        """Forward the step; logits ``[num_sampling_rows, vocab]`` float32, their requests
        and each request's drafts.

        Only rows that sample reach the LM head: a request's last known token, and for one
        verifying drafts every draft row after it too (``1 + len(drafts)`` rows, in order).
        """
        # Generated tokens' rows first (decodes, draft rows, output tokens recomputed after
        # a preemption), then prompt chunks: the model's rule for generated rows is about
        # the leading rows, and only generated rows attend as decodes.
        decodes, prefills = split_rows(out.scheduled)  # decodes: generated rows only
        timer = self.step_timer
        with timer.section("prepare"):
            input_ids, positions, meta = self._prepare(decodes, prefills)
            meta.timer = timer
            meta.num_generated = sum(s.num_scheduled_tokens for s in decodes)
            rows: list[int] = []
            requests, drafts, prompt_rows, pooled_rows = [], [], [], []
            row = 0
            for s in decodes + prefills:
                if s.request.needs_prompt_logprobs:
                    prompt_rows.append((s, row))
                if s.request.sampling_params.pooling is not None:
                    pooled_rows.append((s, row))
                row += s.num_scheduled_tokens
                if s.samples:
                    rows.extend(range(row - 1 - s.num_draft_tokens, row))
                    requests.append(s.request)
                    drafts.append(s.draft_token_ids)
            index = torch.tensor(rows, device=self.device) if rows else None
            # the sampled rows of generated tokens lead the LM head's rows too
            generated_samples = sum(1 + s.num_draft_tokens for s in decodes if s.samples)
            lora = self._lora_step(decodes + prefills)
        with timer.section("forward"):
            token = LORA_STEP.set(lora)
            try:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            finally:
                LORA_STEP.reset(token)
            for s, first_row in prompt_rows:
                self._record_prompt_logprobs(hidden, s, first_row)
            for s, first_row in pooled_rows:
                pool_rows(hidden, s, first_row)
            if index is None:
                return None, [], []
            return (self.model.compute_logits(hidden.index_select(0, index),
                                              generated_rows=generated_samples),
                    requests, drafts)

    def _lora_step(self, scheduled: list[ScheduledRequest]) -> LoRAStep | None:
        """The step's adapter rows (None without LoRA or without an adapter row)."""
        if self.lora_slots is None or self._lora_adapter is None:
            return None
        row_ids = [s.request.lora_id for s in scheduled for _ in range(s.num_scheduled_tokens)]
        return self.lora_slots.step(row_ids, self._lora_adapter)

    def _record_prompt_logprobs(self, hidden: torch.Tensor, s: ScheduledRequest,
                                first_row: int) -> None:
        """Append the prompt logprobs this step's rows of ``s`` give (vLLM's
        ``prompt_logprobs``): position ``p``'s logits score prompt token ``p + 1``. Only a
        request that asked reaches here, so other steps run no extra LM head rows; rows go
        through the LM head :data:`PROMPT_LOGITS_ROWS` at a time to bound the logits' size.
        Positions recorded before a preemption are not recorded again."""
        with torch.inference_mode():
            req = s.request
            recorded = req.prompt_logprobs
            if not recorded:
                recorded.append(None)  # the first token has no context to be scored in
            start = max(s.num_computed_tokens, len(recorded) - 1)
            end = min(s.num_computed_tokens + s.num_scheduled_tokens, req.num_prompt_tokens - 1)
            if start >= end:
                return
            if start != len(recorded) - 1:  # a gap: positions computed elsewhere (cache hits)
                raise RuntimeError(f"prompt logprobs of {req.request_id}: position "
                                   f"{len(recorded) - 1} was not computed")
            k = req.sampling_params.prompt_logprobs or 0
            for a in range(start, end, PROMPT_LOGITS_ROWS):
                b = min(a + PROMPT_LOGITS_ROWS, end)
                r0 = first_row + a - s.num_computed_tokens
                logits = self.model.compute_logits(hidden[r0:r0 + b - a], prompt_rows=True)
                logp = logits.log_softmax(dim=-1)
                targets = torch.tensor(req.prompt_token_ids[a + 1:b + 1], device=logp.device)
                chosen = logp.gather(1, targets[:, None])
                ranks = (logp >= chosen).sum(dim=-1).tolist()  # vLLM's rank: ties count ahead
                top_vals, top_ids = logp.topk(k, dim=-1)  # k = 0: empty rows
                for t, lp, rank, tv, ti in zip(targets.tolist(), chosen[:, 0].tolist(), ranks,
                                               top_vals.tolist(), top_ids.tolist()):
                    entry = {t: (lp, rank)}
                    for j, (tid, val) in enumerate(zip(ti, tv)):
                        entry.setdefault(tid, (val, j + 1))
                    recorded.append(entry)

    def _prepare(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's flattened ``input_ids`` and ``positions`` (``[num_tokens]`` int64,
        decodes first) and its attention layout (slots, decode block tables, prefill chunks)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes + prefills:
            start = s.num_computed_tokens
            ids.extend(s.token_ids)
            table = s.block_table
            for p in range(start, start + s.num_scheduled_tokens):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        dev = self.device
        # A request verifying drafts is one decode row per token: row i attends to the
        # keys up to its own position, which the step writes before any row attends.
        seq_lens = [s.num_computed_tokens + i + 1
                    for s in decodes for i in range(s.num_scheduled_tokens)]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decodes=len(seq_lens))
        if decodes:
            width = max(len(s.block_table) for s in decodes)
            tables = [s.block_table + [0] * (width - len(s.block_table))
                      for s in decodes for _ in range(s.num_scheduled_tokens)]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=dev)
            meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.long, device=dev)
        row = len(seq_lens)
        for s in prefills:
            n = s.num_scheduled_tokens
            used = -(-(s.num_computed_tokens + n) // bs)
            meta.prefills.append(PrefillChunk(
                q_start=row, q_end=row + n, num_computed=s.num_computed_tokens,
                block_table=torch.tensor(s.block_table[:used], dtype=torch.long, device=dev)))
            row += n
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta)
