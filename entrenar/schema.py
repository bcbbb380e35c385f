"""Config classes declared once: typed fields, checked when built in code or from YAML.

A config is a frozen dataclass deriving from `Config` whose fields are declared with
`option`: the type hint says what a value may be (``int``, ``float``, ``bool``, ``str``,
a ``Literal`` of choices, ``tuple[str, ...]``, ``dict[str, Any]``, a nested config, or
any of these ``| None``); the metadata says the range, the other spellings users type
(the book's, Hugging Face's), whether it is a file, and one line of documentation.
Building one checks every field (``TrainConfig(batch_size=0)`` is a `ConfigError`);
`parse` builds one from a YAML mapping, and every unknown key, wrong type and
out-of-range value is a `ConfigError` that names the key path (``optimizer.lr: must be
> 0, got -1``) and, for a likely typo, the closest valid key. The library's configs
(`entrenar.train.TrainConfig`, `entrenar.lora.LoRAConfig`, `entrenar.optim`'s
`OptimizerConfig` and `ScheduleConfig`) are the sections of a run's YAML file as they
are; specs/config.md is generated from their declarations (`describe_fields`).

A choice among builders (optimizer, schedule, data file type) is a `Registry` of
``name -> builder``: adding one is one registration beside its component.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import html
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Literal, TypeVar, Union

from entrenar.errors import ConfigError, UnsupportedError

T = TypeVar("T")
C = TypeVar("C", bound="Config")
MISSING: Any = dataclasses.MISSING


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
    yaml: bool = True,
    yaml_default: Any = MISSING,
    group: str | None = None,
) -> Any:
    """A dataclass field of a config.

    Args:
        default: the value when the key is absent (none: the key is required).
        doc: one line for specs/config.md and ``entrenar validate --detailed``.
        gt: the value must be ``> gt`` (``ge``, ``lt``, ``le`` likewise).
        ge: lower bound, inclusive.
        lt: upper bound, exclusive.
        le: upper bound, inclusive.
        aliases: other spellings of the key that users type (the book's
            ``save_interval``, Hugging Face's ``target_modules``).
        path: ``"input"`` (a file or folder that must exist, relative to the config
            file's folder) or ``"output"`` (relative to the working directory).
        normalize: ``fn(raw) -> raw`` applied before the checks (accepted spellings).
        factory: default factory for mutable defaults.
        yaml: False: not a key of the YAML section (a run sets it from another
            section, e.g. `TrainConfig.batch_size` from ``data.batch_size``).
        yaml_default: the default in a YAML file when it differs from the library's
            (within ``group`` when the group is given).
        group: the YAML key of a nested mapping that holds this key
            (``training.early_stopping.patience`` is `TrainConfig.patience`).
    """
    meta: dict[str, Any] = {"doc": doc, "gt": gt, "ge": ge, "lt": lt, "le": le}
    meta |= {"aliases": aliases, "path": path, "normalize": normalize, "yaml": yaml}
    meta |= {"yaml_default": yaml_default, "group": group}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Config:
    """The base of config classes: every field is checked when one is built.

    Subclasses are frozen dataclasses declared with `option` fields; a ``check(path)``
    method holds the rules that tie fields together.
    """

    def __post_init__(self) -> None:
        validate(self, type(self).__name__)

    @classmethod
    def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
        """Build from a mapping of field names; an unknown key is a `ConfigError`."""
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for key in d:
            if key not in names:
                raise unknown_key(key, cls.__name__, names)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON data)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def _repr_html_(self) -> str:
        """Jupyter's view: the fields, those changed from their default in bold."""
        return f"<b>{type(self).__name__}</b>{_html(self)}"


def default_of(f: dataclasses.Field[Any], *, yaml: bool = False) -> Any:
    """A field's default (``yaml``: its YAML default), or `MISSING` when required."""
    if yaml and f.metadata.get("yaml_default", MISSING) is not MISSING:
        return f.metadata["yaml_default"]
    factory: Any = f.default_factory
    return f.default if factory is MISSING else factory()


def _html(obj: Any) -> str:
    """A config as an HTML table: changed fields bold, absent sections left out."""
    rows = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.default is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            text = _html(value)
        else:
            text = html.escape(repr(value))
            text = f"<b>{text}</b>" if value != default_of(f) else text
        rows.append(
            f"<tr><th style='text-align:left;vertical-align:top'>{f.name}</th>"
            f"<td style='text-align:left'>{text}</td></tr>"
        )
    return f"<table>{''.join(rows)}</table>"


class Registry(Generic[T]):
    """Choices by name: ``name -> builder``, one `register` call per entry.

    >>> shapes: Registry[int] = Registry("shape")
    >>> shapes.register("square")(4), shapes["square"], shapes.names()
    (4, 4, ('square',))
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that adds its argument as ``name`` (each name once)."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnsupportedError(
                f"unknown {self.kind} {name!r}; entrenar knows {sorted(self._entries)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)


hints: Callable[[Any], dict[str, Any]] = functools.cache(typing.get_type_hints)
"""The resolved type hints of a config class (cached)."""


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
        try:
            value = meta["normalize"](value)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path}: must be set (expected {type_name(hint)})")
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):  # type: ignore[arg-type]
            return value  # checked when it was built
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
    if not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value}")
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


def yaml_key(f: dataclasses.Field[Any]) -> str:
    """The key of a field in YAML: its name, under its group if it has one."""
    group = f.metadata.get("group")
    return f"{group}.{f.name}" if group else f.name


def yaml_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    """The fields of a config that are YAML keys."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("yaml", True)]


def key_names(cls: Any) -> dict[str, str]:
    """Every accepted YAML key of a config, aliases included, -> its field name."""
    names: dict[str, str] = {}
    for f in yaml_fields(cls):
        group = f.metadata.get("group")
        for key in (f.name, *f.metadata.get("aliases", ())):
            names[f"{group}.{key}" if group else key] = f.name
    return names


def groups(cls: Any) -> set[str]:
    """The YAML keys of a config's nested mappings (`option`'s ``group``)."""
    return {g for f in yaml_fields(cls) if (g := f.metadata.get("group"))}


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
    where = _join(path, key)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    keys = ", ".join(sorted(listed if listed is not None else valid))
    return ConfigError(f"{where}: unknown key{hint} (valid keys: {keys})")


def validate(obj: Any, path: str) -> None:
    """Check every field of config ``obj`` (normalizing it), then ``obj.check(path)``.

    Raises:
        ConfigError: a wrong type or a value out of range, named ``path.field``.
    """
    for f in dataclasses.fields(obj):
        value = convert(hints(type(obj))[f.name], getattr(obj, f.name),
                        _join(path, f.name), f.metadata)  # fmt: skip
        object.__setattr__(obj, f.name, value)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)


def parse(cls: type[T], raw: Any, path: str = "") -> T:
    """Build config ``cls`` from a YAML mapping, checking every key and value.

    Keys absent from the mapping take their YAML default (`option`'s
    ``yaml_default``, else the field's default).

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
    names, nested = key_names(cls), groups(cls)
    flat: dict[Any, Any] = {}
    for key, value in raw.items():
        if key in nested and (value is None or isinstance(value, Mapping)):
            flat |= {f"{key}.{k}": v for k, v in (value or {}).items()}
        else:
            flat[key] = value
    given: dict[str, tuple[str, Any]] = {}
    for key, value in flat.items():
        if key not in names:
            listed = [yaml_key(f) for f in yaml_fields(cls)]
            raise unknown_key(key, path, list(names), listed)
        field = names[key]
        if field in given:
            raise ConfigError(
                f"{_join(path, key)}: given twice (also as {given[field][0]!r})"
            )
        given[field] = (key, value)
    obj = object.__new__(cls)  # built field by field: `validate` names the key path
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        group = f.metadata.get("group")
        default = default_of(f, yaml=group is None or raw.get(group) is not None)
        if f.name in given:
            value = given[f.name][1]
        elif default is MISSING:
            sub = _join(path, yaml_key(f))
            raise ConfigError(f"{sub}: required key is missing ({f.metadata['doc']})")
        else:  # an absent section takes its YAML defaults
            value = {} if isinstance(default, Config) else default
        object.__setattr__(obj, f.name, value)
    validate(obj, path)
    return obj


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def describe_fields(cls: type) -> list[dict[str, Any]]:
    """One dict per YAML key of a config: key, type, default, range, aliases, doc."""
    rows = []
    for f in yaml_fields(cls):
        rows.append({
            "name": yaml_key(f),
            "type": type_name(hints(cls)[f.name]),
            "default": default_of(f, yaml=True),
            "range": range_text(f.metadata),
            "aliases": tuple(f.metadata.get("aliases", ())),
            "doc": f.metadata["doc"],
        })  # fmt: skip
    return rows


__all__ = [
    "MISSING",
    "Config",
    "Registry",
    "convert",
    "default_of",
    "describe_fields",
    "groups",
    "hints",
    "key_names",
    "option",
    "parse",
    "range_text",
    "type_name",
    "unknown_key",
    "validate",
    "yaml_fields",
    "yaml_key",
]
