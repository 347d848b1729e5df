"""Untrusted chat templates: sandbox escapes run no code and are the model's fault (not a
``ValueError``, so the server answers 500, not 400), renders are bounded in time and size, and
an unsafe template is refused at start-up.

GGUF files are written here with ``gguf.GGUFWriter``: the bundled model's tokenizer metadata
with another ``tokenizer.chat_template`` (tokenizer only, no tensors, for the tokenizer-level
checks) and once with a tiny llama's weights, for the engine's own start-up path.
"""

from __future__ import annotations

import logging
import pathlib
import time

import gguf
import numpy as np
import pytest
from jinja2.exceptions import SecurityError

from inflight.model.bundled import find_bundled_model
from inflight.model.gguf_file import read_gguf_metadata
from inflight.tokenizer import (ChatTemplateError, ConversationRejectedError, Tokenizer,
                                UnsafeChatTemplateError, check_chat_template, chat)

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

# Each would run a shell command (touching {{ target }}) if the sandbox let it out.
ESCAPES = {
    "mro_subclasses": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
                      "{% if c.__name__ == 'Popen' %}{{ c(['touch', target]) }}{% endif %}"
                      "{% endfor %}",
    "cycler_globals": "{{ cycler.__init__.__globals__.os.system('touch ' ~ target) }}",
    "joiner_globals": "{{ joiner.__init__.__globals__['os'].popen('touch ' ~ target).read() }}",
    "namespace_globals": "{{ namespace.__init__.__globals__['os'].system('touch ' ~ target) }}",
    "namespace_store_dunder": "{% set ns = namespace() %}{% set ns.__class__ = cycler %}"
                              "{{ ns.__class__.__init__.__globals__.os.system('touch ' ~ target) }}",
    "namespace_dunder_kwarg": "{{ namespace(__init__=1) }}",
    "namespace_private": "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs }}",
    "template_reference_context": "{{ self._TemplateReference__context.cycler.__init__"
                                  ".__globals__.os.system('touch ' ~ target) }}",
    "bare_unsafe_read": "{{ self._TemplateReference__context }}",
    "attr_filter": "{{ (''|attr('__class__')).__mro__ }}",
    "format_string": "{{ '{0.__class__.__mro__}'.format('') }}",
    "helper_globals": "{{ raise_exception.__globals__['os'].system('touch ' ~ target) }}",
    "lipsum_globals": "{{ lipsum.__globals__['os'].system('touch ' ~ target) }}",
    "mutate_list": "{% set x = messages %}{{ x.append({'role': 'system'}) }}",
}


@pytest.fixture(scope="module")
def bundled_tok() -> Tokenizer:
    return Tokenizer.from_gguf(find_bundled_model())


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     chat_template=template)


@pytest.fixture(scope="module")
def tokenizer_meta() -> dict:
    return read_gguf_metadata(find_bundled_model(), lambda k: k.startswith("tokenizer."))


def write_gguf(path: pathlib.Path, meta: dict, template: str, tiny_model: bool = False) -> None:
    """A GGUF with ``meta``'s tokenizer keys and ``template``; with ``tiny_model``, also a
    one-layer llama (hidden size 8) whose vocabulary is the tokenizer's."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.add_chat_template(template)
    if tiny_model:
        vocab, hidden, ff = len(meta["tokenizer.ggml.tokens"]), 8, 16
        for key, value in (("block_count", 1), ("context_length", 64),
                           ("embedding_length", hidden), ("feed_forward_length", ff),
                           ("attention.head_count", 2), ("attention.head_count_kv", 1)):
            w.add_uint32(f"llama.{key}", value)
        w.add_layer_norm_rms_eps(1e-6)
        rng = np.random.default_rng(0)
        shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
                  "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
                  "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (4, hidden),
                  "blk.0.attn_v.weight": (4, hidden), "blk.0.attn_output.weight": (hidden, hidden),
                  "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
                  "blk.0.ffn_down.weight": (hidden, ff)}
        for name, shape in shapes.items():
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------------------ escapes
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_runs_no_code_and_is_the_models_fault(bundled_tok, tmp_path, name) -> None:
    target = tmp_path / "pwned"
    tok = with_template(bundled_tok, ESCAPES[name])
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template(CONVERSATION, target=str(target))
    err = info.value
    assert not target.exists()
    assert not isinstance(err, ValueError)  # the server's existing 400 path must not take it
    assert err.reason == "unsafe" and isinstance(err.__cause__, SecurityError)
    # The client sees a fixed sentence; the sandbox's wording stays in .detail (logs).
    assert str(err) == ("the model's chat template failed: it tried to access an unsafe "
                        "attribute or operation")
    assert err.detail and err.detail not in str(err)


def test_raise_exception_is_the_clients_fault(bundled_tok) -> None:
    tok = with_template(bundled_tok, "{% if messages[0].role == 'system' %}"
                                     "{{ raise_exception('System role not supported') }}"
                                     "{% endif %}ok")
    with pytest.raises(ConversationRejectedError, match="^System role not supported$") as info:
        tok.apply_chat_template(CONVERSATION)
    assert isinstance(info.value, ValueError)
    assert tok.apply_chat_template(CONVERSATION[1:]) == "ok"


def test_rejection_message_is_truncated(bundled_tok) -> None:
    tok = with_template(bundled_tok, "{{ raise_exception('no ' * 10000) }}")
    with pytest.raises(ConversationRejectedError) as info:
        tok.apply_chat_template(CONVERSATION)
    assert len(str(info.value)) <= 2003


# ------------------------------------------------------------------------- bounds
@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(chat, "RENDER_TIMEOUT_S", 0.25)
    return 0.25


@pytest.mark.parametrize("template", [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    # No call inside the loops: only the per-iteration check can see them.
    "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
])
def test_loop_bomb_stops_at_the_deadline(bundled_tok, short_timeout, template) -> None:
    tok = with_template(bundled_tok, template)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template(CONVERSATION)
    elapsed = time.monotonic() - t0
    assert info.value.reason in ("timeout", "recursion")
    assert elapsed < short_timeout + 1.0


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**9 }}",  # refused before allocating (and not constant-folded at compile)
    "{{ ['x'] * 10**9 }}",
    "{{ 9 ** 999999 }}",
    "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set a = 'x' %}" + "{% set a = a ~ a %}" * 40,
    "{% set a = 'x' %}" + "{% set a %}{{ a }}{{ a }}{% endset %}" * 40,
    "{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}",
    "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",  # 10 MB of output
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ (1).to_bytes(10**9, 'big') }}",
    "{{ '%*d' % (10**9, 1) }}",
    "{{ '%1000000000d'|format(1) }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}",
    "{{ range(100000)|join('x' * 100000) }}",
    "{{ 'a\\nb'|indent(10**9) }}",
    "{{ lipsum(10**7) }}",
    "{{ messages|tojson(indent=10**9) }}",
])
def test_size_bomb_is_refused(bundled_tok, template) -> None:
    tok = with_template(bundled_tok, template)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template(CONVERSATION)
    assert info.value.reason == "too_large", info.value.detail
    assert str(info.value) == ("the model's chat template failed: its output or an "
                               "intermediate value exceeded the size limit")
    assert time.monotonic() - t0 < 2.0


def test_macro_recursion_is_stopped(bundled_tok) -> None:
    tok = with_template(bundled_tok, "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    with pytest.raises(ChatTemplateError, match="recursed too deeply") as info:
        tok.apply_chat_template(CONVERSATION)
    assert info.value.reason == "recursion"


def test_size_bound_grows_with_the_request(bundled_tok) -> None:
    # A request bigger than MAX_RENDER_CHARS renders (and is later refused as too long for the
    # context, the client's fault), rather than failing here as the template's fault.
    big = "word " * (chat.MAX_RENDER_CHARS // 4)
    text = bundled_tok.apply_chat_template([{"role": "user", "content": big}])
    assert big in text and len(text) > chat.MAX_RENDER_CHARS


def test_ordinary_template_features_still_work(bundled_tok) -> None:
    tok = with_template(bundled_tok,
                        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.role }}"
                        "{% if loop.last %}!{% endif %}{% endfor %}|{{ 'ab' * 2 }}|{{ 2 ** 10 }}|"
                        "{{ '%d %s' % (1700000000, 'x') }}|{{ '{} {:>4}'.format(1700000000, 'y') }}|"
                        "{{ messages|map(attribute='content')|join(', ') }}|"
                        "{{ 'a-b'|replace('-', '--') }}|{{ [1, [2]]|tojson(indent=2) }}")
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        "1/2system2/2user!|abab|1024|1700000000 x|1700000000    y|Be brief., Hi|a--b|"
        "[\n  1,\n  [\n    2\n  ]\n]")


def test_bundled_template_is_unchanged(bundled_tok) -> None:
    # The reference rendering (tests/tokenizer check it against transformers) is unchanged.
    assert bundled_tok.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")


# ---------------------------------------------------------------------- start-up
def test_startup_refuses_an_escaping_template(tokenizer_meta, tmp_path) -> None:
    path = tmp_path / "evil.gguf"
    write_gguf(path, tokenizer_meta, "{{ cycler.__init__.__globals__.os.system('id') }}"
                                     "{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = Tokenizer.from_gguf(path)
    with pytest.raises(UnsafeChatTemplateError) as info:
        check_chat_template(tok, path)
    msg = str(info.value)
    assert str(path) in msg and "refusing to serve" in msg and "unsafe" in msg
    assert "--chat-template" in msg
    assert isinstance(info.value.__cause__, ChatTemplateError)


def test_startup_refuses_a_loop_bomb(bundled_tok, short_timeout) -> None:
    tok = with_template(bundled_tok, "{% for i in range(99999) %}{% for j in range(99999) %}"
                                     "{% endfor %}{% endfor %}")
    with pytest.raises(UnsafeChatTemplateError, match="time limit"):
        check_chat_template(tok, "bomb.gguf")


def test_startup_accepts_a_template_without_system_role(bundled_tok, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inflight.tokenizer.chat")
    tok = with_template(bundled_tok,
                        "{% for m in messages %}{% if m.role == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}"
                        "[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    check_chat_template(tok, "nosys.gguf")  # no raise
    assert "without" in caplog.text


def test_startup_accepts_a_template_that_always_rejects(bundled_tok, caplog) -> None:
    tok = with_template(bundled_tok, "{{ raise_exception('only tool calls here') }}")
    check_chat_template(tok, "picky.gguf")
    assert "only tool calls here" in caplog.text


def test_startup_logs_but_accepts_a_broken_template(bundled_tok, caplog) -> None:
    tok = with_template(bundled_tok, "{{ messages[0].content + 1 }}")
    check_chat_template(tok, "broken.gguf")
    assert "broken.gguf" in caplog.text and "TypeError" in caplog.text


def test_startup_accepts_the_bundled_template_and_none(bundled_tok) -> None:
    check_chat_template(bundled_tok, find_bundled_model())
    check_chat_template(Tokenizer(bundled_tok.backend), "bare.gguf")


def test_engine_start_up_refuses_an_unsafe_template(tokenizer_meta, tmp_path) -> None:
    # The engine's own load path (inflight.engine.loading.load), on a tiny llama GGUF.
    from inflight.config import EngineConfig
    from inflight.engine import loading

    evil = tmp_path / "evil.gguf"
    write_gguf(evil, tokenizer_meta, "{{ joiner.__init__.__globals__['os'].system('id') }}",
               tiny_model=True)
    config = dict(device="cpu", dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(UnsafeChatTemplateError, match="evil.gguf.*refusing to serve"):
        loading.load(EngineConfig(model=str(evil), **config))
    # (The bundled model's normal start-up through the same path is in tests/e2e.)
