"""``POST /v1/responses`` (issue 33): the translation onto chat, the response object, the
event sequence, the 400s, on a fake runner (fast); then the real bundled model through the
official ``openai`` client, held equal to chat completions: plain, streamed, ``text.format``
json_schema and a function call with its output fed back."""

from __future__ import annotations

import json
import pathlib
import time

import httpx
import jsonschema
import openai
import pytest

from inflight.config import EngineConfig
from inflight.core.output import SampleResult
from inflight.engine import Engine
from inflight.engine.async_engine import AsyncEngine
from inflight.server.app import build_app
from inflight.server.responses_api import ResponsesRequest
from inflight.server.responses_serving import to_chat_request
from inflight.server.tenants import TenantSettings
from tests.server.conftest import MODEL, ServerThread, serve

FAIL_AT = 7  # max_output_tokens that makes the fake runner fail the step after 2 tokens


class HiRunner:
    """Every sampling row gets the token of " hi"; a request with ``max_tokens ==
    FAIL_AT`` fails the step once it has 2 tokens, as a failing model step would."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def execute(self, out):
        time.sleep(0.002)
        if any(s.request.sampling_params.max_tokens == FAIL_AT
               and s.request.num_output_tokens >= 2 for s in out.scheduled):
            raise RuntimeError("failed model step")
        return [SampleResult(s.request, self.token_id, None) for s in out.scheduled if s.samples]


@pytest.fixture(scope="module")
def fake_engine(bundled_model_path):
    from inflight.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(bundled_model_path)
    return Engine(EngineConfig(max_num_seqs=8, max_model_len=512),
                  runner=HiRunner(tok.encode(" hi")[0]), tokenizer=tok, num_blocks=128,
                  max_model_len=512, eos_token_ids=tok.eos_token_ids)


@pytest.fixture(scope="module")
def fake(fake_engine):
    srv = ServerThread(build_app(AsyncEngine(fake_engine), model_names=["fake"])).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fake_client(fake):
    return openai.OpenAI(base_url=fake.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def _post(srv, body):
    return httpx.post(srv.base_url + "/v1/responses", json={"model": "fake", **body}, timeout=60)


def _prompt_tokens(srv, messages) -> int:
    """What chat's path makes of ``messages``: ``/tokenize`` renders them the same way."""
    r = httpx.post(srv.base_url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


# --- the translation ----------------------------------------------------------------------
def test_items_become_chat_messages():
    req = ResponsesRequest.model_validate({
        "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"},
                            "strict": True}},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "input": [
            {"role": "developer", "content": "dev"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "thinking", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
            {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]})
    chat = to_chat_request(req)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert got == [
        {"role": "system", "content": "be brief"}, {"role": "developer", "content": "dev"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "thinking", "tool_calls": [
            {"id": "c1", **call},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "tool_calls": [{"id": "c3", **call}]}]
    assert chat.max_completion_tokens == 9 and chat.temperature == 0.5
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False


def test_input_renders_as_chat_renders_it(fake, fake_client):
    r = fake_client.responses.create(model="fake", instructions="be brief", input="Hello",
                                     max_output_tokens=2)
    assert r.usage.input_tokens == _prompt_tokens(fake, [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}])
    history = [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                            {"type": "input_text", "text": "b"}]},
               {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    r = fake_client.responses.create(model="fake", input=history, max_output_tokens=2)
    assert r.usage.input_tokens == _prompt_tokens(fake, [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])


# --- the response object and the events -----------------------------------------------------
def test_response_object(fake_client):
    r = fake_client.responses.create(model="fake", input="Hi", instructions="x",
                                     max_output_tokens=4, store=True, metadata={"k": "v"},
                                     text={"format": {"type": "json_object"}})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake"
    assert r.output_text == " hi" * 4
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete" and item.content[0].type == "output_text"
    assert r.usage.output_tokens == 4
    assert r.usage.total_tokens == r.usage.input_tokens + 4
    assert r.store is False and r.previous_response_id is None  # store is answered as false
    assert r.instructions == "x" and r.max_output_tokens == 4 and r.metadata == {"k": "v"}
    assert r.text.format.type == "json_object" and r.temperature == 1.0


def test_stream_events_in_openai_order(fake_client):
    events = list(fake_client.responses.create(model="fake", input="Hi", max_output_tokens=3,
                                               stream=True))
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")  # tokens that piled up are merged
    assert 1 <= num_deltas <= 3
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added"] + ["response.output_text.delta"] * num_deltas + [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == " hi" * 3 == final.output_text == events[-4].text
    assert events[2].item.id == events[-2].item.id == final.output[0].id
    assert final.usage.output_tokens == 3 and final.id == events[0].response.id


def test_engine_failure_mid_stream_is_an_error_event(fake):
    with httpx.stream("POST", fake.base_url + "/v1/responses", timeout=60, json={
            "model": "fake", "input": "Hi", "max_output_tokens": FAIL_AT, "stream": True}) as r:
        assert r.status_code == 200
        kinds = [line.removeprefix("event: ") for line in r.iter_lines()
                 if line.startswith("event: ")]
    assert kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds


@pytest.mark.parametrize("body, status, param", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"background": True}, 400, "background"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, "input[0].content[0].type"),
    ({"input": []}, 400, "input"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tool_choice": "auto", "tools": [{"type": "function", "name": "f"}]}, 400, "tool_choice"),
    ({"max_output_tokens": 600}, 400, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400,
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "text.format"),
    ({"model": "nope"}, 404, "model"),
])
def test_refusals_name_the_field(fake, body, status, param):
    r = _post(fake, {"input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if param == "previous_response_id":
        assert r.json()["error"]["code"] == "previous_response_not_found"
    if param == "max_output_tokens":
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_fields_that_change_nothing_are_ignored(fake):
    r = _post(fake, {"input": "Hi", "max_output_tokens": 2, "store": True, "background": False,
                     "truncation": "disabled", "include": [], "service_tier": "auto",
                     "reasoning": {"effort": "low"}, "prompt_cache_key": "k",
                     "safety_identifier": "s", "text": {"verbosity": "low"}})
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False


def test_the_document_describes_the_route(fake, fake_engine):
    doc = httpx.get(fake.base_url + "/openapi.json", timeout=10).json()
    op = doc["paths"]["/v1/responses"]["post"]
    assert {"200", "400", "404", "503"} <= set(op["responses"]) and "429" not in op["responses"]
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert doc["components"]["schemas"]["ResponsesRequest"]["required"] == ["input"]
    limited = build_app(AsyncEngine(fake_engine), model_names=["fake"],
                        tenants=TenantSettings(max_concurrent_requests=2)).openapi()
    assert "429" in limited["paths"]["/v1/responses"]["post"]["responses"]


# --- the real model, through the openai client -----------------------------------------------
TEMPLATE = (pathlib.Path(__file__).parents[2] / "examples" / "chat_templates"
            / "chatml_tools_hermes.jinja").read_text()
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
        "parameters": WEATHER}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def real(real_engine):
    tok = real_engine.tokenizer
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    srv, _ = serve(real_engine, tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.stop()
    tok.chat_template = saved


@pytest.mark.slow
def test_real_text_equals_chat_and_streams_the_same(real):
    r = real.responses.create(model=MODEL, instructions="Answer in one sentence.",
                              input="What is the capital of France?", temperature=0,
                              max_output_tokens=24)
    chat = real.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(real.responses.create(model=MODEL, instructions="Answer in one sentence.",
                                        input="What is the capital of France?", temperature=0,
                                        max_output_tokens=24, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    assert events[-1].type == f"response.{r.status}"
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


@pytest.mark.slow
def test_real_json_schema_output_validates(real):
    r = real.responses.create(model=MODEL, input="Describe a person as JSON.", temperature=0,
                              max_output_tokens=60, text={"format": {
                                  "type": "json_schema", "name": "person", "schema": PERSON,
                                  "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    chat = real.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=0, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.output_text == chat.choices[0].message.content


@pytest.mark.slow
def test_real_function_call_and_its_output_fed_back(real):
    kwargs = dict(model=MODEL, input=ASK, tools=[TOOL], temperature=0, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"})
    r = real.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(real.responses.create(stream=True, **kwargs))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    assert [e for e in events if e.type == "response.function_call_arguments.done"][0].name \
        == "get_weather"
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r2 = real.responses.create(model=MODEL, input=history, tools=[TOOL], tool_choice="none",
                               temperature=0, max_output_tokens=20)
    assert r2.output[0].type == "message" and r2.output_text
    chat = real.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=20, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert r2.output_text == chat.choices[0].message.content
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
