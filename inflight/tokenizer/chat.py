"""Chat-template rendering in a bounded Jinja sandbox, matching Hugging Face transformers.

Chat templates ship with model files and are untrusted code, so they run in
``jinja2.sandbox.ImmutableSandboxedEnvironment``. The environment mirrors
``transformers.utils.chat_template_utils._cached_compile_jinja_template`` (trim_blocks,
lstrip_blocks, loop controls, ``{% generation %}``, ``tojson``, ``raise_exception``,
``strftime_now``, a namespace that refuses underscore names) so prompts render byte-identically.

The sandbox stops a template from reaching Python internals, but not from spending time or
memory, so every render is also bounded (see "Bounds" below).

Whose fault a failure is (the server maps the first two to HTTP 400, the third to 500):

* ``ValueError`` -- the request's: ``messages`` is malformed
  (:func:`.chat_messages.validate_messages`) or the model has no chat template at all.
* :class:`ConversationRejectedError` (a ``ValueError``) -- the request's: the template itself
  refused the conversation through ``raise_exception(...)`` (e.g. "Conversation roles must
  alternate user/assistant/..."). Its message is the template's own text, meant for the user.
* :class:`ChatTemplateError` (not a ``ValueError``) -- the model's: the template does not
  compile, tried to leave the sandbox (``jinja2.exceptions.SecurityError``), ran past
  :data:`RENDER_TIMEOUT_S`, produced more than the size bound, recursed too deeply, or raised
  any other exception (an undefined attribute, a ``TypeError``...). ``str()`` of it is a short,
  fixed sentence safe to show a client; the sandbox's or Python's own message is kept in
  ``.detail`` (and logged), never in the client-facing text, and ``.reason`` says which case.

:func:`check_chat_template` renders a probe conversation at start-up and raises
:class:`UnsafeChatTemplateError` (a ``ValueError``, so the CLI prints it) for a template whose
failure is a safety or resource one (``.reason`` in :data:`UNSAFE_REASONS`).

Bounds (per render; module constants so tests and operators can change them):

* time: :data:`RENDER_TIMEOUT_S` seconds of wall time. Jinja renders synchronously and cannot
  be interrupted from outside, so the deadline is checked from inside: at every ``for``-loop
  iteration (the parse tree's loop iterables are wrapped), every call, attribute and item
  lookup, every intercepted operator, every block/macro body join and every output chunk.
  Between two checks only one native operation runs, and the size checks keep each of those
  small, so a render stops within milliseconds of the deadline.
* size: at most :data:`MAX_RENDER_CHARS` characters plus :data:`RENDER_INPUT_FACTOR` times the
  characters of the request's own strings, for the output and for any intermediate string or
  sequence (results of calls, filters, operators, ``~`` joins, namespace stores, macro
  arguments). Operations whose result size is known in advance (``'x' * n``, ``n ** m``,
  ``'%*d'``-style widths, ``center``/``ljust``/``zfill``/``to_bytes`` widths, ``replace``,
  ``join``, ``indent``, ``wordwrap``, ``batch``, ``sum`` of lists, ``lipsum``) are refused
  *before* they allocate. ``*`` and ``**`` are intercepted operators
  (``SandboxedEnvironment.intercepted_binops``), which also stops Jinja from constant-folding
  ``{{ 'x' * 10**9 }}`` at compile time.
* recursion: macro recursion ends in Python's ``RecursionError`` (about a thousand frames,
  milliseconds), reported as a ``ChatTemplateError`` with reason ``"recursion"``.

One deliberate difference from transformers: reading an unsafe attribute
(``self._TemplateReference__context``, ``cycler.__init__``) raises ``SecurityError`` at once
instead of yielding an undefined value that only fails when used; no working template reads
Python internals, and an escape attempt should not render silently.

Where each part lives: the sandbox environment in :mod:`.template_sandbox`, the per-render
limits in :mod:`.render_bounds`, the size pre-checks of calls and filters in
:mod:`.size_prechecks`, message checks in :mod:`.chat_messages`; this module renders and
says whose fault a failure is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError, TemplateSyntaxError

from inflight.tokenizer.chat_messages import plain_json, validate_messages
from inflight.tokenizer.render_bounds import (MAX_RENDER_CHARS, BoundExceeded, RenderLimits,
                                              active_limits, input_chars)
from inflight.tokenizer.template_sandbox import TemplateRejected, compile_template

__all__ = [
    "ChatTemplateError", "ConversationRejectedError", "UnsafeChatTemplateError",
    "check_chat_template", "render_chat_template",
    "MAX_RENDER_CHARS", "RENDER_INPUT_FACTOR", "RENDER_TIMEOUT_S", "UNSAFE_REASONS",
]

logger = logging.getLogger(__name__)

# The bundled SmolLM2 template renders a four-turn conversation in well under a millisecond;
# even 10k-message conversations take tens of milliseconds. 2 s is far above any honest render
# and short enough that a hostile template cannot hold a worker thread for long.
RENDER_TIMEOUT_S = 2.0
# The size bound grows by this many characters per character of the request's own strings
# (render_bounds.MAX_RENDER_CHARS says why).
RENDER_INPUT_FACTOR = 4

# ChatTemplateError.reason values for which check_chat_template refuses to start.
UNSAFE_REASONS = frozenset({"unsafe", "timeout", "too_large", "recursion"})

_CLIENT_TEXT = {
    "unsafe": "it tried to access an unsafe attribute or operation",
    "timeout": "rendering took longer than the time limit",
    "too_large": "its output or an intermediate value exceeded the size limit",
    "recursion": "it recursed too deeply",
    "invalid": "it does not compile",
}
_MAX_REJECTION_CHARS = 2000


class ConversationRejectedError(ValueError):
    """The chat template rejected the conversation with ``raise_exception(message)``: the
    client's fault (HTTP 400). ``str()`` is the template's message, at most 2000 characters."""


class ChatTemplateError(Exception):
    """The model's chat template failed: the server's fault (HTTP 500), not the client's.

    Attributes:
        reason: ``"unsafe"`` (sandbox ``SecurityError``), ``"timeout"`` (past
            :data:`RENDER_TIMEOUT_S`), ``"too_large"`` (past the size bound, or
            ``MemoryError``), ``"recursion"`` (``RecursionError``), ``"invalid"`` (does not
            compile) or ``"error"`` (any other exception raised by template code).
        detail: the underlying message (sandbox, Jinja or Python wording), for logs only.

    ``str()`` is a fixed sentence naming the reason, safe to send to clients.
    """

    def __init__(self, reason: str, detail: str, exc_type: str | None = None) -> None:
        why = _CLIENT_TEXT.get(reason) or f"it raised {exc_type or 'an error'} while rendering"
        super().__init__(f"the model's chat template failed: {why}")
        self.reason = reason
        self.detail = detail


class UnsafeChatTemplateError(ValueError):
    """Start-up refusal from :func:`check_chat_template`: the model's template failed a probe
    render for a safety or resource reason. A ``ValueError`` so that the CLI reports it as a
    start-up error (``inflight: error: ...``). ``__cause__`` is the :class:`ChatTemplateError`."""


def _template_error(exc: BaseException) -> ChatTemplateError:
    """The :class:`ChatTemplateError` for an exception raised while compiling or rendering."""
    if isinstance(exc, BoundExceeded):
        return ChatTemplateError(exc.reason, str(exc))
    if isinstance(exc, SecurityError):
        return ChatTemplateError("unsafe", str(exc))
    if isinstance(exc, RecursionError):
        return ChatTemplateError("recursion", str(exc))
    if isinstance(exc, MemoryError):
        return ChatTemplateError("too_large", "MemoryError")
    return ChatTemplateError("error", f"{type(exc).__name__}: {exc}", type(exc).__name__)


def render_chat_template(template: str | None, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool, bos_token: str, eos_token: str,
                         **kwargs: Any) -> str:
    """Render ``messages`` with a Jinja chat ``template`` into the prompt string.

    Extra ``kwargs`` (``tools``, ``documents``, ``unk_token``, template flags such as
    ``enable_thinking``) are passed to the template like transformers'
    ``apply_chat_template(..., tokenize=False)``; ``tools`` and ``documents`` default to ``None``.
    The render is bounded by :data:`RENDER_TIMEOUT_S` seconds and
    ``MAX_RENDER_CHARS + RENDER_INPUT_FACTOR * (characters of messages and kwargs)`` characters.

    Raises:
        ValueError: the model has no template, or ``messages`` is malformed
            (:func:`~inflight.tokenizer.chat_messages.validate_messages`). The client's fault.
        ConversationRejectedError: the template called ``raise_exception(...)``. The client's
            fault; a ``ValueError`` too.
        ChatTemplateError: the template does not compile, tried to leave the sandbox, exceeded
            a bound, or raised anything else. The model's fault; not a ``ValueError``.
    """
    if not template:
        raise ValueError("this model has no chat template; send a plain completion prompt instead")
    chat = validate_messages(messages)
    compiled = _compile_or_raise(template)
    context = {"tools": None, "documents": None, **plain_json(kwargs)}
    limits = RenderLimits(time.monotonic() + RENDER_TIMEOUT_S,
                          MAX_RENDER_CHARS + RENDER_INPUT_FACTOR * input_chars([chat, context]),
                          RENDER_TIMEOUT_S)
    token = active_limits.set(limits)
    stream: Iterator[str] = compiled.generate(
        messages=chat, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
        eos_token=eos_token, **context)
    try:
        return _join_bounded(stream, limits)
    except TemplateRejected as exc:
        text = str(exc)
        if len(text) > _MAX_REJECTION_CHARS:
            text = text[:_MAX_REJECTION_CHARS] + "..."
        raise ConversationRejectedError(text) from None
    except Exception as exc:
        err = _template_error(exc)
        logger.warning("chat template failed (%s): %s", err.reason, err.detail)
        raise err from exc
    finally:
        stream.close()  # type: ignore[attr-defined]  # a generator: Template.generate yields
        active_limits.reset(token)


def _compile_or_raise(template: str) -> jinja2.Template:
    """The compiled template; :class:`ChatTemplateError` (reason ``invalid``, or the bound or
    sandbox reason) where it does not compile."""
    try:
        return compile_template(template)
    except TemplateSyntaxError as exc:
        err = ChatTemplateError("invalid", f"line {exc.lineno}: {exc.message}")
        logger.warning("chat template does not compile: %s", err.detail)
        raise err from exc
    except Exception as exc:  # RecursionError on deep nesting, SecurityError while folding...
        err = _template_error(exc)
        err.reason = "invalid" if err.reason == "error" else err.reason
        logger.warning("chat template does not compile: %s", err.detail)
        raise err from exc


def _join_bounded(stream: Iterator[str], limits: RenderLimits) -> str:
    """The rendered chunks joined, each checked against the bounds as it comes (the same
    chunks ``Template.render`` joins)."""
    parts, total = [], 0
    for chunk in stream:
        total += len(chunk)
        limits.expect(total, "the rendered prompt")
        limits.tick()
        parts.append(chunk)
    return "".join(parts)


# ------------------------------------------------------------------ start-up check
_PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "Thanks. And 3 + 3?"},
]


def check_chat_template(tokenizer: Any, source: Any = None) -> None:
    """Render ``tokenizer``'s chat template once on a probe conversation (system, user,
    assistant, user; with and without ``add_generation_prompt``) and refuse an unsafe one.

    ``tokenizer`` needs ``chat_template`` and ``apply_chat_template`` (:class:`Tokenizer`);
    ``source`` (the model file) names it in messages. No template: nothing to check. A template
    that rejects the probe with ``raise_exception`` (no system role, say) is probed again
    without the system message, and if it still refuses only a warning is logged. A template that
    fails for another reason (does not compile, a ``TypeError``...) is logged as an error and
    not refused: completions do not need it, and chat requests get a 500 naming the template.

    Raises:
        UnsafeChatTemplateError: the probe failed with a :class:`ChatTemplateError` whose
            ``reason`` is in :data:`UNSAFE_REASONS` (sandbox escape, time, size, recursion).
    """
    if not getattr(tokenizer, "chat_template", None):
        logger.info("%s has no chat template; chat requests will be refused", source or "model")
        return
    where = f"{source}: " if source is not None else ""
    for generation_prompt in (True, False):
        try:
            try:
                tokenizer.apply_chat_template(_PROBE, add_generation_prompt=generation_prompt)
            except ConversationRejectedError as first:
                logger.info("%schat template rejects a system message (%s); probing without",
                            where, first)
                tokenizer.apply_chat_template(_PROBE[1:], add_generation_prompt=generation_prompt)
        except ConversationRejectedError as exc:
            logger.warning("%schat template rejects the start-up probe conversation: %s",
                           where, exc)
            return
        except ChatTemplateError as exc:
            if exc.reason in UNSAFE_REASONS:
                raise UnsafeChatTemplateError(
                    f"{where}refusing to serve: the model's chat template "
                    f"(tokenizer.chat_template) is unsafe: {_CLIENT_TEXT[exc.reason]} "
                    f"({exc.detail}) while rendering a plain four-message conversation. "
                    f"Use a model file with a trustworthy template (a --chat-template override "
                    f"is not available yet).") from exc
            logger.error("%sthe model's chat template fails on a plain conversation (%s); "
                         "chat requests will fail with a server error", where, exc.detail)
            return
