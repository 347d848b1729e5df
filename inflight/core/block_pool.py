"""The pool of KV-cache blocks: ids, reference counts, an LRU free queue and the prefix
cache. Torch-free.

As vLLM v1's ``BlockPool`` (vllm/v1/core/block_pool.py): a block is in use while its
reference count is above 0. A block whose count drops to 0 goes to the tail of the free
queue; if it holds a full block of tokens with a known hash it stays *cached* there, so a
later request with the same prefix can take it back (a hit removes it from the queue). New
blocks come from the head of the queue, least recently freed first; taking a cached block
evicts its hash. So every block is exactly one of::

    held    ref_count > 0                     (in some request's block table)
    cached  ref_count == 0, hash known        (in the free queue, reusable by hash)
    free    ref_count == 0, no hash           (in the free queue)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """``num_blocks`` blocks with ids ``0 .. num_blocks - 1``.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        # Insertion-ordered set: O(1) append, pop from the head, and removal on a cache hit.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-and-evictable)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable cached blocks (reference count 0, hash known)."""
        return sum(1 for b in self.cached.values() if self.ref_counts[b] == 0)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free queue (reference count 1 each),
        evicting the cached hash of any that had one.

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check first).
        """
        if count > len(self._free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free_queue)} free")
        blocks = []
        for _ in range(count):
            b, _ = self._free_queue.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each (cached or held) block: a prefix-cache hit."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free_queue[b]
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block, in order; a block reaching 0 goes to the tail
        of the free queue (keeping its hash, if any, as a cached block).

        Raises:
            RuntimeError: a block that is already free (a double free is a bug upstream).
        """
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free_queue[b] = None

    def get_cached(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Record that held ``block`` holds the full token block ``block_hash``.

        Returns:
            False when another block already caches that hash (this one stays uncached).
        """
        if block_hash in self.cached or self.block_hashes[block] is not None:
            return False
        self.cached[block_hash] = block
        self.block_hashes[block] = block_hash
        return True

    def uncache(self, block: int) -> None:
        """Forget ``block``'s hash (its contents can no longer be trusted or reused)."""
        self._evict(block)

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every cached block no request holds; returns how many."""
        idle = [b for b in self.cached.values() if self.ref_counts[b] == 0]
        for b in idle:
            self._evict(b)
        return len(idle)

    def _evict(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            self.block_hashes[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 .. 1.0 (cached blocks count as free)."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def free_queue_order(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and debugging."""
        return list(self._free_queue)
