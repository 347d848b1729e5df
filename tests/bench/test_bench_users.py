"""Users as a load (``bench --users``): the search on whole users, the conversations users
take, the tiers, and a closed-loop point against the fake server (issue 54)."""

from __future__ import annotations

import asyncio

import pytest
from bench_fake_openai import Plan, ServerState

from inflight.bench import capacity as cap
from inflight.bench.client import make_client
from inflight.bench.datasets import DatasetConfig
from inflight.bench.http_target import open_session
from inflight.bench.session import ArrivalConfig, LoadConfig, run_point
from inflight.bench.summary import SLO
from inflight.bench.tiers import parse_tiers
from inflight.bench.users import ConversationSupply, first_look_end, resolved_looks, start_offset, think_seconds
from inflight.bench.sustain import Window
from inflight.cli import main


def _limit_at(n: float):
    async def measure(load: float) -> cap.PointOutcome:
        assert load == int(load), f"{load} is not a whole number of users"
        return cap.PointOutcome(load, load <= n)
    return measure


@pytest.mark.parametrize("limit, start, points, found, failed", [
    (7, 4, [4, 8, 6, 7], 7, 8),  # double, then bisect on whole users until the bracket is one apart
    (1, 1, [1, 2], 1, 2),  # a limit of one user: one step up, the bracket closed
    (3, 4, [4, 2, 3], 3, 4),  # down from a failure by halving
    (40, 32, [32, 64, 45, 38, 41], 38, 41),  # past 10 users the tolerance (0.1) ends it: 41 / 38 < 1.1
])
def test_the_user_search_steps_by_whole_users(limit, start, points, found, failed):
    res = asyncio.run(cap.search(_limit_at(limit), start, 1, 4096, tolerance=0.1, grid=1.0))
    assert [p.load for p in res.points] == points
    assert res.limit == found and res.failed_above == failed


def test_a_failed_hold_steps_down_at_least_one_user():
    searched = cap.SearchResult(3, True, [])
    held = asyncio.run(cap.hold(searched, _limit_at(1), 0.1, 1, max_holds=3, grid=1.0))
    assert [p.load for p in held.holds] == [3, 2, 1] and held.limit == 1
    searched = cap.SearchResult(50, True, [])
    held = asyncio.run(cap.hold(searched, _limit_at(40), 0.1, 1, max_holds=4, grid=1.0))
    assert [p.load for p in held.holds] == [50, 45, 41, 37] and held.limit == 37


def test_tiers_are_a_speed_floor_and_a_ttft_ceiling_at_p95():
    slow, fast = parse_tiers("10:2s, 30:500ms")
    base = SLO({"e2e": 30.0}, {("ttft", "p95"): 9.0, ("e2e", "p99"): 20.0})
    assert slow.slo(base).aggregate == {("e2e", "p99"): 20.0, ("tpot", "p95"): 0.1, ("ttft", "p95"): 2.0}
    assert fast.slo(base).aggregate[("ttft", "p95")] == 0.5 and fast.slo(base).per_request == {"e2e": 30.0}
    for bad in ("10", "0:1", "10:-1", "a:1", "", "inf:2s", "nan:1", "10:inf", "10:2s,10:2000ms", "10:2s,,30:1s"):
        with pytest.raises(ValueError):
            parse_tiers(bad)


def test_think_times_and_the_ramp():
    fixed = ArrivalConfig(users=4, think_time=1.5, duration=60)
    assert [think_seconds(fixed, u, k) for u, k in ((0, 0), (3, 7))] == [1.5, 1.5]
    assert [start_offset(fixed, u) for u in range(4)] == [0.0, 1.25, 2.5, 3.75]  # over half the 10 s warm-up
    drawn = ArrivalConfig(users=4, think_time=2.0, think_distribution="exponential", seed=3)
    draws = [think_seconds(drawn, u, k) for u in range(50) for k in range(20)]
    assert draws == [think_seconds(drawn, u, k) for u in range(50) for k in range(20)]  # seeded
    assert 1.8 < sum(draws) / len(draws) < 2.2 and min(draws) < 0.1 and max(draws) > 8
    assert ArrivalConfig(users=2, duration=60, ramp_duration=30).phases() == (35.0, 30.0)


def test_the_first_look_waits_for_its_sample():
    w = Window(10.0, 70.0, 100.0)
    assert first_look_end(w, 3, [12.0, 13.0]) is None
    assert first_look_end(w, 3, [12.0, 13.0, 20.0]) == 70.0
    assert first_look_end(w, 3, [30.0, 60.0, 95.0]) == pytest.approx(95.0)
    looks = resolved_looks(w, 95.0, 3)
    assert [(x.end, x.deadline) for x in looks] == [(95.0, 125.0), (180.0, 210.0), (265.0, 295.0)]


def test_users_take_whole_conversations_in_order(data_dir):
    class _Session:  # what a supply reads: the dataset and a mix that grows
        def __init__(self, ds: DatasetConfig) -> None:
            self.dataset, self.specs = ds, []

        async def ensure_specs(self, n: int) -> int:
            from inflight.bench.datasets import build_dataset
            from inflight.bench.prompts import WordCounter
            if n > len(self.specs):
                self.specs += await build_dataset(self.dataset, WordCounter(), n - len(self.specs),
                                                  start=len(self.specs))
            return len(self.specs)

    ds = DatasetConfig(name="chat", data_dir=str(data_dir), num_prompts=5, output_len=4, conversation_turns=2,
                       active_conversations=3)
    session = _Session(ds)
    asyncio.run(session.ensure_specs(5))  # 5 of a group of 6: no conversation is whole yet
    supply = ConversationSupply(session)  # type: ignore[arg-type]
    assert supply.complete() == []
    taken = [asyncio.run(supply.take()) for _ in range(4)]
    assert [c.key for c in taken] == [0, 1, 2, 3]
    for c in taken:
        assert [s.meta["turn"] for s in c.turns] == [0, 1]
        assert {s.meta["conversation"] for s in c.turns} == {c.key}
    assert len(session.specs) == 12  # grown by whole groups


def test_users_send_each_turn_with_its_history_after_the_answer(fake_server, data_dir):
    """Two users, a 0.3 s think time, 2-turn chats against the fake server: every turn
    after the first carries the earlier turn and its streamed answer, and is sent the
    think time after that answer ended; the second user starts half the ramp later."""
    async def plan(body: dict, index: int) -> Plan:
        return Plan(ttft=0.1, gaps=[0.0, 0.0])  # 3 chunks of "tok"

    srv = fake_server(ServerState(plan=plan))
    ds = DatasetConfig(name="chat", num_prompts=4, output_len=3, data_dir=str(data_dir), conversation_turns=2,
                       active_conversations=2)
    arrival = ArrivalConfig(users=2, think_time=0.3, duration=1.5, warmup_duration=0.5, ramp_duration=0.4,
                            drain_timeout=1.0, min_requests=4)

    async def run():
        async with make_client() as client:
            session = await open_session(LoadConfig(base_url=srv.base_url, progress=False), ds, client)
            return await run_point(session, arrival)

    point = asyncio.run(run())
    recs = sorted(point.records, key=lambda r: r.send_time)
    assert {r.user for r in recs} == {0, 1}
    assert min(r.send_time for r in recs if r.user == 1) == pytest.approx(0.2, abs=0.05)
    for user in (0, 1):
        mine = [r for r in recs if r.user == user and not r.cancelled]
        for prev, nxt in zip(mine, mine[1:]):
            assert nxt.send_time - prev.end_time == pytest.approx(0.3, abs=0.05)
            assert (nxt.conversation, nxt.turn) == ((prev.conversation, 1) if prev.turn == 0 else
                                                    (nxt.conversation, 0))
            assert nxt.turn == 1 or nxt.conversation > prev.conversation
    # A second turn's body: the first turn as it was sent alone, its answer, its own message.
    bodies = srv.state.bodies
    follow_ups = [b for b in bodies if len(b["messages"]) == 3]
    assert len(follow_ups) == sum(1 for r in recs if r.turn == 1) > 0
    for k, b in enumerate(bodies):
        if len(b["messages"]) == 3:
            assert b["messages"][1] == {"role": "assistant", "content": "tok" * 3}
            assert any(e["messages"] == b["messages"][:1] for e in bodies[:k])
    assert point.summary["users"]["users"] == 2
    assert point.summary["users"]["output_speed_per_user"]["n"] > 0


def test_a_user_that_fails_ends_the_point_with_its_error(fake_server, data_dir, monkeypatch):
    """A user stops only by an error (here its second conversation cannot be taken): the
    point raises that error at once, instead of waiting for sends that never come."""
    async def plan(body: dict, index: int) -> Plan:
        return Plan(ttft=0.02, gaps=[0.0])

    srv = fake_server(ServerState(plan=plan))
    taken = []
    real = ConversationSupply.take

    async def take(self):
        if taken:
            raise RuntimeError("no conversation left")
        taken.append(1)
        return await real(self)
    monkeypatch.setattr(ConversationSupply, "take", take)
    ds = DatasetConfig(name="chat", num_prompts=4, output_len=2, data_dir=str(data_dir))
    arrival = ArrivalConfig(users=2, duration=30.0, warmup_duration=0.2, drain_timeout=5.0, min_requests=50)

    async def run():
        async with make_client() as client:
            session = await open_session(LoadConfig(base_url=srv.base_url, progress=False), ds, client)
            return await asyncio.wait_for(run_point(session, arrival), 10)

    with pytest.raises(RuntimeError, match="no conversation left"):
        asyncio.run(run())


@pytest.mark.parametrize("flags, message", [
    (["serve", "--users", "4"], "give --duration"),
    (["serve", "--think-time", "2"], "need --users N"),
    (["serve", "--users", "4", "--duration", "30", "--max-concurrency", "2"], "closed loop"),
    (["sweep", "--users", "4", "--duration", "30", "--request-rates", "1,2"], "bench sweep varies"),
    (["capacity", "--slo-tiers", "10:2s"], "needs bench capacity --users"),
    (["capacity", "--users", "2", "--slo-tiers", "10"], "TOK_PER_S:TTFT"),
    (["serve", "--users", "2", "--duration", "5", "--request-rate", "3"], "--request-rate set or search a request"),
    (["serve", "--users", "2", "--duration", "5", "--arrival", "gamma", "--burstiness", "0.5"],
     "--arrival, --burstiness set or search"),
    (["capacity", "--users", "2", "--rate-start", "3", "--slo-tiers", "10:2s"], "--rate-start set or search"),
    (["serve", "--think-time-distribution", "exponential"], "--think-time-distribution shape closed-loop users"),
    (["capacity", "--users-max", "10", "--slo", "ttft_p95=1"], "--users-max shape closed-loop users"),
    (["capacity", "--users", "100", "--users-max", "10", "--slo-tiers", "10:2s"], "must lie within"),
    (["capacity", "--users", "8", "--users-min", "10", "--users-max", "4", "--slo-tiers", "10:2s"], "must lie within"),
    (["serve", "--users", "2.5"], "'2.5' is not a whole number"),
])
def test_user_flags_are_refused_where_they_mean_nothing(flags, message, capsys):
    from inflight.bench.__main__ import main as bench_main
    try:
        rc = bench_main([*flags, "--base-url", "http://127.0.0.1:9", "--disable-tqdm"])
    except SystemExit as e:  # argparse's own refusal of a flag's value
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_what_the_users_saw_is_summed_up_per_turn_and_per_conversation():
    from inflight.bench.client import RequestRecord
    from inflight.bench.user_figures import session_figures

    def rec(i, user, conv, turn, send, first, last, n=5, phase="sample", success=True):
        r = RequestRecord(i, send, send_time=send, chunk_times=[first] + [first + (last - first) * k / (n - 1)
                                                                          for k in range(1, n)],
                          end_time=last, success=success, output_tokens=n, phase=phase, user=user,
                          conversation=conv, turn=turn, turns=2)
        return r
    records = [rec(0, 0, 0, 0, 0.0, 0.5, 1.3),  # TPOT 0.2 s: 5 tok/s
               rec(1, 0, 0, 1, 2.0, 3.0, 3.4),  # TPOT 0.1 s: 10 tok/s; conversation 0 took 3.4 s
               rec(2, 1, 1, 0, 0.5, 0.7, 1.5, phase="warmup"),  # its conversation began in the warm-up
               rec(3, 1, 1, 1, 2.0, 2.2, 2.6),
               rec(4, 1, 2, 0, 3.0, 3.1, 3.5),  # conversation 2's second turn never ran: not whole
               rec(5, 0, 3, 0, 4.0, 4.2, 4.6, success=False), rec(6, 0, 3, 1, 5.0, 5.2, 5.6)]
    got = session_figures(records, {"vllm:prefix_cache_hits_total": 30.0, "vllm:prefix_cache_queries_total": 120.0})
    assert got["users"] == 2
    assert got["ttft_by_turn"]["0"] == {"p50": pytest.approx(0.3), "p95": pytest.approx(0.48), "n": 2}
    assert got["ttft_by_turn"]["1"]["n"] == 3 and got["ttft_by_turn"]["1"]["p50"] == pytest.approx(0.2)
    assert got["session_seconds"] == {"p50": pytest.approx(3.4), "p95": pytest.approx(3.4), "n": 1}
    assert got["output_speed_per_user"]["n"] == 5 and got["output_speed_per_user"]["p50"] == pytest.approx(10.0)
    assert got["prefix_cache_hit_rate"] == 0.25
