"""The time and size bounds of one chat-template render (:mod:`inflight.tokenizer.chat`).

A render's :class:`RenderLimits` live in a context variable: templates are compiled once and
shared between threads, so the guards compiled into them (:mod:`.template_sandbox`,
:mod:`.size_prechecks`) look the current render's limits up with :func:`current_limits`.
A guard that finds a bound crossed raises :class:`BoundExceeded`, which the renderer turns
into a ``ChatTemplateError`` with the exception's ``reason``.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["MAX_INT_BITS", "MAX_JSON_INDENT", "MAX_RENDER_CHARS", "BoundExceeded",
           "RenderLimits", "active_limits", "current_limits", "input_chars"]

# 4 Mi characters is about a million tokens: over a hundred times the bundled model's 8k
# context, so no prompt the engine could accept is refused, while a runaway render stops at a
# few MiB of memory. A template's honest output is its own text plus the request's strings
# (contents, tools) rendered once or twice, hence the allowance proportional to the input
# (chat.RENDER_INPUT_FACTOR), so that a huge request is refused later as too long for the
# context (the client's fault, 400) rather than here (the template's fault, 500).
MAX_RENDER_CHARS = 4 * 2**20
# Largest integer a template may build with * or ** (bits); str() of a bigger int would fail
# anyway (Python's 4300-digit limit), and squaring loops would otherwise grow without bound.
MAX_INT_BITS = 65536
# Largest tojson indent (spaces, or characters of an indent string); real templates use 2 or 4.
MAX_JSON_INDENT = 64

_T = TypeVar("_T")


class BoundExceeded(Exception):
    """A render crossed its deadline (``reason == "timeout"``) or size bound
    (``"too_large"``). Deliberately not a TypeError, LookupError or AttributeError, which
    Jinja's sandbox catches while resolving names."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class RenderLimits:
    """One render's deadline (``time.monotonic()`` seconds) and size bound (characters or
    elements); ``timeout_s`` is the time limit the deadline was set from, for messages."""

    __slots__ = ("deadline", "max_chars", "timeout_s")

    def __init__(self, deadline: float, max_chars: int, timeout_s: float = float("inf")) -> None:
        self.deadline = deadline
        self.max_chars = max_chars
        self.timeout_s = timeout_s

    def tick(self) -> None:
        """Raises :class:`BoundExceeded` past the deadline."""
        if time.monotonic() > self.deadline:
            raise BoundExceeded("timeout", f"chat template render exceeded {self.timeout_s} s")

    def expect(self, size: int, what: str) -> None:
        """Raises :class:`BoundExceeded` when ``size`` (of ``what``) is over the bound."""
        if size > self.max_chars:
            raise BoundExceeded("too_large", f"{what} would be {size} characters/elements, "
                                             f"over the limit of {self.max_chars}")

    def size(self, value: _T, what: str = "a value") -> _T:
        """``value``, once its length (strings, bytes, lists, tuples, dicts) is checked."""
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.expect(len(value), what)
        return value

    def small_int(self, value: object, what: str) -> None:
        """Check an int used as a width, length or count against the bound."""
        if type(value) is int and value > self.max_chars:
            self.expect(value, what)


# The current render's limits (asyncio.to_thread copies the context; each render sets its own).
active_limits: contextvars.ContextVar[RenderLimits | None] = contextvars.ContextVar(
    "chat_limits", default=None)


def current_limits() -> RenderLimits:
    """The running render's limits; outside a render (Jinja folding constants while it
    compiles) no deadline and the base size bound."""
    lim = active_limits.get()
    return lim if lim is not None else RenderLimits(float("inf"), MAX_RENDER_CHARS)


def input_chars(value: Any) -> int:
    """Characters in the request's strings (values and keys) inside ``value``."""
    # Iteratively: the nesting depth is the client's to choose.
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total
