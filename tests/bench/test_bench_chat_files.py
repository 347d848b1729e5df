"""Chat prompt files are checked as they are read: a bad line is named, never a
traceback or a hang later in the run."""

from __future__ import annotations

import pytest

from inflight.bench.chat_files import load_chat_file


def test_mt_bench_reads_as_two_turn_conversations(data_dir):
    lines = load_chat_file(data_dir / "mt_bench_questions.jsonl")
    assert len(lines) == 80 and all(len(q.turns) == 2 for q in lines)
    assert lines[0].question_id == 81 and lines[0].category == "writing"


@pytest.mark.parametrize("text, message", [
    ("", "no conversations"),
    ("\n\n", "no conversations"),
    ('{"turns": [123, {"a": 1}]}\n', 'line 1: "turns" must be a non-empty list of non-empty strings'),
    ('{"turns": "just a string"}\n', 'line 1: "turns" must be'),
    ('{"turns": []}\n', 'line 1: "turns" must be'),
    ('{"prompt": "ok"}\n\n{"turns": ["a", ""]}\n', 'line 3: "turns" must be'),
    ('{"prompt": 5}\n', 'line 1: "turns" must be'),
    ('{"question": "hi"}\n', 'line 1: expected an object with "turns"'),
    ('["hi"]\n', 'line 1: expected an object'),
    ("nope\n", "line 1: not JSON"),
])
def test_a_bad_line_is_named(tmp_path, text, message):
    f = tmp_path / "chat.jsonl"
    f.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        load_chat_file(f)
    assert str(f) in str(e.value)


def test_a_prompt_line_is_one_turn(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text('{"prompt": "hello"}\n{"turns": ["a", "b"], "question_id": 7}\n')
    assert [(q.turns, q.question_id) for q in load_chat_file(f)] == [(("hello",), None), (("a", "b"), 7)]
