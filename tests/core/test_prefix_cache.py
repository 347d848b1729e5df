"""Prefix caching: exact block ids, reference counts, eviction order, sharing, reset."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from inflight.core.kv_cache import KVCacheManager, hash_block
from inflight.request import Request
from inflight.sampling_params import SamplingParams
from tests.conftest import FakeRunner
from tests.core.test_scheduler import make_engine, run_to_completion


def _admit(kv, rid, tokens):
    """What the scheduler does for a new request given all its tokens at once."""
    req = Request(rid, tokens, SamplingParams())
    hits = kv.get_computed_blocks(req)
    assert kv.allocate(req, len(tokens) - len(hits) * kv.block_size, hits)
    kv.record_lookup(req, hits)
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    return req, hits


def test_hits_share_blocks_by_reference_and_eviction_is_lru():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, hits = _admit(kv, "a", list(range(1, 11)))           # 2 full blocks + 2 tokens
    assert hits == [] and kv.get_block_table("a") == [0, 1, 2]
    assert kv.pool.block_hashes[0] == hash_block(b"", [1, 2, 3, 4])
    assert kv.pool.block_hashes[1] == hash_block(kv.pool.block_hashes[0], [5, 6, 7, 8])
    assert kv.pool.block_hashes[2] is None                  # partial blocks are never cached
    b, hits = _admit(kv, "b", list(range(1, 9)) + [50, 51, 52])
    assert hits == [0, 1] and kv.get_block_table("b") == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    kv.free(a)
    kv.free(b)
    assert kv.pool.ref_counts == [0] * 8
    # Never-used blocks first, then in the order freed; each table's tail first.
    assert kv.pool.free_queue_order() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.pool.num_cached_blocks == 2
    kv.check_integrity()
    c, _ = _admit(kv, "c", list(range(100, 120)))           # 5 blocks: 4, 5, 6, 7, 2
    assert kv.get_block_table("c") == [4, 5, 6, 7, 2] and kv.pool.num_cached_blocks == 2
    d, _ = _admit(kv, "d", list(range(200, 206)))           # takes 3, then 1: evicts 1's hash
    assert kv.get_block_table("d") == [3, 1]
    kv.free(c)
    e, hits = _admit(kv, "e", list(range(1, 9)) + [9])
    assert hits == [0]                                      # block 1 was evicted
    assert kv.get_block_table("e") == [0, 2, 7]             # c's tail blocks went first
    kv.check_integrity()


def test_at_least_one_token_is_computed_on_a_full_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, _ = _admit(kv, "a", list(range(1, 9)))
    kv.free(a)
    again = Request("a2", list(range(1, 9)), SamplingParams())
    assert kv.get_computed_blocks(again) == [0]             # not [0, 1]: 4 tokens remain


def test_reset_prefix_cache_drops_only_idle_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, _ = _admit(kv, "a", list(range(1, 9)))
    b, _ = _admit(kv, "b", list(range(11, 19)))
    kv.free(a)
    assert kv.reset_prefix_cache() == 2                      # a's two blocks; b's are held
    assert kv.get_computed_blocks(Request("x", list(range(1, 10)), SamplingParams())) == []
    assert kv.get_computed_blocks(Request("y", list(range(11, 20)), SamplingParams())) == [2, 3]
    kv.check_integrity()


def test_a_failed_step_uncaches_what_it_registered():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.begin_step()
    a, _ = _admit(kv, "a", list(range(1, 9)))
    kv.discard_step()
    kv.free(a)
    assert kv.get_computed_blocks(Request("x", list(range(1, 10)), SamplingParams())) == []


def test_n_completions_share_their_prompt_blocks():
    runner = FakeRunner()
    engine = make_engine(runner, num_blocks=16)
    engine.add_request("r", list(range(1, 10)), SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    engine.step()
    tables = [engine.kv_cache.get_block_table(f"{i}_r") for i in range(3)]
    assert tables == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert engine.kv_cache.pool.ref_counts[:2] == [3, 3]
    # Siblings compute only the token past the shared blocks.
    assert [s.num_scheduled_tokens for s in runner.steps[0].scheduled] == [9, 1, 1]
    run_to_completion(engine)
    assert engine.kv_cache.num_free_blocks == 16


def test_multi_turn_chat_reuses_the_first_turn():
    runner = FakeRunner()
    engine = make_engine(runner, num_blocks=32)
    turn1 = list(range(1, 15))
    engine.add_request("t1", turn1, SamplingParams(max_tokens=6, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    answer = outs["t1"].outputs[0].token_ids
    turn2 = turn1 + answer + [90, 91, 92]
    engine.add_request("t2", turn2, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    # Turn 1 computed 14 prompt + 5 fed-back output tokens = 19: four full blocks of 4.
    assert runner.steps[-1].scheduled[0].num_computed_tokens == 16
    assert outs["t1"].num_cached_tokens == 0


@settings(max_examples=50, deadline=None)
@given(
    prefixes=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    suffix_lens=st.lists(st.integers(0, 9), min_size=10, max_size=10),
    num_blocks=st.integers(10, 30),
    aborts=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9)), max_size=4),
)
def test_shared_prefix_workloads_keep_invariants(prefixes, suffix_lens, num_blocks, aborts):
    runner = FakeRunner()
    engine = make_engine(runner, num_blocks=num_blocks, max_num_batched_tokens=16, max_num_seqs=4)
    bases = [list(range(10 * k, 10 * k + 12)) for k in range(4)]
    ids = []
    for i, k in enumerate(prefixes):
        engine.add_request(str(i), bases[k] + [99] * suffix_lens[i],
                           SamplingParams(max_tokens=5, ignore_eos=True))
        ids.append(str(i))
    ended = set()
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        for at, which in aborts:
            if at == step:
                engine.abort_request(ids[which % len(ids)])
        for o in engine.step():
            ended.add(o.request_id)
        engine.kv_cache.check_integrity()
    assert ended == set(ids) and engine.kv_cache.num_free_blocks == num_blocks
