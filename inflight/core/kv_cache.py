"""Per-request block tables over the ``BlockPool``, with automatic prefix caching. Torch-free.

A request holding ``t`` tokens of KV needs ``ceil(t / block_size)`` blocks; its block table
lists them in token order, so token ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching (vLLM's automatic prefix caching): each *full* block of a sequence is keyed
by a chained hash ``H(parent hash, the block's token ids)``, so equal keys mean equal
prefixes, hence equal keys and values. A new request takes every leading block already
cached (sharing it by reference count) and computes only the rest, always at least its
last token, whose logits it needs. The hash is BLAKE2b: a collision would hand one
request another's KV, so an easily forged hash (Python's ``hash`` of ints) is not used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from array import array

from inflight.core.block_pool import BlockPool
from inflight.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chain_root(request: Request) -> bytes:
    """The first block's parent: b"" for the base model without a salt, else a digest of
    the salt and the LoRA adapter's id (an adapter changes every key and value), so no
    chain can pose as another's parent hash (that would need a BLAKE2b preimage)."""
    if not request.cache_salt and not request.lora_id:
        return b""
    salt = (request.cache_salt or "").encode()
    return hashlib.blake2b(b"inflight cache_salt\0" + salt + b"\0lora\0"
                           + str(request.lora_id).encode(), digest_size=16).digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained 128-bit hash of a full block (``parent`` is b"" for the first block)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class KVCacheManager:
    """Allocates and frees the KV blocks of requests.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests.

    Attributes:
        prefix_cache_queries: tokens looked up in the prefix cache at first admissions.
        prefix_cache_hits: of those, tokens found cached.
        preempted_prefix_cache_queries, preempted_prefix_cache_hits: the same for
            readmissions after preemption, kept apart (vLLM v1's ``PrefixCacheStats``
            ``preempted_queries``/``preempted_hits``): a preempted request finding its own
            blocks again is recovery from preemption, not prefix sharing, and counting it
            would make the hit rate rise with KV pressure.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self._registered_this_step: list[int] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free plus evictable cached)."""
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- prefix cache -------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        # A salt makes the first block's parent, so every block's hash, its own (vLLM's
        # cache_salt): requests with different salts never share a cached block.
        root = _chain_root(request)
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else root,
                                     request.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of a request not yet started.

        At most ``(num_tokens - 1) // block_size`` blocks: at least one token is left to
        compute, for the logits. Empty when caching is off, the request holds blocks, or
        it still needs prompt logprobs or mean pooling (vLLM skips reading the cache for
        those too).
        """
        if (not self.enable_prefix_caching or request.request_id in self.block_tables
                or request.needs_every_prompt_position):
            return []
        hits = []
        for h in self._block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens now fill, so later
        requests can share them. Called when its tokens are scheduled: the runner writes all
        of a step's K/V before any query attends, so even a request scheduled in the same
        step can read them."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.block_tables[rid]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if self.pool.cache(table[i], hashes[i]):
                self._registered_this_step.append(table[i])
        self._num_registered[rid] = num_full

    def record_lookup(self, request: Request, computed_blocks: list[int]) -> None:
        """Count an admitted request's prefix-cache lookup (tokens queried and hit); a
        readmission after preemption goes on the ``preempted_*`` counters instead."""
        if not self.enable_prefix_caching:
            return
        hits = len(computed_blocks) * self.block_size
        if request.num_preemptions > 0:
            self.preempted_prefix_cache_queries += request.num_tokens
            self.preempted_prefix_cache_hits += hits
        else:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hits

    def begin_step(self) -> None:
        """Start a new step's record of newly cached blocks (see ``discard_step``)."""
        self._registered_this_step.clear()

    def discard_step(self) -> None:
        """The step failed: its K/V were never written, so forget the hashes it registered."""
        for block in self._registered_this_step:
            self.pool.uncache(block)
        self._registered_this_step.clear()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (benchmarks start cold); returns count."""
        return self.pool.reset_prefix_cache()

    # --- allocation ---------------------------------------------------------------------
    def num_new_blocks_needed(self, request: Request, num_new_tokens: int,
                              computed_blocks: Sequence[int] = ()) -> int:
        """Pool blocks that admitting/growing ``request`` by ``num_new_tokens`` takes from
        the free queue, counting cached hits that are not held by anyone yet."""
        held = len(self.block_tables.get(request.request_id, ())) + len(computed_blocks)
        start = request.num_computed_tokens + len(computed_blocks) * self.block_size
        fresh = max(0, self.num_blocks_for(start + num_new_tokens) - held)
        return fresh + sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)

    def allocate(self, request: Request, num_new_tokens: int,
                 computed_blocks: Sequence[int] = ()) -> bool:
        """Reserve slots for ``num_new_tokens`` more tokens of ``request``, after taking
        ``computed_blocks`` (prefix-cache hits, only for a request that holds no blocks).

        Returns:
            False, changing nothing, when the pool has too few free blocks.
        """
        if self.num_new_blocks_needed(request, num_new_tokens, computed_blocks) > self.pool.num_free_blocks:
            return False
        rid = request.request_id
        if computed_blocks:
            self.pool.touch(computed_blocks)
            self.block_tables[rid] = list(computed_blocks)
            self._num_registered[rid] = len(computed_blocks)
        table = self.block_tables.setdefault(rid, [])
        start = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.num_blocks_for(start + num_new_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Release every block ``request`` holds (no-op if it holds none)."""
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        if table:
            # Tail first: a sequence's last blocks are the least likely to be shared, so
            # they should be the first evicted.
            self.pool.free(table[::-1])

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the blocks past the first ``cdiv(num_tokens, block_size)`` of
        ``request``'s table (lookahead slots of rejected draft tokens); returns how many.
        Those blocks hold no registered (full, known) tokens, so none is cached."""
        table = self.block_tables.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self.pool.free(tail[::-1])
        return len(tail)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def usage(self) -> float:
        """Fraction of KV blocks held by requests, 0.0 .. 1.0."""
        return self.pool.usage()

    def check_integrity(self) -> None:
        """Assert held + cached + free blocks = total, reference counts equal the number of
        block tables naming each block, and the cache index is consistent.

        Raises:
            AssertionError: the invariant is broken (a leak or a double allocation).
        """
        pool = self.pool
        counts: dict[int, int] = {}
        for table in self.block_tables.values():
            assert len(table) == len(set(table)), "a block appears twice in one table"
            for b in table:
                counts[b] = counts.get(b, 0) + 1
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == counts.get(b, 0), (
                f"block {b}: ref count {pool.ref_counts[b]}, held by {counts.get(b, 0)} tables")
        queued = set(pool.free_queue_order())
        assert len(queued) == pool.num_free_blocks
        assert queued.isdisjoint(counts), "a held block is in the free queue"
        assert len(counts) + len(queued) == pool.num_blocks, (
            f"held {len(counts)} + free/cached {len(queued)} != total {pool.num_blocks}")
        for h, b in pool.cached.items():
            assert pool.block_hashes[b] == h, f"cache index of block {b} is stale"
