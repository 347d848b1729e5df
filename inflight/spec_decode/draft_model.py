"""Draft-model proposer: a smaller model with the target's vocabulary drafts greedily.

Speculative decoding with a draft model (Leviathan et al., ICML 2023; Chen et al., 2023;
vLLM's ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``): after
each step the draft model runs the tokens of each decoding request it has not seen, then
``k - 1`` greedy decode steps, and the ``k`` argmax ids become the request's drafts. Greedy
drafts are a one-hot ``q``, which the rejection sampler (``inflight.rejection_sampler``)
handles for every temperature.

The draft keeps its own paged KV cache (``ModelRunner``'s layout, PagedAttention, Kwon et
al., SOSP 2023) and block table per request. What it wrote is remembered as the token ids
it fed at each position: after verification the target keeps a prefix of the drafts, so
the draft's KV stays valid up to the first position where the request's tokens differ
from what was fed, and only the rest is computed again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inflight.config import EngineConfig
from inflight.core.block_pool import BlockPool
from inflight.core.spec_config import SpeculativeConfig
from inflight.model.attention import AttentionMetadata, PrefillChunk
from inflight.model.gguf_file import read_gguf_metadata
from inflight.model.hparams import ModelConfig
from inflight.model.llama import LlamaForCausalLM
from inflight.model.loader import load_model, read_gguf_blocks, read_gguf_config
from inflight.model.placement import (resolve_device, resolve_dtype, resolve_kv_cache_dtype,
                                      resolve_model_path, resolve_quantization)
from inflight.model.quant import QuantFormat
from inflight.request import Request
from inflight.runner import ModelRunner, kv_block_bytes
from inflight.sampler import Sampler

logger = logging.getLogger(__name__)

# Draft KV pool when the engine's pool is sized from free memory (no ``num_kv_blocks``
# nor ``kv_cache_memory_bytes``): the draft is small, and 256 MiB hold ~5.8k tokens of
# SmolLM2-135M in float32 (46 KiB a token). A request that finds no free block drafts
# nothing that step; it is never failed for it.
DEFAULT_DRAFT_KV_BYTES = 256 * 2**20


def read_model_header(path: Path) -> ModelConfig:
    """A model's ``ModelConfig`` without its weights: an HF directory's ``config.json`` or
    a GGUF's metadata (milliseconds). Tensor-derived fields (``tie_word_embeddings``,
    ``attention_bias`` of a GGUF) are not read: this is for shapes and the vocabulary.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory without ``config.json``.
        ValueError: an unsupported architecture, or not a GGUF file.
    """
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return ModelConfig.from_hf_config(json.loads(cfg_file.read_text()))
    return read_gguf_config(read_gguf_metadata(path), set())


def load_draft_model(path: Path, dtype: torch.dtype, device: torch.device,
                     quantization: str) -> LlamaForCausalLM:
    """The draft's weights as ``loading.load_model_and_tokenizer`` loads a target's, less
    the tokenizer: drafts are ids, and the target's tokenizer is the one that matters."""
    model_config, state = load_model(path)
    blocks = (read_gguf_blocks(path, model_config, {f.name for f in QuantFormat})
              if quantization == "gguf" else None)
    model = LlamaForCausalLM(model_config, dtype=dtype, device=device)
    model.load_weights(state, quantization, blocks)
    return model


@dataclass
class _DraftSeq:
    """One request's draft KV: its blocks, and the token id whose K/V each position holds."""

    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)


@dataclass
class _Group:
    """A request's tokens in one draft forward: ``tokens`` at positions ``start ..``, as
    decode rows (one per token, for a few generated tokens) or as one prefill chunk."""

    seq: _DraftSeq
    start: int
    tokens: list[int]
    decode: bool


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class DraftModelProposer:
    """Proposes ``k`` greedy drafts per request from a draft model (see the module).

    Args:
        config: ``method == "draft_model"``, ``model`` the draft's ``.gguf`` or HF directory.
        engine_config: the engine's settings: the draft takes its device, dtype, KV dtype,
            quantization and block size, and its KV pool size (``_pool_blocks``).
        target_kv_tokens: the target's KV pool in tokens, when the caller knows it: the
            draft's pool then holds as many (every request the target holds can draft).

    Raises:
        FileNotFoundError: no draft model at ``config.model``, named.
        ValueError: the draft's vocabulary size differs from the target's (both named).
    """

    def __init__(self, config: SpeculativeConfig, *, engine_config: EngineConfig,
                 target_kv_tokens: int | None = None) -> None:
        if config.model is None:
            raise ValueError("speculative_config.model: the draft model is required")
        path = Path(config.model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"speculative_config.model: no draft model at {path}")
        target_path = resolve_model_path(engine_config.model)
        draft_vocab = read_model_header(path).vocab_size
        target_vocab = read_model_header(target_path).vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"speculative_config.model: the draft model {path.name} has a "
                             f"vocabulary of {draft_vocab} tokens, the target "
                             f"{target_path.name} {target_vocab}; they must be the same")
        device = resolve_device(engine_config.device)
        dtype = resolve_dtype(engine_config.dtype, device)
        kv_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, dtype, device)
        quantization = resolve_quantization(engine_config.quantization, path, device)
        self.model = load_draft_model(path, dtype, device, quantization)
        self.block_size = engine_config.block_size
        self.max_chunk = engine_config.max_num_batched_tokens
        num_blocks = self._pool_blocks(engine_config, kv_dtype, target_kv_tokens)
        # ModelRunner's allocation (zeroed, lazily mapped on CPU); its sampler is unused.
        runner = ModelRunner(self.model, num_blocks, self.block_size, kv_dtype,
                             Sampler(0, device))
        self.kv_caches = runner.kv_caches
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[str, _DraftSeq] = {}
        logger.info("draft model %s (%s, quantization %s): KV pool %d blocks x %d tokens",
                    path.name, str(dtype).removeprefix("torch."), quantization, num_blocks,
                    self.block_size)

    def _pool_blocks(self, engine_config: EngineConfig, kv_dtype: torch.dtype,
                     target_kv_tokens: int | None) -> int:
        """The draft's KV pool in blocks: as many tokens as the target's pool when known
        (``target_kv_tokens`` or ``num_kv_blocks``), else the target's byte budget
        ``kv_cache_memory_bytes`` (a smaller draft then holds more tokens), else
        ``DEFAULT_DRAFT_KV_BYTES``."""
        bs = self.block_size
        if target_kv_tokens is not None:
            return max(1, -(-target_kv_tokens // bs))
        if engine_config.num_kv_blocks is not None:
            return engine_config.num_kv_blocks
        budget = engine_config.kv_cache_memory_bytes or DEFAULT_DRAFT_KV_BYTES
        return max(1, budget // kv_block_bytes(self.model.config, bs, kv_dtype))

    def release(self, request_id: str) -> None:
        """Free a finished or aborted request's draft KV blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(seq.blocks)

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        """Set ``spec_token_ids`` of each ``(request, k)`` to ``k`` greedy drafts (none for
        a request whose draft KV does not fit the pool)."""
        live: list[tuple[Request, _DraftSeq, int]] = []
        groups: list[_Group] = []
        for req, k in requests:
            req.spec_token_ids = []
            group = self._catch_up(req, k)
            if group is not None:
                live.append((req, group.seq, k))
                groups.append(group)
        if not groups:
            return
        for (req, _, _), token in zip(live, self._forward(groups)):
            req.spec_token_ids.append(token)
        for j in range(1, max(k for _, _, k in live)):
            live = [(req, seq, k) for req, seq, k in live if k > j]
            groups = []
            for req, seq, _ in live:
                groups.append(_Group(seq, len(seq.fed), [req.spec_token_ids[-1]], True))
                seq.fed.append(req.spec_token_ids[-1])
            for (req, _, _), token in zip(live, self._forward(groups)):
                req.spec_token_ids.append(token)

    def _catch_up(self, req: Request, k: int) -> _Group | None:
        """Reserve ``req``'s blocks for its tokens and ``k - 1`` drafts, run the leading
        chunks of a long unseen span, and return the group whose last row gives draft 1;
        None when the pool has too few free blocks."""
        seq = self._seqs.get(req.request_id) or _DraftSeq()
        need = -(-(req.num_tokens + k - 1) // self.block_size) - len(seq.blocks)
        if need > 0:
            if need > self.pool.num_free_blocks:
                return None
            seq.blocks.extend(self.pool.allocate(need))
        self._seqs[req.request_id] = seq
        tokens = req.prompt_token_ids + req.output_token_ids
        # At least the last token runs again: its row's logits give the first draft.
        start = min(_common_prefix(seq.fed, tokens), len(tokens) - 1)
        del seq.fed[start:]
        while len(tokens) - start > self.max_chunk:  # a prompt: in step-budget chunks
            self._forward([_Group(seq, start, tokens[start:start + self.max_chunk], False)])
            seq.fed.extend(tokens[start:start + self.max_chunk])
            start += self.max_chunk
        new = tokens[start:]
        seq.fed.extend(new)
        # A few generated tokens (the usual case after verification) as decode rows, which
        # take the batched decode path; a prompt span as a prefill chunk.
        decode = start >= req.num_prompt_tokens and len(new) <= k + 1
        return _Group(seq, start, new, decode)

    def _forward(self, groups: list[_Group]) -> list[int]:
        """Run the draft model over ``groups`` (their K/V written to the draft cache) and
        return each group's greedy next token (argmax of its last row), in order."""
        bs, dev = self.block_size, self.model.device
        order = sorted(range(len(groups)), key=lambda i: not groups[i].decode)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}
        for i in order:
            g = groups[i]
            ids.extend(g.tokens)
            for p in range(g.start, g.start + len(g.tokens)):
                pos.append(p)
                slots.append(g.seq.blocks[p // bs] * bs + p % bs)
            last_row[i] = len(ids) - 1
        meta = self._metadata(groups, order, slots)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev),
                            self.kv_caches, meta)
        index = torch.tensor([last_row[i] for i in range(len(groups))], device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _metadata(self, groups: list[_Group], order: list[int],
                  slots: list[int]) -> AttentionMetadata:
        """The attention layout of ``groups`` in row ``order`` (decode groups first), as
        ``ModelRunner._prepare`` builds it: a decode group is one row per token, row ``i``
        seeing the keys up to its own position (the step writes all before any attends)."""
        bs, dev = self.block_size, self.model.device
        decodes = [groups[i] for i in order if groups[i].decode]
        seq_lens = [g.start + i + 1 for g in decodes for i in range(len(g.tokens))]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decodes=len(seq_lens), num_generated=len(seq_lens))
        if decodes:
            width = max(len(g.seq.blocks) for g in decodes)
            tables = [g.seq.blocks + [0] * (width - len(g.seq.blocks))
                      for g in decodes for _ in g.tokens]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=dev)
            meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.long, device=dev)
        row = len(seq_lens)
        for i in order:
            g = groups[i]
            if g.decode:
                continue
            n = len(g.tokens)
            used = -(-(g.start + n) // bs)
            meta.prefills.append(PrefillChunk(
                q_start=row, q_end=row + n, num_computed=g.start,
                block_table=torch.tensor(g.seq.blocks[:used], dtype=torch.long, device=dev)))
            row += n
        return meta

