"""Tool-call parsing and streaming, without a model (``server/tool_parsers.py``,
``server/tools.py``)."""

from __future__ import annotations

import json

import pytest

from inflight.server.tool_parsers import parse_hermes, parse_llama3_json
from inflight.server.tools import ToolPlan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_content_then_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_hermes_unterminated_last_call_and_string_arguments():
    content, calls = parse_hermes('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert content is None and calls == [("f", '{"a": 1}')]


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json", '<tool_call>{"x": 1}',
                                  '<tool_call>{"name": "f", "arguments": [1]}'])
def test_hermes_non_calls_are_content(text):
    assert parse_hermes(text) == (text, [])


def test_llama3_json_single_multiple_and_python_tag():
    assert parse_llama3_json('{"name": "f", "parameters": {"x": 1}}') == \
        (None, [("f", '{"x": 1}')])
    assert parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {}}; '
                             '{"name": "g", "arguments": {"y": "z"}}') == \
        (None, [("f", "{}"), ("g", '{"y": "z"}')])


@pytest.mark.parametrize("text", ["Sure, the answer is 4.", '{"name": 3}', '{"a": 1} and more',
                                  '{"name": "f", "parameters": {}} trailing'])
def test_llama3_json_non_calls_are_content(text):
    assert parse_llama3_json(text) == (text, [])


def _stream(plan: ToolPlan, pieces: list[str]) -> list[tuple[dict | None, str | None]]:
    s = plan.streamer()
    return [s.delta(p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]


def test_auto_hermes_streams_content_then_whole_calls():
    plan = ToolPlan("auto", [WEATHER], parser="hermes")
    pieces = ["I will ", "check. <tool", '_call>{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}', "</tool_call>", ""]
    out = _stream(plan, pieces)
    content = "".join(d["content"] for d, _ in out if d and "content" in d)
    assert content == "I will check. "  # "<tool" held back, never shown as content
    last, reason = out[-1]
    assert reason == "tool_calls"
    (call,) = last["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert call["id"].startswith("chatcmpl-tool-")


def test_auto_text_that_only_looked_like_a_call_is_released_at_the_end():
    plan = ToolPlan("auto", [WEATHER], parser="llama3_json")
    out = _stream(plan, ["{not a call", " at all}", ""])
    assert out[0] == (None, None) and out[1] == (None, None)
    assert out[2] == ({"content": "{not a call at all}"}, "stop")


def test_named_streams_arguments_and_matches_the_non_streamed_message():
    plan = ToolPlan("named", [WEATHER], name="get_weather")
    pieces = ['{"city": ', '"Rome"', "}", ""]
    out = _stream(plan, pieces)
    first = out[0][0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["index"] == 0
    args = first["function"]["arguments"] + "".join(
        d["tool_calls"][0]["function"]["arguments"] for d, _ in out[1:] if d)
    assert json.loads(args) == {"city": "Rome"}
    msg, reason = plan.message("".join(pieces), "stop")
    assert reason == "stop" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": args}


def test_required_array_becomes_calls():
    plan = ToolPlan("required", [WEATHER])
    msg, reason = plan.message('[{"name": "get_weather", "parameters": {"city": "Lima"}}]', "stop")
    assert reason == "tool_calls"
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Lima"}'}]
    # cut by max_tokens: no calls, the text is content, the reason stays
    assert plan.message('[{"name": "get_wea', "length") == (
        {"role": "assistant", "content": '[{"name": "get_wea'}, "length")


def test_chat_template_flag_takes_a_file_or_inline_jinja(tmp_path):
    from inflight.server.lifecycle import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(FileNotFoundError, match="chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
