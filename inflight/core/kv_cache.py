"""Per-request block tables over the ``BlockPool``. Torch-free.

A request holding ``t`` tokens of KV needs ``ceil(t / block_size)`` blocks; its block table
lists them in token order, so token ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from inflight.core.block_pool import BlockPool
from inflight.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees the KV blocks of requests.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``request`` lacks to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        held = len(self.block_tables.get(request.request_id, ()))
        return max(0, self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - held)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Reserve slots for ``num_new_tokens`` more tokens of ``request``.

        Returns:
            False, changing nothing, when the pool has too few free blocks.
        """
        need = self.num_new_blocks_needed(request, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request.request_id, [])
        table.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Release every block ``request`` holds (no-op if it holds none)."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # Tail first: the last blocks of a sequence are the least likely to be reused.
            self.pool.free(table[::-1])

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def usage(self) -> float:
        """Fraction of KV blocks in use, 0.0 .. 1.0."""
        return self.pool.usage()

    def check_integrity(self) -> None:
        """Assert free + held blocks = total and no block is held twice.

        Raises:
            AssertionError: the invariant is broken (a leak or a double allocation).
        """
        held = [b for t in self.block_tables.values() for b in t]
        assert len(held) == len(set(held)), "a block is held by two requests"
        assert len(held) + self.pool.num_free_blocks == self.pool.num_blocks, (
            f"held {len(held)} + free {self.pool.num_free_blocks} != total {self.pool.num_blocks}")
        for b in held:
            assert self.pool.ref_counts[b] == 1, f"block {b} ref count {self.pool.ref_counts[b]}"
