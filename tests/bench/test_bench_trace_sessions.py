"""A trace's conversations as users replay them (issue 54): Mooncake's rows chained into
conversations by their prefix blocks, the mix in conversation order, and users sending
each turn's prompt as the trace recorded it, history included."""

from __future__ import annotations

import asyncio

import pytest
from bench_fake_openai import Plan, ServerState

from inflight.bench.client import make_client
from inflight.bench.datasets import DatasetConfig, build_dataset
from inflight.bench.http_target import open_session
from inflight.bench.prompts import WordCounter
from inflight.bench.session import ArrivalConfig, LoadConfig, run_point
from inflight.bench.trace_files import BLOCK_TOKENS, TraceRow, load_trace, trace_sessions
from inflight.bench.users import ConversationSupply

MOONCAKE = "mooncake_conversation_0-30min.jsonl"


def _row(t: float, n: int, ids: list[int] | None) -> TraceRow:
    return TraceRow(t, n, 1, ids)


def test_a_turn_continues_the_deepest_open_row_whose_complete_blocks_it_starts_with():
    rows = [
        _row(0, 10, [0, 1, 2]),  # complete blocks (4 tokens each): [0, 1]
        _row(1, 12, [0, 5, 6]),
        _row(2, 14, [0, 1, 7, 8]),  # starts with row 0's complete blocks: its next turn
        _row(3, 9, [0, 1, 9]),  # row 0 was continued already: a fork starts its own
        _row(4, 5, [0, 9]),  # shares only block 0, which every row starts with
        _row(5, 20, [0, 1, 7, 8, 3]),  # row 3 ends at [0, 1], row 2 deeper at [0, 1, 7]: row 2's
        _row(6, 3, None),  # no blocks: a conversation of one
        _row(7, 8, [0, 5, 4]),  # row 1's complete blocks are [0, 5, 6]: no continuation
    ]
    assert trace_sessions(rows, block_tokens=4) == [[0, 2, 5], [1], [3], [4], [6], [7]]


def test_the_mooncake_trace_chains_into_conversations(data_dir):
    rows = load_trace(data_dir / MOONCAKE)
    sessions = trace_sessions(rows)
    assert sorted(i for s in sessions for i in s) == list(range(len(rows)))
    assert [s[0] for s in sessions] == sorted(s[0] for s in sessions)
    multi = [s for s in sessions if len(s) > 1]
    assert len(multi) > len(sessions) // 10  # a conversation trace: many sessions have follow-ups
    for s in multi:
        assert s == sorted(s)
        for a, b in zip(s, s[1:]):
            done = rows[a].input_len // BLOCK_TOKENS
            assert done > 1 and rows[b].hash_ids[:done] == rows[a].hash_ids[:done]
            assert rows[b].time >= rows[a].time


def _sessions_mix(data_dir, n: int, shuffle: bool = True):
    c = DatasetConfig(name="trace", data_dir=str(data_dir), trace_file=MOONCAKE, num_prompts=n, length_scale=1 / 64,
                      sessions=True, shuffle=shuffle)
    return c, asyncio.run(build_dataset(c, WordCounter()))


def test_the_mix_holds_whole_conversations_whose_prompts_grow_by_prefix(data_dir):
    rows = load_trace(data_dir / MOONCAKE)
    by_first = {s[0]: s for s in trace_sessions(rows)}
    _, specs = _sessions_mix(data_dir, 60)
    _, unshuffled = _sessions_mix(data_dir, 60, shuffle=False)
    assert [s.meta["trace_row"] for s in specs] != [s.meta.get("trace_row") for s in unshuffled]
    follow_ups = 0
    i = 0
    while i < len(specs) and i + specs[i].meta["trace_turns"] <= len(specs):
        run = specs[i: i + specs[i].meta["trace_turns"]]
        assert [s.meta["trace_turn"] for s in run] == list(range(len(run)))
        assert len({s.meta["trace_session"] for s in run}) == 1
        assert [s.meta["trace_row"] for s in run] == by_first[run[0].meta["trace_row"]]
        for prev, nxt in zip(run, run[1:]):
            blocks = prev.prompt.split("\n")[:-1]  # its complete blocks, one a line; the tail after
            assert blocks and nxt.prompt.split("\n")[:len(blocks)] == blocks
            follow_ups += 1
        i += len(run)
    assert follow_ups > 0


def test_users_take_a_trace_conversation_once_the_mix_holds_all_its_turns(data_dir):
    c, specs = _sessions_mix(data_dir, 60)

    class _Session:
        dataset = c

        def __init__(self) -> None:
            self.specs = list(specs)

    session = _Session()
    cut = next(i for i, s in enumerate(specs) if s.meta["trace_turn"] == 1)  # inside a conversation
    session.specs = specs[:cut]
    supply = ConversationSupply(session)  # type: ignore[arg-type]
    whole = supply.complete()
    assert sum(len(x.turns) for x in whole) == cut - 1 and all(x.history_in_prompt for x in whole)
    session.specs = specs
    convs = supply.complete()
    assert [t for x in convs for t in x.turns] == specs[: sum(len(x.turns) for x in convs)]
    assert len(convs[len(whole)].turns) > 1 and len({x.key for x in convs}) == len(convs)


def test_users_send_a_trace_turn_as_the_trace_recorded_it(fake_server, data_dir):
    """Trace conversations against the fake server: each prompt is sent as built (its
    history already in it, no messages added), the turns of a conversation in order, each
    the think time after the previous answer ended."""
    async def plan(body: dict, index: int) -> Plan:
        return Plan(ttft=0.05, gaps=[0.0])

    srv = fake_server(ServerState(plan=plan))
    ds = DatasetConfig(name="trace", data_dir=str(data_dir), trace_file=MOONCAKE, num_prompts=40,
                       length_scale=1 / 64, output_len=2, sessions=True, shuffle=True, max_output_len=2)
    arrival = ArrivalConfig(users=3, think_time=0.2, duration=1.5, warmup_duration=0.3, ramp_duration=0.2,
                            drain_timeout=1.0, min_requests=4)

    async def run():
        async with make_client() as client:
            session = await open_session(LoadConfig(base_url=srv.base_url, progress=False), ds, client)
            return await run_point(session, arrival), session.specs

    point, mix = asyncio.run(run())
    prompts = {s.prompt for s in mix}
    assert all("messages" not in b and b["prompt"] in prompts for b in srv.state.bodies)
    recs = sorted((r for r in point.records if not r.cancelled), key=lambda r: r.send_time)
    assert any(r.turn > 0 for r in recs)
    for user in {r.user for r in recs}:
        mine = [r for r in recs if r.user == user]
        for prev, nxt in zip(mine, mine[1:]):
            assert nxt.send_time - prev.end_time == pytest.approx(0.2, abs=0.05)
            if nxt.turn > 0:
                assert (nxt.conversation, nxt.turn) == (prev.conversation, prev.turn + 1)
