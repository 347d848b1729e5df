import pytest

from inflight.core.block_pool import BlockPool
from inflight.core.kv_cache import KVCacheManager
from inflight.request import Request
from inflight.sampling_params import SamplingParams


def _req(rid, n_prompt):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams())


def test_pool_hands_out_in_order_and_reuses_least_recently_freed():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.num_free_blocks == 3
    # 3 was never used, then 1 and 0 in the order they were freed.
    assert pool.allocate(3) == [3, 1, 0]
    assert pool.ref_counts == [1, 1, 1, 1]


def test_pool_rejects_double_free_and_overdraw():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free([0])


def test_kv_cache_block_counts_are_exact():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", 10)
    assert kv.allocate(a, 10)
    assert kv.get_block_table("a") == [0, 1, 2]  # ceil(10 / 4)
    a.num_computed_tokens = 10
    assert kv.allocate(a, 2)  # 12 tokens still fit in 3 blocks
    assert kv.get_block_table("a") == [0, 1, 2]
    a.num_computed_tokens = 12
    assert kv.allocate(a, 1)  # the 13th token opens block 3
    assert kv.get_block_table("a") == [0, 1, 2, 3]
    b = _req("b", 20)
    assert not kv.allocate(b, 20)  # needs 5, only 4 free: nothing changes
    assert kv.num_free_blocks == 4 and kv.get_block_table("b") == []
    assert kv.allocate(b, 16)
    assert kv.get_block_table("b") == [4, 5, 6, 7]
    kv.check_integrity()
    kv.free(a)
    assert kv.num_free_blocks == 4
    kv.check_integrity()
    kv.free(a)  # freeing twice is a no-op for the manager
    kv.check_integrity()
