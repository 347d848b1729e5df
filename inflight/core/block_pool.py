"""The pool of KV-cache blocks: ids, reference counts and a free list. Torch-free.

As vLLM's ``BlockPool`` (vllm/v1/core/block_pool.py): a block is free when its reference
count is 0; the free list hands out the least recently freed block first. Reference counts
let a block be shared later (prefix caching, ``n > 1``) without copying.
"""

from __future__ import annotations

from collections import deque


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
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (reference count 1 each).

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check first).
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block reaching 0 goes back on the free list.

        Raises:
            RuntimeError: a block that is already free (a double free is a bug upstream).
        """
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_blocks
