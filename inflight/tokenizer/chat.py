"""Chat-template rendering in a bounded Jinja sandbox, matching Hugging Face transformers.

Chat templates ship with model files and are untrusted code, so they run in
``jinja2.sandbox.ImmutableSandboxedEnvironment``. The environment mirrors
``transformers.utils.chat_template_utils._cached_compile_jinja_template`` (trim_blocks,
lstrip_blocks, loop controls, ``{% generation %}``, ``tojson``, ``raise_exception``,
``strftime_now``, a namespace that refuses underscore names) so prompts render byte-identically.

The sandbox stops a template from reaching Python internals, but not from spending time or
memory, so every render is also bounded (see "Bounds" below).

Whose fault a failure is (the server maps the first two to HTTP 400, the third to 500):

* ``ValueError`` -- the request's: ``messages`` is malformed (:func:`validate_messages`) or the
  model has no chat template at all.
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
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = [
    "ChatTemplateError", "ConversationRejectedError", "UnsafeChatTemplateError",
    "check_chat_template", "render_chat_template", "validate_messages",
    "MAX_RENDER_CHARS", "RENDER_INPUT_FACTOR", "RENDER_TIMEOUT_S", "UNSAFE_REASONS",
]

logger = logging.getLogger(__name__)

# The bundled SmolLM2 template renders a four-turn conversation in well under a millisecond;
# even 10k-message conversations take tens of milliseconds. 2 s is far above any honest render
# and short enough that a hostile template cannot hold a worker thread for long.
RENDER_TIMEOUT_S = 2.0
# 4 Mi characters is about a million tokens: over a hundred times the bundled model's 8k
# context, so no prompt the engine could accept is refused, while a runaway render stops at a
# few MiB of memory. A template's honest output is its own text plus the request's strings
# (contents, tools) rendered once or twice, hence the allowance proportional to the input, so
# that a huge request is refused later as too long for the context (the client's fault, 400)
# rather than here (the template's fault, 500).
MAX_RENDER_CHARS = 4 * 2**20
RENDER_INPUT_FACTOR = 4
# Largest integer a template may build with * or ** (bits); str() of a bigger int would fail
# anyway (Python's 4300-digit limit), and squaring loops would otherwise grow without bound.
MAX_INT_BITS = 65536
# Largest tojson indent (spaces, or characters of an indent string); real templates use 2 or 4.
MAX_JSON_INDENT = 64

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


class _BoundExceeded(Exception):
    # Raised from inside the render by the guards below; deliberately not a TypeError,
    # LookupError or AttributeError, which Jinja's sandbox catches while resolving names.
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _Rejected(Exception):
    # raise_exception(...) from the template. Not a TemplateError (transformers raises one) so
    # that nothing between the template and render_chat_template can mistake it.
    pass


# ---------------------------------------------------------------------------------- bounds
class _Limits:
    """One render's deadline (``time.monotonic()`` seconds) and size bound (characters or
    elements)."""

    __slots__ = ("deadline", "max_chars")

    def __init__(self, deadline: float, max_chars: int) -> None:
        self.deadline = deadline
        self.max_chars = max_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _BoundExceeded("timeout", f"chat template render exceeded {RENDER_TIMEOUT_S} s")

    def expect(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _BoundExceeded("too_large", f"{what} would be {size} characters/elements, "
                                              f"over the limit of {self.max_chars}")

    def size(self, value: Any, what: str = "a value") -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.expect(len(value), what)
        return value

    def small_int(self, value: Any, what: str) -> None:
        if type(value) is int and value > self.max_chars:
            self.expect(value, what)


# Templates are compiled once and shared between threads, so the current render's limits live in
# a context variable (asyncio.to_thread copies the context; each render sets its own).
_LIMITS: contextvars.ContextVar[_Limits | None] = contextvars.ContextVar("chat_limits",
                                                                          default=None)


def _limits() -> _Limits:
    lim = _LIMITS.get()
    return lim if lim is not None else _Limits(float("inf"), MAX_RENDER_CHARS)


def _input_chars(value: Any) -> int:
    # Characters in the request's strings (values and keys), iteratively: nesting is client-set.
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


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_width_digits(lim: _Limits, digits: str, what: str) -> None:
    # Compare lengths first: int() of a 5000-digit string raises (Python's int/str limit).
    if len(digits) > 12 or int(digits) > lim.max_chars:
        lim.expect(lim.max_chars + 1, what)


def _check_printf(lim: _Limits, fmt: Any, args: Any) -> None:
    """Refuse ``fmt % args`` whose field widths or precisions exceed the size bound."""
    if not isinstance(fmt, str):
        return
    star = False
    for m in _PRINTF_SPEC.finditer(fmt):
        for group in m.groups():
            if group == "*":
                star = True
            elif group:
                _check_width_digits(lim, group, "a %-format width")
    if star:
        for v in (args if isinstance(args, tuple) else (args,)):
            lim.small_int(v, "a %-format width")


def _check_str_format(lim: _Limits, fmt: str, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Refuse ``fmt.format(...)`` whose format specs ask for widths over the size bound."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # the call itself will raise the format error
    nested = False
    for _, _, spec, _ in fields:
        if spec:
            nested |= "{" in spec
            for digits in re.findall(r"\d+", spec):
                _check_width_digits(lim, digits, "a format width")
    if nested:  # '{:>{w}}': the width comes from the arguments
        values = list(args) + list(kwargs.values())
        if values and isinstance(values[0], Mapping):  # format_map
            values += list(values[0].values())
        for v in values:
            lim.small_int(v, "a format width")


def _check_replace(lim: _Limits, s: Any, old: Any, new: Any, count: Any = None) -> None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return
    if len(new) <= len(old):
        return
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    lim.expect(len(s) + n * (len(new) - len(old)), "a replace() result")


def _check_join(lim: _Limits, sep: Any, items: Any) -> list | None:
    """Refuse a join whose result would exceed the bound; returns ``items`` as a list when it
    had to be materialized (a generator can be consumed once only), else ``None``."""
    if not isinstance(sep, str):
        return None
    materialized = None
    if not isinstance(items, Sized):
        materialized = items = list(items)
    lim.size(items, "a join() input")
    strs = sum(len(x) for x in items if isinstance(x, str)) if isinstance(items, (list, tuple)) \
        else 0
    lim.expect(strs + len(sep) * max(len(items) - 1, 0), "a join() result")
    return materialized


def _precheck_method(lim: _Limits, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Pre-checks for methods of ``str``/``bytes``/``int`` called from a template; returns the
    (possibly materialized) positional arguments."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format (wrap_str_format)
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, (str, bytes, int)):
        return args
    name = getattr(target, "__name__", "")
    if name in ("format", "format_map"):
        if isinstance(owner, str):
            _check_str_format(lim, owner, args, kwargs)
        return args
    # Every other int argument of these methods is a width, length, count or index
    # (center, ljust, rjust, zfill, expandtabs, int.to_bytes...): none exceeds the bound honestly.
    for v in (*args, *kwargs.values()):
        lim.small_int(v, f"an argument of {name}()")
    if name == "replace" and isinstance(owner, str) and len(args) >= 2:
        _check_replace(lim, owner, args[0], args[1], args[2] if len(args) > 2 else None)
    elif name == "join" and isinstance(owner, str) and args:
        items = _check_join(lim, owner, args[0])
        if items is not None:
            args = (items, *args[1:])
    elif name == "translate" and isinstance(owner, str) and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        lim.expect(len(owner) * longest, "a translate() result")
    return args


# -------------------------------------------------------------------- filter pre-checks
def _pre_center(lim: _Limits, a: dict) -> None:
    lim.small_int(a.get("width"), "a center() width")


def _pre_indent(lim: _Limits, a: dict) -> None:
    s, width = a.get("s"), a.get("width", 4)
    if isinstance(s, str):
        w = len(width) if isinstance(width, str) else width if type(width) is int else 0
        lim.expect(len(s) + (s.count("\n") + 1) * max(w, 0), "an indent() result")


def _pre_wordwrap(lim: _Limits, a: dict) -> None:
    s, width, wrap = a.get("s"), a.get("width", 79), a.get("wrapstring")
    if isinstance(s, str) and isinstance(wrap, str) and type(width) is int:
        lim.expect(len(s) + (len(s) // max(width, 1) + 1) * len(wrap), "a wordwrap() result")


def _pre_replace(lim: _Limits, a: dict) -> None:
    _check_replace(lim, a.get("s"), a.get("old"), a.get("new"), a.get("count"))


def _pre_format(lim: _Limits, a: dict) -> None:
    _check_printf(lim, a.get("value"), tuple(a.get("args", ())) or a.get("kwargs", {}))


def _pre_batch(lim: _Limits, a: dict) -> None:
    lim.small_int(a.get("linecount"), "a batch() size")


def _pre_slice(lim: _Limits, a: dict) -> None:
    lim.small_int(a.get("slices"), "a slice() count")


def _pre_join(lim: _Limits, a: dict) -> None:
    _check_join(lim, a.get("d", ""), a.get("value", ()))


def _pre_sum(lim: _Limits, a: dict) -> None:
    # sum(start=[]) of lists or strings: the result is their total length.
    items = a.get("iterable", ())
    if isinstance(items, (list, tuple)):
        lim.expect(sum(len(v) for v in items if isinstance(v, (str, list, tuple))),
                   "a sum() result")


def _pre_urlize(lim: _Limits, a: dict) -> None:
    value = a.get("value")
    extra = sum(len(a.get(k) or "") for k in ("target", "rel"))
    if isinstance(value, str) and extra:
        lim.expect(len(value) + (len(value.split()) + 1) * extra, "an urlize() result")


# Filters whose result size follows from their arguments: checked before they run. The values
# are called with the filter's bound arguments by parameter name (jinja2/filters.py).
_FILTER_PRECHECKS: dict[str, Callable[[_Limits, dict], None]] = {
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap,
    "replace": _pre_replace, "format": _pre_format, "batch": _pre_batch, "slice": _pre_slice,
    "urlize": _pre_urlize, "join": _pre_join, "sum": _pre_sum,
}


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with a deadline check, its pre-check and a size check of its result.

    Filters are called directly by compiled templates (``t_1(value, ...)``), not through
    ``SandboxedEnvironment.call``, so they get no sandbox hook otherwise. ``functools.wraps``
    keeps ``jinja_pass_arg`` (pass_context / pass_eval_context / pass_environment).
    """
    pre = _FILTER_PRECHECKS.get(name)
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    try:
        sig: inspect.Signature | None = inspect.signature(func)
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        lim = _limits()
        lim.tick()
        if name in ("join", "sum") and len(args) > skip and not isinstance(args[skip], Sized):
            # A generator (map, select...): materialize it once so that it can be measured.
            args = (*args[:skip], list(args[skip]), *args[skip + 1:])
        if pre is not None and sig is not None:
            try:
                bound = sig.bind(*args, **kwargs).arguments
            except TypeError:
                bound = None  # the call itself will raise the argument error
            if bound is not None:
                pre(lim, bound)
        return lim.size(func(*args, **kwargs), f"the result of {name}")
    return guarded


# ------------------------------------------------------------------ the environment
class _GuardedIterable:
    """A ``for`` loop's iterable with a deadline check per item; ``len()`` passes through so
    ``loop.length`` behaves as before (``LoopContext`` falls back to listing on ``TypeError``)."""

    __slots__ = ("_iterable",)

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        lim = _limits()
        for item in self._iterable:
            lim.tick()
            yield item

    def __len__(self) -> int:
        return len(self._iterable)


def _guard_node(method: str, node: nodes.Node) -> nodes.Expr:
    call = nodes.Call(nodes.EnvironmentAttribute(method), [node], [], None, None)
    if node.lineno:
        call.set_lineno(node.lineno)
    return call


class _InsertGuards(NodeTransformer):
    # Loops and '~' joins are compiled to plain Python (for ..., str_join(...)) that no sandbox
    # hook sees; wrapping them in calls to the environment adds the checks.
    def visit_For(self, node: nodes.For) -> nodes.Node:
        loop = self.generic_visit(node)
        assert isinstance(loop, nodes.For)
        loop.iter = _guard_node("guard_iter", loop.iter)
        return loop

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        return _guard_node("guard_size", self.generic_visit(node))


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` plus the render bounds (module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _InsertGuards().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def guard_iter(self, iterable: Any) -> _GuardedIterable:
        return _GuardedIterable(iterable)

    def guard_size(self, value: Any) -> Any:
        return _limits().size(value, "a '~' join")

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        # Joins macro, call-block and {% set %}-block bodies (Environment.concat).
        lim = _limits()
        lim.tick()
        parts = list(parts)
        lim.expect(sum(map(len, parts)), "a block or macro body")
        return "".join(parts)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        lim = _limits()
        lim.tick()
        for v in (*args, *kwargs.values()):
            lim.size(v, "a call argument")  # bounds values grown through macro recursion
        args = _precheck_method(lim, __obj, args, kwargs)
        return lim.size(super().call(__context, __obj, *args, **kwargs), "a call result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _limits().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _limits().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an undefined that raises only when used; fail at the attempt instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            f"object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        lim = _limits()
        lim.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    lim.expect(len(seq) * max(n, 0), "a '*' repetition")
            if type(left) is int and type(right) is int \
                    and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _BoundExceeded("too_large", f"a '*' product over {MAX_INT_BITS} bits")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                    and left.bit_length() * right > MAX_INT_BITS:
                raise _BoundExceeded("too_large", f"a '**' power over {MAX_INT_BITS} bits")
        elif operator == "%":
            _check_printf(lim, left, right)
        return lim.size(super().call_binop(context, operator, left, right), "an operator result")


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
    # Stores are also size-checked: {% set ns.s = ns.s ~ ns.s %} in a loop doubles a string.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not store underscore attribute {name!r}")
        lim = _limits()
        lim.tick()
        lim.size(value, "a namespace value")


def _raise_exception(message: Any) -> None:
    raise _Rejected(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would corrupt prompts.
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if width > MAX_JSON_INDENT:
        raise _BoundExceeded("too_large", f"tojson indent {width} over {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    # jinja2.utils.generate_lorem_ipsum loops n * max times in Python with no hook to stop it.
    lim = _limits()
    if isinstance(n, int) and isinstance(max, int):
        lim.expect(n * max * 12, "a lipsum() text")  # words average under 12 characters
    return str(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["lipsum"] = _lipsum
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


def _template_error(exc: BaseException) -> ChatTemplateError:
    """The :class:`ChatTemplateError` for an exception raised while compiling or rendering."""
    if isinstance(exc, _BoundExceeded):
        return ChatTemplateError(exc.reason, str(exc))
    if isinstance(exc, SecurityError):
        return ChatTemplateError("unsafe", str(exc))
    if isinstance(exc, RecursionError):
        return ChatTemplateError("recursion", str(exc))
    if isinstance(exc, MemoryError):
        return ChatTemplateError("too_large", "MemoryError")
    return ChatTemplateError("error", f"{type(exc).__name__}: {exc}", type(exc).__name__)


def render_chat_template(template: str | None, messages: list[dict], *, add_generation_prompt: bool,
                         bos_token: str, eos_token: str, **kwargs: Any) -> str:
    """Render ``messages`` with a Jinja chat ``template`` into the prompt string.

    Extra ``kwargs`` (``tools``, ``documents``, ``unk_token``, template flags such as
    ``enable_thinking``) are passed to the template like transformers'
    ``apply_chat_template(..., tokenize=False)``; ``tools`` and ``documents`` default to ``None``.
    The render is bounded by :data:`RENDER_TIMEOUT_S` seconds and
    ``MAX_RENDER_CHARS + RENDER_INPUT_FACTOR * (characters of messages and kwargs)`` characters.

    Raises:
        ValueError: the model has no template, or ``messages`` is malformed
            (:func:`validate_messages`). The client's fault.
        ConversationRejectedError: the template called ``raise_exception(...)``. The client's
            fault; a ``ValueError`` too.
        ChatTemplateError: the template does not compile, tried to leave the sandbox, exceeded
            a bound, or raised anything else. The model's fault; not a ``ValueError``.
    """
    if not template:
        raise ValueError("this model has no chat template; send a plain completion prompt instead")
    chat = validate_messages(messages)
    try:
        compiled = _compile(template)
    except TemplateSyntaxError as exc:
        err = ChatTemplateError("invalid", f"line {exc.lineno}: {exc.message}")
        logger.warning("chat template does not compile: %s", err.detail)
        raise err from exc
    except Exception as exc:  # RecursionError on deep nesting, SecurityError while folding...
        err = _template_error(exc)
        err.reason = "invalid" if err.reason == "error" else err.reason
        logger.warning("chat template does not compile: %s", err.detail)
        raise err from exc
    context = {"tools": None, "documents": None, **_plain(kwargs)}
    limits = _Limits(time.monotonic() + RENDER_TIMEOUT_S,
                     MAX_RENDER_CHARS + RENDER_INPUT_FACTOR * _input_chars([chat, context]))
    token = _LIMITS.set(limits)
    stream: Any = compiled.generate(messages=chat, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **context)
    try:
        parts, total = [], 0
        for chunk in stream:  # same chunks render() joins; checked as they come
            total += len(chunk)
            limits.expect(total, "the rendered prompt")
            limits.tick()
            parts.append(chunk)
        return "".join(parts)
    except _Rejected as exc:
        text = str(exc)
        if len(text) > _MAX_REJECTION_CHARS:
            text = text[:_MAX_REJECTION_CHARS] + "..."
        raise ConversationRejectedError(text) from None
    except Exception as exc:
        err = _template_error(exc)
        logger.warning("chat template failed (%s): %s", err.reason, err.detail)
        raise err from exc
    finally:
        stream.close()
        _LIMITS.reset(token)


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
