"""Size pre-checks of a chat template's operations whose result size follows from their
arguments: refused before they allocate (``'%*d'`` widths, ``str.format`` widths,
``replace``, ``join``, ``center``/``ljust``/``zfill``/``to_bytes`` widths, ``indent``,
``wordwrap``, ``batch``, ``sum`` of lists, ``urlize``), and the guard every filter runs in.
Each check raises :class:`~inflight.tokenizer.render_bounds.BoundExceeded` through the
render's :class:`~inflight.tokenizer.render_bounds.RenderLimits`.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
from collections.abc import Callable, Mapping, Sized
from typing import Any

from inflight.tokenizer.render_bounds import RenderLimits, current_limits

__all__ = ["check_printf", "guard_filter", "precheck_method"]

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_width_digits(lim: RenderLimits, digits: str, what: str) -> None:
    # Compare lengths first: int() of a 5000-digit string raises (Python's int/str limit).
    if len(digits) > 12 or int(digits) > lim.max_chars:
        lim.expect(lim.max_chars + 1, what)


def check_printf(lim: RenderLimits, fmt: Any, args: Any) -> None:
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


def _check_str_format(lim: RenderLimits, fmt: str, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any]) -> None:
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


def _check_replace(lim: RenderLimits, s: Any, old: Any, new: Any, count: Any = None) -> None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return
    if len(new) <= len(old):
        return
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    lim.expect(len(s) + n * (len(new) - len(old)), "a replace() result")


def _check_join(lim: RenderLimits, sep: Any, items: Any) -> list[Any] | None:
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


def precheck_method(lim: RenderLimits, obj: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[Any, ...]:
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
def _pre_center(lim: RenderLimits, a: dict[str, Any]) -> None:
    lim.small_int(a.get("width"), "a center() width")


def _pre_indent(lim: RenderLimits, a: dict[str, Any]) -> None:
    s, width = a.get("s"), a.get("width", 4)
    if isinstance(s, str):
        w = len(width) if isinstance(width, str) else width if type(width) is int else 0
        lim.expect(len(s) + (s.count("\n") + 1) * max(w, 0), "an indent() result")


def _pre_wordwrap(lim: RenderLimits, a: dict[str, Any]) -> None:
    s, width, wrap = a.get("s"), a.get("width", 79), a.get("wrapstring")
    if isinstance(s, str) and isinstance(wrap, str) and type(width) is int:
        lim.expect(len(s) + (len(s) // max(width, 1) + 1) * len(wrap), "a wordwrap() result")


def _pre_replace(lim: RenderLimits, a: dict[str, Any]) -> None:
    _check_replace(lim, a.get("s"), a.get("old"), a.get("new"), a.get("count"))


def _pre_format(lim: RenderLimits, a: dict[str, Any]) -> None:
    check_printf(lim, a.get("value"), tuple(a.get("args", ())) or a.get("kwargs", {}))


def _pre_batch(lim: RenderLimits, a: dict[str, Any]) -> None:
    lim.small_int(a.get("linecount"), "a batch() size")


def _pre_slice(lim: RenderLimits, a: dict[str, Any]) -> None:
    lim.small_int(a.get("slices"), "a slice() count")


def _pre_join(lim: RenderLimits, a: dict[str, Any]) -> None:
    _check_join(lim, a.get("d", ""), a.get("value", ()))


def _pre_sum(lim: RenderLimits, a: dict[str, Any]) -> None:
    # sum(start=[]) of lists or strings: the result is their total length.
    items = a.get("iterable", ())
    if isinstance(items, (list, tuple)):
        lim.expect(sum(len(v) for v in items if isinstance(v, (str, list, tuple))),
                   "a sum() result")


def _pre_urlize(lim: RenderLimits, a: dict[str, Any]) -> None:
    value = a.get("value")
    extra = sum(len(a.get(k) or "") for k in ("target", "rel"))
    if isinstance(value, str) and extra:
        lim.expect(len(value) + (len(value.split()) + 1) * extra, "an urlize() result")


# Filters whose result size follows from their arguments: checked before they run. The values
# are called with the filter's bound arguments by parameter name (jinja2/filters.py).
_FILTER_PRECHECKS: dict[str, Callable[[RenderLimits, dict[str, Any]], None]] = {
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap,
    "replace": _pre_replace, "format": _pre_format, "batch": _pre_batch, "slice": _pre_slice,
    "urlize": _pre_urlize, "join": _pre_join, "sum": _pre_sum,
}


def guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
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
        lim = current_limits()
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


