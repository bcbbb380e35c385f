"""The bounded Jinja sandbox chat templates render in.

A chat template comes with a model file, so it is untrusted code. Jinja's
``ImmutableSandboxedEnvironment`` stops it from reaching Python's internals;
`BoundedEnvironment` also stops it from spending unbounded time or memory. While
`render` runs a template:

- every loop iteration, call and filter is a step: at most `MAX_STEPS` steps and
  `MAX_SECONDS` seconds of wall-clock time per render;
- ``range()`` gives at most `MAX_RANGE` numbers;
- the output, and every string or list the template builds (``~``, ``+``, ``*``,
  ``%``, filters such as ``indent``, ``center``, ``join``, ``replace``, ``format``,
  ``tojson(indent=...)`` and string methods such as ``ljust``), is at most
  `MAX_OUTPUT` characters or items, checked before it is built where its size is
  known in advance;
- integers stay below ``10**4300`` (``**`` and ``*`` are checked first);
- ``{% include %}``, ``{% import %}`` and ``{% extends %}`` are refused when the
  template is compiled (there are no other templates to load).

Anything over a limit, and any error the template raises while rendering (``1/0``,
a macro that calls itself without end), is an `entrenar.errors.TemplateError`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from entrenar.errors import TemplateError

MAX_STEPS = 1_000_000
"""Loop iterations, calls and filters one render may run."""

MAX_SECONDS = 5.0
"""Wall-clock seconds one render may take."""

MAX_RANGE = 10_000
"""Most numbers one ``range()`` in a template may give."""

MAX_OUTPUT = 1 << 23
"""Most characters (or items) of a template's output and of any value it builds."""

MAX_TEMPLATE_CHARS = 1 << 20
"""Longest template text accepted (1 Mi characters)."""

_INT_BITS = 14_300  # about 4,300 decimal digits, Python's int/str conversion limit
_BIG_FIELD = re.compile(r"\d{7,}")  # a width or precision of 1,000,000 or more
_FIELD_NUMBER = re.compile(r"\d+")  # a width or precision (or any number) in a format
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # a field inside a format spec: {:{}}
_FORBIDDEN = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)


class _Budget:
    """What one render may still spend."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def spend(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateError(
                f"the template ran more than {MAX_STEPS:,} loop iterations, calls and "
                "filters; a chat template should be a few loops over the messages"
            )
        if time.monotonic() > self.deadline:
            raise TemplateError(f"the template ran for more than {MAX_SECONDS} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "entrenar_template_budget", default=None
)


def _spend() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend()


def _refuse_size(n: int, what: str) -> None:
    if n > MAX_OUTPUT:
        raise TemplateError(
            f"{what} would make {n:,} characters or items, over the limit of "
            f"{MAX_OUTPUT:,}"
        )


def _sized(value: Any, what: str) -> Any:
    """``value``, refused when it is a string or collection over `MAX_OUTPUT`."""
    if isinstance(value, (str, list, tuple, dict)):
        _refuse_size(len(value), what)
    elif isinstance(value, int) and value.bit_length() > _INT_BITS:
        raise TemplateError(f"{what} made an integer over 10**4300")
    return value


def _text_len(x: Any) -> int:
    return len(x) if isinstance(x, str) else len(str(x))


def _joined_len(items: list[Any], sep: str) -> int:
    """Length of ``sep.join(map(str, items))``, stopping once over the limit."""
    total = len(sep) * max(len(items) - 1, 0)
    for x in items:
        total += _text_len(x)
        if total > MAX_OUTPUT:
            break
    return total


def _check_format(fmt: Any, args: Iterable[Any], what: str) -> None:
    """A ``%``/``format`` string without huge widths, whose result fits.

    The result is at most the format's length, plus its arguments' texts, plus
    every width and precision: each number written in the format (``%999999s``,
    ``{:999999}``, ``%.999999f``), and each integer argument when a width may come
    from the arguments (``%*s``, ``{:{}}``). Widths under the `_BIG_FIELD` bound
    add up: a thousand ``%999999s`` built a gigabyte before the result was checked.
    """
    if not isinstance(fmt, str):
        return
    if _BIG_FIELD.search(fmt):
        raise TemplateError(f"{what}: a width or precision of 1,000,000 or more")
    args = list(args)
    total = len(fmt) + sum(_text_len(a) for a in args)
    total += sum(int(digits) for digits in _FIELD_NUMBER.findall(fmt))
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        total += sum(min(abs(a), 1 << 62) for a in args if _is_int(a))
    _refuse_size(total, what)


def _check_replace(s: Any, old: Any, new: Any, what: str) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if old == "" else s.count(old)
        _refuse_size(len(s) + count * max(len(new) - len(old), 0), what)


def _check_width(width: Any, what: str) -> None:
    if _is_int(width):
        _refuse_size(width, what)


def _check_count(n: Any, what: str) -> None:
    if _is_int(n) and n > MAX_RANGE:
        raise TemplateError(f"{what}({n:,}): at most {MAX_RANGE:,}")


def _check_indent(a: dict[str, Any]) -> None:
    s, width = a["s"], a.get("width", 4)
    if isinstance(s, str):
        pad = width if _is_int(width) else len(str(width))
        _refuse_size(len(s) + (s.count("\n") + 1) * pad, "indent")


def _check_wordwrap(a: dict[str, Any]) -> None:
    s, wrap = a["s"], a.get("wrapstring") or "\n"
    if isinstance(s, str) and isinstance(wrap, str):
        _refuse_size(len(s) * (1 + len(wrap)), "wordwrap")


# Checks run before a filter, on its bound arguments (`inspect.Signature.bind`).
_FILTER_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "center": lambda a: _check_width(a.get("width", 80), "center"),
    "indent": _check_indent,
    "replace": lambda a: _check_replace(a["s"], a["old"], a["new"], "replace"),
    "format": lambda a: _check_format(
        a["value"], [*a.get("args", ()), *a.get("kwargs", {}).values()], "format"
    ),
    "wordwrap": _check_wordwrap,
    "batch": lambda a: _check_count(a["linecount"], "batch"),
    "slice": lambda a: _check_count(a["slices"], "slice"),
}


_PASSED = ("context", "eval_ctx", "environment", "env")


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Filter ``f`` counted as a step, its arguments and result size checked."""
    sig = inspect.signature(f)  # of the function jinja2's wrappers wrap
    # Jinja passes a context first to filters marked so; some wrappers take it
    # and drop it, so the signature above does not show it: skip it when binding.
    first = next(iter(sig.parameters), "")
    skip = int(hasattr(f, "jinja_pass_arg") and first not in _PASSED)
    at = int(hasattr(f, "jinja_pass_arg"))  # where the filtered value is
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(f)  # keeps jinja_pass_arg
    def run(*args: Any, **kwargs: Any) -> Any:
        _spend()
        if name == "join" and len(args) > at:  # the size is known before joining
            args = (*args[:at], list(args[at]), *args[at + 1 :])
            bound = sig.bind(*args[skip:], **kwargs).arguments
            if bound.get("attribute") is None:
                _refuse_size(_joined_len(bound["value"], str(bound.get("d", ""))), name)
        elif check is not None:
            check(sig.bind(*args[skip:], **kwargs).arguments)
        return _sized(f(*args, **kwargs), f"the {name} filter")

    return run


def tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """``json.dumps`` as ``transformers`` does (no HTML escaping), size-bounded.

    The text is built piece by piece and refused once over `MAX_OUTPUT`, so a huge
    ``indent`` cannot exhaust memory.
    """
    if isinstance(indent, int):
        _check_width(indent, "tojson indent")
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )
    pieces, total = [], 0
    for piece in encoder.iterencode(x):
        total += len(piece)
        _refuse_size(total, "tojson")
        pieces.append(piece)
    return "".join(pieces)


def bounded_range(*args: int) -> range:
    """``range(...)`` of at most `MAX_RANGE` numbers."""
    r = range(*args)
    try:
        n = len(r)
    except OverflowError:  # more than sys.maxsize numbers
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise TemplateError(
            f"range{args} has more than {MAX_RANGE:,} numbers, the most a template "
            "may loop over"
        )
    return r


class _Counted:
    """An iterable whose iteration spends a step per item (and keeps its length)."""

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self) -> Iterator[Any]:
        for x in self._iterable:
            _spend()
            yield x


def _bounded_concat(*parts: Any) -> str:
    """The ``~`` operator, refusing a result over `MAX_OUTPUT`."""
    _refuse_size(_joined_len(list(parts), ""), "~")
    return "".join(p if isinstance(p, str) else str(p) for p in parts)


class _Rewrite(NodeTransformer):
    """Routes every loop's iterable and every ``~`` through the budget."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)  # type: ignore[assignment]
        node.iter = nodes.Call(
            nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None
        ).set_lineno(node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)  # type: ignore[assignment]
        return nodes.Call(
            nodes.EnvironmentAttribute("concat_parts"), node.nodes, [], None, None
        ).set_lineno(node.lineno)


def _str_method(obj: Any) -> tuple[str, str] | None:
    """``(the string, method name)`` when ``obj`` is a bound ``str`` method."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    if isinstance(owner, str):
        return owner, getattr(target, "__name__", "")
    return None


def _check_str_call(s: str, name: str, args: tuple[Any, ...], kw: dict) -> None:
    """Refuse a string method call whose result would be over `MAX_OUTPUT`."""
    what = f"str.{name}"
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0], what)
    elif name == "expandtabs":
        size = args[0] if args else kw.get("tabsize", 8)
        if isinstance(size, int):
            _refuse_size(len(s) + s.count("\t") * size, what)
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, args[0], args[1], what)
    elif name == "join" and args:
        items = args[0]
        if isinstance(items, (list, tuple, str)):
            _refuse_size(_joined_len(list(items), s), what)
    elif name in ("format", "format_map"):
        values = [*args, *kw.values()]
        if name == "format_map" and args and isinstance(args[0], dict):
            values = list(args[0].values())
        _check_format(s, values, what)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the limits of the module docstring."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["range"] = bounded_range
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.filters = {k: _bounded_filter(k, f) for k, f in self.filters.items()}
        self.filters["tojson"] = _bounded_filter("tojson", tojson)
        self.counted = _Counted  # used by `_Rewrite`'s nodes
        self.concat_parts = _bounded_concat

    def _parse(
        self, source: str, name: str | None, filename: str | None
    ) -> nodes.Template:
        """Parse, refuse include/import/extends, route loops and ``~`` (`_Rewrite`)."""
        if len(source) > MAX_TEMPLATE_CHARS:
            raise jinja2.TemplateSyntaxError(
                f"the template has {len(source):,} characters, over the limit of "
                f"{MAX_TEMPLATE_CHARS:,}",
                1,
            )
        tree = super()._parse(source, name, filename)
        for node in tree.find_all(_FORBIDDEN):
            tag = type(node).__name__.lower().replace("fromimport", "from ... import")
            raise jinja2.TemplateSyntaxError(
                f"{{% {tag} %}} is not allowed in a chat template (nothing to load)",
                node.lineno,
            )
        return _Rewrite().visit(tree)  # type: ignore[no-any-return]

    def call(
        __self,
        __context: Any,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Call ``__obj`` from the template: one step, string methods size-checked."""
        _spend()
        method = _str_method(__obj)
        if method is not None:
            _check_str_call(method[0], method[1], args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _sized(result, f"calling {getattr(__obj, '__name__', 'a function')}")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """``+``, ``*``, ``**`` and ``%`` with their results' sizes checked first."""
        _spend()
        what = f"the {operator} operator"
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0:
            if right * max(abs(left), 1).bit_length() > _INT_BITS:
                raise TemplateError(f"{what}: {left} ** {right} is over 10**4300")
        elif operator == "*":
            _check_repeat(left, right, what)
        elif operator == "+" and isinstance(left, (str, list, tuple)):
            if isinstance(right, (str, list, tuple)):
                _refuse_size(len(left) + len(right), what)
        elif operator == "%" and isinstance(left, str):
            values = right if isinstance(right, tuple) else (right,)
            if isinstance(right, dict):
                values = tuple(right.values())
            _check_format(left, values, what)
        return _sized(super().call_binop(context, operator, left, right), what)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_repeat(left: Any, right: Any, what: str) -> None:
    """``seq * n`` within `MAX_OUTPUT`, ``int * int`` below ``10**4300``."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and _is_int(n):
            _refuse_size(len(seq) * n, what)
    if _is_int(left) and _is_int(right):
        if left.bit_length() + right.bit_length() > _INT_BITS:
            raise TemplateError(f"{what}: the product is over 10**4300")


def render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render ``template`` within the budget of the module docstring.

    Raises:
        TemplateError: a limit exceeded, or any error the template raised.
    """
    token = _BUDGET.set(_Budget())
    try:
        pieces, total = [], 0
        for piece in template.generate(**variables):
            total += len(piece)
            _refuse_size(total, "the rendered text")
            pieces.append(piece)
        return "".join(pieces)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template: {e}") from None
    except RecursionError:
        raise TemplateError(
            "chat template: recursion too deep (a macro or recursive loop that "
            "calls itself without end?)"
        ) from None
    except Exception as e:  # the template's own failure: 1/0, int("x"), ...
        raise TemplateError(f"chat template: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)


__all__ = [
    "MAX_OUTPUT",
    "MAX_RANGE",
    "MAX_SECONDS",
    "MAX_STEPS",
    "MAX_TEMPLATE_CHARS",
    "BoundedEnvironment",
    "bounded_range",
    "render",
    "tojson",
]
