"""Chat-template rendering: equality with transformers, sandboxing, and input errors."""

from __future__ import annotations

import datetime

import pytest
from jinja2.exceptions import SecurityError

from inflight.model.bundled import find_bundled_model
from inflight.tokenizer import (ChatTemplateError, ConversationRejectedError, Tokenizer,
                                render_chat_template)

# Exercises what real templates use: tools + tojson, namespace, loop controls, is string/defined
# tests, raise_exception, {% generation %}, template kwargs, and trim/lstrip_blocks whitespace.
RICH_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You help.{%- endif %}
{{- "\\n\\n# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- endif %}
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
  {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
  {%- set ns.count = ns.count + 1 %}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' + message.role) }}
  {%- endif %}
  {{- '<|im_start|>' + message.role + '\\n' }}
  {%- if message.content is string %}{{ message.content }}
  {%- elif message.content is defined %}
    {%- for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}
  {%- endif %}
  {%- if message.tool_calls is defined %}
    {%- for call in message.tool_calls %}{{ '\\n<tool_call>' + (call.function | tojson) + '</tool_call>' }}{% endfor %}
  {%- endif %}
  {%- if message.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% else %}{{ eos_token }}{% endif %}
  {{- '\\n' }}
  {%- if loop.last %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- bos_token + 'assistant\\n' }}
  {%- if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
{% if ns.count > 1 %}
    [{{ ns.count }} turns]
{% endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & here",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello?"}],
    [{"role": "system", "content": "Be terse."},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? 你好 🌍"}],
    [{"role": "user", "content": "Line one\nline two\n\n  indented"},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "<|im_end|> injected?"}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(find_bundled_model())


@pytest.fixture(scope="module")
def ref(tok: Tokenizer):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(find_bundled_model().parent), gguf_file=find_bundled_model().name)


@pytest.fixture(scope="module")
def rich_ref(tok: Tokenizer):
    # Cheap transformers tokenizer over the same backend, for templates the GGUF does not carry.
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, bos_token="<|im_start|>", eos_token="<|im_end|>")


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_bundled_template_matches_transformers(tok, ref, messages, add_generation_prompt) -> None:
    expected = ref.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    if messages[0]["role"] != "system":
        assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant")


@pytest.mark.parametrize("messages", CONVERSATIONS + [
    [{"role": "user", "content": [{"type": "text", "text": "part A "}, {"type": "text", "text": "B"}]},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "{\"temp\": 3}"}],
])
@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"enable_thinking": False}])
def test_rich_template_matches_transformers(tok, rich_ref, messages, kwargs) -> None:
    expected = rich_ref.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tokenize=False,
                                            add_generation_prompt=True, **kwargs)
    got = tok.apply_chat_template(messages, chat_template=RICH_TEMPLATE, **kwargs)
    assert got == expected
    if "tools" in kwargs:
        assert '"description": "Weather <now> & here"' in got  # tojson does not HTML-escape


def render(template: str, messages=({"role": "user", "content": "x"},), **kwargs) -> str:
    return render_chat_template(template, list(messages), add_generation_prompt=True,
                                bos_token="<s>", eos_token="</s>", **kwargs)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__.__base__ }}",
    "{% set x = [] %}{{ x.append(1) }}",  # immutable sandbox: no mutating builtins
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{{ namespace(__dict__=1) }}",
])
def test_sandbox_escape_is_refused(template: str) -> None:
    # The model's fault, not the client's: not a ValueError, and no sandbox wording for clients.
    with pytest.raises(ChatTemplateError, match="unsafe attribute") as info:
        render(template)
    assert not isinstance(info.value, ValueError) and info.value.reason == "unsafe"
    assert isinstance(info.value.__cause__, SecurityError)


def test_helpers() -> None:
    assert render("{{ raise_exception is defined }}") == "True"
    with pytest.raises(ConversationRejectedError, match="^Only user and assistant roles"):
        render("{{ raise_exception('Only user and assistant roles are supported') }}")
    assert render("{{ strftime_now('%Y') }}") == str(datetime.datetime.now().year)
    assert render("{{ {'k': 'é<&>'} | tojson }}") == '{"k": "é<&>"}'
    assert render("{{ [1, 2] | tojson(indent=2) }}") == "[\n  1,\n  2\n]"
    assert render("{{ bos_token }}|{{ eos_token }}|{{ foo }}", foo="bar") == "<s>|</s>|bar"
    assert render("{{ add_generation_prompt }} {{ tools }}") == "True None"


def test_trim_and_lstrip_blocks() -> None:
    template = "{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) \
        == "[a]\n[b]\n"


@pytest.mark.parametrize("template, reason, match", [
    ("{% for m in messages %}", "invalid", "does not compile"),
    ("{{ messages[0].content + 1 }}", "error", "raised TypeError"),
    ("{{ messages[0].nope.deeper }}", "error", "raised UndefinedError"),
])
def test_broken_templates_are_the_models_fault(template, reason: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as info:
        render(template)
    assert info.value.reason == reason


@pytest.mark.parametrize("template", [None, ""])
def test_no_template(template) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        render(template)


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\].*no 'content'"),
    ([{"role": "user", "content": None}], "no 'content'"),
    ([{"role": "user", "content": 5}], "string or a list"),
])
def test_bad_messages(messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat_template("{{ messages }}", messages, add_generation_prompt=True,
                             bos_token="", eos_token="")


def test_model_without_template(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
