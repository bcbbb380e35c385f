"""Typed config fields and the one parser that turns YAML mappings into dataclasses.

A section of the schema is a frozen dataclass whose fields are declared with `option`:
the type hint says what a value may be (``int``, ``float``, ``bool``, ``str``, a
``Literal`` of choices, ``tuple[str, ...]``, ``dict[str, Any]``, a nested section, or
any of these ``| None``), and the metadata says the range, the accepted aliases (the
book's spellings) and one line of documentation. `parse` checks a mapping against it:
every unknown key, wrong type and out-of-range value is a `ConfigError` that names the
key path (``optimizer.lr: must be > 0, got -1``) and, for a likely typo, the closest
valid key. specs/config.md is generated from the same declarations (`describe`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from entrenar.errors import ConfigError

T = TypeVar("T")
MISSING = dataclasses.MISSING


def option(
    default: Any = MISSING,
    *,
    doc: str,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    aliases: tuple[str, ...] = (),
    path: str | None = None,
    normalize: Any = None,
    factory: Any = MISSING,
) -> Any:
    """A dataclass field of a config section.

    Args:
        default: the value when the key is absent (none: the key is required).
        doc: one line for specs/config.md and ``entrenar validate --detailed``.
        gt: the value must be ``> gt`` (``ge``, ``lt``, ``le`` likewise).
        ge: lower bound, inclusive.
        lt: upper bound, exclusive.
        le: upper bound, inclusive.
        aliases: other accepted spellings of the key (the book's ``save_interval``).
        path: ``"input"`` (a file or folder that must exist, relative to the config
            file's folder) or ``"output"`` (relative to the working directory).
        normalize: ``fn(raw) -> raw`` applied before the checks (accepted spellings).
        factory: default factory for mutable defaults.
    """
    meta: dict[str, Any] = {"doc": doc, "gt": gt, "ge": ge, "lt": lt, "le": le}
    meta |= {"aliases": aliases, "path": path, "normalize": normalize}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def hints(cls: Any) -> dict[str, Any]:
    """The resolved type hints of a section class."""
    return _hints(cls)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
    return False, hint


def type_name(hint: Any) -> str:
    """A short human name of a field type, for messages and the spec."""
    optional, inner = _is_optional(hint)
    origin = typing.get_origin(inner)
    if origin is Literal:
        name = " | ".join(repr(c) if isinstance(c, str) else str(c) for c in
                          typing.get_args(inner))  # fmt: skip
    elif origin is tuple:
        name = f"list of {type_name(typing.get_args(inner)[0])}"
    elif origin is dict or inner is dict:
        name = "mapping"
    elif origin in (Union, types.UnionType):
        name = " or ".join(type_name(a) for a in typing.get_args(inner))
    elif dataclasses.is_dataclass(inner):
        name = "section"
    elif inner is Any:
        name = "any"
    else:
        name = {"int": "integer", "float": "number", "bool": "boolean",
                "str": "string"}.get(inner.__name__, inner.__name__)  # fmt: skip
    return f"{name} or null" if optional else name


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string",
            list: "list", dict: "mapping", type(None): "null"}.get(
        type(value), type(value).__name__)  # fmt: skip


def _fail(path: str, want: str, value: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {want}, got {value!r} ({_kind(value)})")


def convert(hint: Any, value: Any, path: str, meta: Mapping[str, Any]) -> Any:
    """Check ``value`` against the type ``hint`` and the range in ``meta``."""
    optional, hint = _is_optional(hint)
    if meta.get("normalize") is not None and value is not None:
        value = meta["normalize"](value)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path}: must be set (expected {type_name(hint)})")
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        choices = typing.get_args(hint)
        for key in (value, value.lower(), value.upper()) if isinstance(value, str) \
                else (value,):  # fmt: skip
            if key in choices and type(key) is type(choices[choices.index(key)]):
                return key
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], 1)
        hint_ = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{path}: must be one of {list(choices)}, got {value!r}{hint_}"
        )
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise _fail(path, f"a list of {type_name(item)}", value)
        return tuple(convert(item, v, f"{path}[{i}]", {}) for i, v in enumerate(items))
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise _fail(path, "a mapping", value)
        return dict(value)
    if origin in (Union, types.UnionType):
        for alt in typing.get_args(hint):
            try:
                return convert(alt, value, path, meta)
            except ConfigError:
                continue
        raise _fail(path, type_name(hint), value)
    if hint is Any:
        return value
    out = _scalar(hint, value, path)
    _check_range(out, path, meta)
    return out


def _scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(path, "true or false", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise _fail(path, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads ``1e-4`` as a string
            try:
                return float(value)
            except ValueError:
                raise _fail(path, "a number", value) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, "a number", value)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _fail(path, "a string", value)
        if not value:
            raise ConfigError(f"{path}: must not be empty")
        return value
    raise TypeError(f"unsupported config field type {hint!r} at {path}")  # our bug


_BOUNDS = (
    ("gt", ">", lambda v, b: v > b),
    ("ge", ">=", lambda v, b: v >= b),
    ("lt", "<", lambda v, b: v < b),
    ("le", "<=", lambda v, b: v <= b),
)


def _check_range(value: Any, path: str, meta: Mapping[str, Any]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if value != value:  # NaN
        raise ConfigError(f"{path}: must be a number, got nan")
    for key, sym, ok in _BOUNDS:
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"{path}: must be {sym} {bound:g}, got {value:g}")


def range_text(meta: Mapping[str, Any]) -> str:
    """The range of a field as text (``> 0``, ``[0, 1)``), or ``""``."""
    lo = ("(", meta["gt"]) if meta.get("gt") is not None else ("[", meta.get("ge"))
    hi = (")", meta["lt"]) if meta.get("lt") is not None else ("]", meta.get("le"))
    if lo[1] is not None and hi[1] is not None:
        return f"{lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo[1] is not None:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]:g}"
    if hi[1] is not None:
        return f"{'<' if hi[0] == ')' else '<='} {hi[1]:g}"
    return ""


def key_names(cls: type) -> dict[str, str]:
    """Every accepted key of a section, aliases included, -> its field name."""
    names: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        names[f.name] = f.name
        for alias in f.metadata.get("aliases", ()):
            names[alias] = f.name
    return names


def unknown_key(
    key: Any, path: str, valid: list[str], listed: list[str] | None = None
) -> ConfigError:
    """The error for a key a section does not have, with the closest valid key.

    Args:
        key: the unknown key.
        path: the key path of its section.
        valid: every accepted key (aliases included), matched for typos.
        listed: the keys to list in the message (default ``valid``).
    """
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    where = f"{path}.{key}" if path else str(key)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    keys = ", ".join(sorted(listed if listed is not None else valid))
    return ConfigError(f"{where}: unknown key{hint} (valid keys: {keys})")


def parse(cls: type[T], raw: Any, path: str = "") -> T:
    """Build section ``cls`` from a YAML mapping, checking every key and value.

    Args:
        cls: a frozen dataclass declared with `option` fields.
        raw: the mapping read from YAML (None reads as an empty mapping).
        path: the key path of this section, for messages (``""`` at the top).

    Raises:
        ConfigError: unknown key (with the closest valid one), missing required key,
            wrong type or value out of range; the message starts with the key path.
    """
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise _fail(path or "config", "a mapping of keys", raw)
    names = key_names(cls)
    given: dict[str, tuple[str, Any]] = {}
    for key, value in raw.items():
        if key not in names:
            raise unknown_key(key, path, list(names), sorted(set(names.values())))
        field = names[key]
        if field in given:
            raise ConfigError(
                f"{_join(path, key)}: given twice (also as {given[field][0]!r})"
            )
        given[field] = (key, value)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        sub = _join(path, f.name)
        if f.name in given:
            kwargs[f.name] = convert(
                hints(cls)[f.name], given[f.name][1], sub, f.metadata
            )
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{sub}: required key is missing ({f.metadata['doc']})")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)
    return obj


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


__all__ = [
    "convert",
    "describe_fields",
    "key_names",
    "option",
    "parse",
    "range_text",
    "type_name",
    "unknown_key",
]


def describe_fields(cls: type) -> list[dict[str, Any]]:
    """One dict per field of a section: name, type, default, range, aliases, doc."""
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        rows.append({
            "name": f.name,
            "type": type_name(hints(cls)[f.name]),
            "hint": hints(cls)[f.name],
            "default": default,
            "range": range_text(f.metadata),
            "aliases": tuple(f.metadata.get("aliases", ())),
            "path": f.metadata.get("path"),
            "doc": f.metadata["doc"],
        })  # fmt: skip
    return rows
