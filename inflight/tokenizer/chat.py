"""Chat-template rendering in a Jinja sandbox, matching Hugging Face transformers.

Chat templates ship with model files and are untrusted code, so they run in
``jinja2.sandbox.ImmutableSandboxedEnvironment``. The environment mirrors
``transformers.utils.chat_template_utils._cached_compile_jinja_template`` (trim_blocks,
lstrip_blocks, loop controls, ``{% generation %}``, ``tojson``, ``raise_exception``,
``strftime_now``, a namespace that refuses underscore names) so prompts render byte-identically.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template", "validate_messages"]


class _GenerationTag(jinja2.ext.Extension):
    # Training templates mark assistant spans with {% generation %}; only the body matters for
    # inference, but without the tag such templates would not even parse.
    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Namespace(jinja2.utils.Namespace):
    # The sandbox guards attribute reads, not namespace writes; dunder names stored here could
    # later be reached as attributes, so they are refused up front (as transformers does).
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not store underscore attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would corrupt prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    # Rebuild inputs from plain JSON types so no caller object (with methods the sandbox does not
    # know to be dangerous) is reachable from the template.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    # Subclasses (str enums, numpy scalars) carry extra methods: keep only the base value.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def validate_messages(messages: Any) -> list[dict]:
    """Check an OpenAI-style message list and return plain-dict copies with ``None`` values dropped.

    Each message needs a string ``role`` and a ``content`` (str, list of parts, or ``None`` only when
    the message carries ``tool_calls``). Keys whose value is ``None`` are dropped, as transformers
    does, because templates handle a missing key but render ``None`` literally.
    Raises ``ValueError`` naming the first offending message.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role' (a non-empty string is required)")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise ValueError(
                f"messages[{i}] content must be a string or a list of parts, "
                f"got {type(content).__name__}")
        out.append({k: v for k, v in _plain(message).items() if v is not None})
    return out


def render_chat_template(template: str | None, messages: list[dict], *, add_generation_prompt: bool,
                         bos_token: str, eos_token: str, **kwargs: Any) -> str:
    """Render ``messages`` with a Jinja chat ``template`` into the prompt string.

    Extra ``kwargs`` (``tools``, ``documents``, ``unk_token``, template flags such as
    ``enable_thinking``) are passed to the template like transformers'
    ``apply_chat_template(..., tokenize=False)``; ``tools`` and ``documents`` default to ``None``.

    Raises ``ValueError`` when the model has no template, the template does not compile, the
    template rejects the conversation (``raise_exception``), the template tries to leave the
    sandbox (the ``__cause__`` is then ``jinja2.exceptions.SecurityError``), or ``messages`` is
    malformed (see :func:`validate_messages`).
    """
    if not template:
        raise ValueError("this model has no chat template; send a plain completion prompt instead")
    chat = validate_messages(messages)
    try:
        compiled = _compile(template)
    except TemplateError as exc:
        raise ValueError(f"invalid chat template: {exc}") from exc
    context = {"tools": None, "documents": None, **_plain(kwargs)}
    try:
        return compiled.render(messages=chat, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **context)
    except SecurityError as exc:
        raise ValueError(f"chat template tried an unsafe operation (sandbox): {exc}") from exc
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
        # Python errors inside a template come from messages the template does not expect.
        raise ValueError(f"chat template error: {exc}") from exc
