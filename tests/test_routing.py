"""The prefix router's match threshold and what it learns from finished requests."""

from __future__ import annotations

from inflight.routing import PrefixAffinityRouter, ReplicaLoad

IDLE = [ReplicaLoad(), ReplicaLoad()]
SYSTEM = list(range(1000, 1004))  # one 4-token block every prompt starts with


def test_a_shared_system_block_alone_does_not_pull_requests_to_one_replica():
    r = PrefixAffinityRouter(block_size=4, threshold=8)
    first = SYSTEM + list(range(12))  # 4 blocks
    assert r.route(first, IDLE) == 0
    # Another conversation: only the system block (1 of 4) is known, on replica 0, which is
    # busier by one: least load wins (before the threshold, 63 of 64 chats went to 0).
    other = SYSTEM + list(range(100, 112))
    assert r.route(other, [ReplicaLoad(1, 0), ReplicaLoad()]) == 1
    assert (r.hits, r.overrides) == (0, 0)
    # Half the blocks is not more than half: still load.
    half = SYSTEM + list(range(4)) + list(range(200, 208))
    assert r.route(half, [ReplicaLoad(1, 0), ReplicaLoad()]) == 1
    # Three of four blocks known on 0: affinity, though 0 carries more.
    most = SYSTEM + list(range(8)) + list(range(300, 304))
    assert r.route(most, [ReplicaLoad(2, 0), ReplicaLoad()]) == 0
    assert r.hits == 1


def test_observed_answers_keep_the_next_turn_on_its_replica():
    r = PrefixAffinityRouter(block_size=4, threshold=8)
    turn1 = SYSTEM + list(range(4))  # 2 blocks
    answer = list(range(500, 516))  # 4 blocks the engine cached while decoding
    turn2 = turn1 + answer + list(range(600, 604))  # 7 blocks
    busy0 = [ReplicaLoad(1, 0), ReplicaLoad()]
    assert r.route(turn1, IDLE) == 0
    # Without the answer the router knows 2 of 7 blocks: load sends turn 2 away.
    blind = PrefixAffinityRouter(block_size=4, threshold=8)
    assert blind.route(turn1, IDLE) == 0 and blind.route(turn2, busy0) == 1
    # Told what replica 0 generated, it knows 6 of 7: the conversation stays.
    r.observe(0, turn1 + answer)
    assert r.route(turn2, busy0) == 0 and r.hits == 1
    before = [dict(seen) for seen in r._seen]
    r.observe(5, turn2)  # a replica the router has not seen: ignored
    assert [dict(seen) for seen in r._seen] == before
