"""Multi-turn chat replay: the mix's layout, the history each follow-up carries, and that a
follow-up is sent only after its previous answer ended (against the fake server)."""

from __future__ import annotations

import asyncio
import json

from bench_fake_openai import Plan, ServerState

from inflight.bench.client import make_client
from inflight.bench.conversations import with_stand_in_answers
from inflight.bench.datasets import DatasetConfig, build_dataset, conversation_slot
from inflight.bench.prompts import WordCounter
from inflight.bench.metrics_scrape import prefix_hit_rate
from inflight.bench.report import format_summary
from inflight.bench.http_target import open_session
from inflight.bench.session import ArrivalConfig, LoadConfig, run_point
from inflight.bench.vllm_result import vllm_result


def test_conversation_slots_come_in_waves_of_active_conversations():
    # 3 turns, 4 active: waves of 4 first turns, 4 second, 4 third (each in its own
    # order), then the next group's.
    got = [conversation_slot(i, 3, 4, seed=1) for i in range(16)]
    for wave in range(3):
        assert sorted(got[4 * wave: 4 * wave + 4]) == [(c, wave) for c in range(4)]
    assert sorted(got[12:16]) == [(c, 0) for c in range(4, 8)]
    assert len({tuple(got[4 * w: 4 * w + 4]) for w in range(3)}) > 1  # not one fixed order
    assert [conversation_slot(i, 1, 1) for i in range(3)] == [(0, 0), (1, 0), (2, 0)]


def test_multi_turn_chat_mix_uses_the_questions_turns_then_other_questions(data_dir):
    questions = [json.loads(ln) for ln in (data_dir / "mt_bench_questions.jsonl").read_text().splitlines() if ln]
    firsts = {q["turns"][0] for q in questions}
    c = DatasetConfig(name="chat", data_dir=str(data_dir), num_prompts=12, output_len=8,
                      conversation_turns=3, active_conversations=2)
    specs = asyncio.run(build_dataset(c, WordCounter()))
    by_conv: dict[int, list] = {}
    for s in specs:
        by_conv.setdefault(s.meta["conversation"], []).append(s)
    assert sorted(by_conv) == [0, 1, 2, 3]
    for conv, turns in by_conv.items():
        assert [t.meta["turn"] for t in turns] == [0, 1, 2]
        q = next(q for q in questions if q["question_id"] == turns[0].meta["question_id"])
        assert [t.messages for t in turns[:2]] == [[{"role": "user", "content": q["turns"][k]}] for k in (0, 1)]
        assert turns[2].messages[0]["content"] in firsts  # MT-Bench has 2 turns: the 3rd is another's
    # Extending the mix continues the same stream.
    more = asyncio.run(build_dataset(c, WordCounter(), 4, start=12))
    again = asyncio.run(build_dataset(c, WordCounter(), 16))
    assert [s.messages for s in more] == [s.messages for s in again[12:]]


def test_follow_ups_carry_the_history_and_wait_for_the_answer(fake_server, data_dir):
    answer_time = 0.25

    async def plan(body: dict, index: int) -> Plan:
        return Plan(ttft=answer_time, gaps=[0.0, 0.0])  # 3 chunks of "tok"

    srv = fake_server(ServerState(plan=plan))
    ds = DatasetConfig(name="chat", num_prompts=6, output_len=3, data_dir=str(data_dir),
                       conversation_turns=3, active_conversations=2)

    async def main():
        async with make_client() as client:
            session = await open_session(LoadConfig(base_url=srv.base_url, progress=False), ds, client)
            return session, await run_point(session, ArrivalConfig(rate=float("inf")))

    session, point = asyncio.run(main())
    assert point.summary["completed"] == 6
    bodies = srv.state.bodies
    assert len(bodies) == 6
    for spec in session.specs:
        conv, turn = spec.meta["conversation"], spec.meta["turn"]
        body = next(b for b in bodies if b["messages"][-1] == spec.messages[0]
                    and len(b["messages"]) == 2 * turn + 1)
        own = [s.messages[0] for s in session.specs if s.meta["conversation"] == conv]
        want = []
        for k in range(turn):
            want += [own[k], {"role": "assistant", "content": "tok" * 3}]
        assert body["messages"] == [*want, own[turn]]
    # The chat prompts were not counted by the client: the result reports the server's count.
    lens = vllm_result(point.records, point.summary)["input_lens"]
    assert lens == [r.prompt_tokens for r in point.records] and min(lens) > 0
    # The summary's hit rate is the server's counters' (none here: the fake server has none).
    assert prefix_hit_rate(point.summary["server_counters"]) is None
    assert prefix_hit_rate({"inflight:prefix_cache_queries_total": 400.0,
                            "inflight:prefix_cache_hits_total": 100.0}) == 0.25
    assert "Prefix cache hit rate (%)" in format_summary({**point.summary, "server_counters": {
        "vllm:prefix_cache_queries_total": 8.0, "vllm:prefix_cache_hits_total": 6.0}})
    # All six were due at once; each follow-up went only after its previous answer (>= 0.25 s).
    recs = {(s.meta["conversation"], s.meta["turn"]): r for s, r in zip(session.specs, point.records)}
    for (conv, turn), r in recs.items():
        if turn:
            assert r.send_time >= recs[(conv, turn - 1)].end_time
            assert r.scheduled_time == 0.0


def test_simulated_follow_ups_repeat_stand_in_answers(data_dir):
    c = DatasetConfig(name="chat", data_dir=str(data_dir), num_prompts=6, output_len=5,
                      conversation_turns=3, active_conversations=2)
    specs = asyncio.run(build_dataset(c, WordCounter()))
    sent = with_stand_in_answers(specs)
    stand_in = {"role": "assistant", "content": "answer " * 4 + "answer"}
    own = {(s.meta["conversation"], s.meta["turn"]): s.messages[0] for s in specs}
    for s, x in zip(specs, sent):
        conv, turn = s.meta["conversation"], s.meta["turn"]
        want = []
        for k in range(turn):
            want += [own[(conv, k)], stand_in]
        assert x.messages == [*want, own[(conv, turn)]]
        assert x.prompt.startswith(own[(conv, 0)]["content"])
