"""Tool calling end to end on the real model through the official ``openai`` client
(issue 16): forced calls always parse against the tool's schema, streamed deltas add up to
the non-streamed call, the tool-result round trip renders, bad tool requests are 400s."""

from __future__ import annotations

import json
import pathlib

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, serve

pytestmark = pytest.mark.slow

TEMPLATE = (pathlib.Path(__file__).parents[2] / "examples" / "chat_templates"
            / "chatml_tools_hermes.jinja").read_text()
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "maxLength": 20}},
                                          "required": ["tz"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(real_engine):
    tok = real_engine.tokenizer
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    srv, _ = serve(real_engine, tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield srv
    srv.stop()
    tok.chat_template = saved


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def test_named_call_parses_and_round_trips(client):
    """The openai client's flow: a forced call, its result sent back as a ``tool``
    message, then a plain answer."""
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                        tool_choice="none", temperature=0, max_tokens=20)
    assert r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content
    # the call and its result are in the prompt: it grew by at least their text
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 15


def test_required_calls_validate_against_their_tools(client):
    # parallel_tool_calls=False bounds the array to one call: greedy, this small model may
    # otherwise repeat calls until max_tokens (it does where prompts take the int8 path).
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=0, max_tokens=120,
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_streamed_named_call_adds_up_to_the_non_streamed_one(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    name, args, ids, reasons = None, "", set(), []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                name = tc.function.name or name
                args += tc.function.arguments or ""
                if tc.id:
                    ids.add(tc.id)
    assert name == "get_weather" and len(ids) == 1
    assert args == whole.function.arguments
    assert reasons[-1] == "stop"


def test_streamed_required_calls_come_whole(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=0,
                                            max_tokens=120, stream=True,
                                            parallel_tool_calls=False)
    calls, content, reason = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            reason = c.finish_reason or reason
    assert reason == "tool_calls" and len(calls) == 1 and content == ""
    for tc in calls:
        assert tc.id and tc.function.name in {"get_weather", "get_time"}
        json.loads(tc.function.arguments)


def test_auto_reply_is_text_or_valid_calls(client):
    """Whatever the small model says under ``auto``: either plain text, or calls whose
    arguments are JSON objects, with the finish reason to match."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="auto", temperature=0, max_tokens=60)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"messages": [{"role": "assistant", "content": None}]}, None),
    ({"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "broken", "parameters": {"type": "nonsense"}}}],
      "tool_choice": {"type": "function", "function": {"name": "broken"}}},
     "tools[1].function.parameters"),
])
def test_bad_tool_requests_are_400(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_auto_needs_a_parser(real_engine):
    srv, _ = serve(real_engine)
    try:
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto",
            "max_tokens": 4})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        # tools without tool_choice: rendered, answered as text
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    finally:
        srv.stop()
