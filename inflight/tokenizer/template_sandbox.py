"""The Jinja sandbox chat templates render in: ``ImmutableSandboxedEnvironment`` set up as
``transformers.utils.chat_template_utils._cached_compile_jinja_template`` does (trim_blocks,
lstrip_blocks, loop controls, ``{% generation %}``, ``tojson``, ``raise_exception``,
``strftime_now``, a namespace that refuses underscore names), plus the render bounds'
checks (:mod:`.render_bounds`) at every loop iteration, call, attribute and item lookup,
intercepted operator and block or macro body join.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from inflight.tokenizer.render_bounds import (MAX_INT_BITS, MAX_JSON_INDENT, BoundExceeded,
                                              current_limits)
from inflight.tokenizer.size_prechecks import check_printf, guard_filter, precheck_method

__all__ = ["TemplateRejected", "compile_template"]


class TemplateRejected(Exception):
    """``raise_exception(...)`` from the template. Not a ``TemplateError`` (transformers
    raises one) so that nothing between the template and the renderer can mistake it."""


class _GuardedIterable:
    """A ``for`` loop's iterable with a deadline check per item; ``len()`` passes through so
    ``loop.length`` behaves as before (``LoopContext`` falls back to listing on ``TypeError``)."""

    __slots__ = ("_iterable",)

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        lim = current_limits()
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
    """``ImmutableSandboxedEnvironment`` plus the render bounds ("Bounds" in
    :mod:`inflight.tokenizer.chat`)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree: nodes.Template = _InsertGuards().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def guard_iter(self, iterable: Any) -> _GuardedIterable:
        return _GuardedIterable(iterable)

    def guard_size(self, value: Any) -> Any:
        return current_limits().size(value, "a '~' join")

    def concat(self, parts: Iterable[str]) -> str:
        # Joins macro, call-block and {% set %}-block bodies (Environment.concat).
        lim = current_limits()
        lim.tick()
        parts = list(parts)
        lim.expect(sum(map(len, parts)), "a block or macro body")
        return "".join(parts)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        lim = current_limits()
        lim.tick()
        for v in (*args, *kwargs.values()):
            lim.size(v, "a call argument")  # bounds values grown through macro recursion
        args = precheck_method(lim, __obj, args, kwargs)
        return lim.size(super().call(__context, __obj, *args, **kwargs), "a call result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        current_limits().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current_limits().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an undefined that raises only when used; fail at the attempt instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            f"object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        lim = current_limits()
        lim.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    lim.expect(len(seq) * max(n, 0), "a '*' repetition")
            if type(left) is int and type(right) is int \
                    and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise BoundExceeded("too_large", f"a '*' product over {MAX_INT_BITS} bits")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                    and left.bit_length() * right > MAX_INT_BITS:
                raise BoundExceeded("too_large", f"a '**' power over {MAX_INT_BITS} bits")
        elif operator == "%":
            check_printf(lim, left, right)
        return lim.size(super().call_binop(context, operator, left, right), "an operator result")


class _GenerationTag(jinja2.ext.Extension):
    # Training templates mark assistant spans with {% generation %}; only the body matters for
    # inference, but without the tag such templates would not even parse.
    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
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
        lim = current_limits()
        lim.tick()
        lim.size(value, "a namespace value")


def _raise_exception(message: Any) -> None:
    raise TemplateRejected(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would corrupt prompts.
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if width > MAX_JSON_INDENT:
        raise BoundExceeded("too_large", f"tojson indent {width} over {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    # jinja2.utils.generate_lorem_ipsum loops n * max times in Python with no hook to stop it.
    lim = current_limits()
    if isinstance(n, int) and isinstance(max, int):
        lim.expect(n * max * 12, "a lipsum() text")  # words average under 12 characters
    return str(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """``template`` compiled in a fresh sandbox (the 16 most recent are cached).

    Raises:
        jinja2.TemplateSyntaxError: it does not parse; anything else Jinja raises while
            compiling (``RecursionError`` on deep nesting, ``SecurityError`` while folding).
    """
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["lipsum"] = _lipsum
    return env.from_string(template)

