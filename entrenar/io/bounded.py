"""Bounded readers of YAML and JSON text, for files a user or a stranger wrote.

Run configs, merge recipes, adapter configs and JSON/YAML model files are read here,
so hostile text fails fast with an error naming the file (and the line and column
where there is one) instead of hanging, exhausting memory or raising a bare Python
exception. Every reader:

- checks the file's size before reading it (`MAX_CONFIG_BYTES` unless told more);
- decodes strict UTF-8: an invalid byte is an error naming its line and column;
- YAML (``yaml.SafeLoader`` underneath): refuses nesting deeper than `MAX_DEPTH`,
  counts the nodes that aliases (``*a``) stand for and refuses more than
  `MAX_ALIAS_NODES` in all (a "billion laughs" alias bomb), refuses an alias inside
  the node it names (``x: &a {y: *a}``), refuses integers longer than
  `MAX_INT_DIGITS`, and refuses a mapping that gives a key twice (PyYAML would keep
  the last one silently: a second ``lora:`` section, a repeated ``max_steps``);
- JSON: refuses nesting deeper than `MAX_DEPTH` (in files of any size, nesting deeper
  than Python's parser allows) and integers longer than `MAX_INT_DIGITS`.

The error type is the caller's (`ConfigError` for run configs, `FormatError` for
files entrenar reads as data); the message starts with the file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

from entrenar.errors import EntrenarError, FormatError

MAX_CONFIG_BYTES = 1 << 20
"""Size limit of a YAML/JSON config, recipe or adapter config (1 MiB)."""

MAX_DEPTH = 100
"""Deepest nesting of lists and mappings a YAML or small JSON document may have."""

MAX_ALIAS_NODES = 10_000
"""Most YAML nodes that aliases may stand for in one document, all aliases together."""

MAX_INT_DIGITS = 4300
"""Longest integer literal (Python's own limit on converting a string to an int)."""

_YAML_INT = "tag:yaml.org,2002:int"
_YAML_MERGE = "tag:yaml.org,2002:merge"
# Both scan in linear time on any text: a search starts only at the first digit of a
# run (a start inside one would rescan it: quadratic in its length), and a string
# token takes an unterminated string to the end of the text (``"?``), so no search
# restarts at each quote inside it (a quote then ``\\"`` repeated: quadratic, an hour
# for 1 MiB).
_JSON_BIG_INT = re.compile(rf"(?<!\d)-?\d{{{MAX_INT_DIGITS + 1},}}")
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the module docstring's limits on depth and aliases."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0  # nodes composed so far, an alias counting as its target's
        self._aliased = 0  # of which aliases stood for this many
        self._sizes: dict[str, int] = {}  # anchor -> nodes under it, once complete

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose one node, checking the limits before descending into it."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._count_alias(event)
            return super().compose_node(parent, index)
        nested = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if nested and self._depth >= MAX_DEPTH:
            raise ComposerError(
                None, None, f"nests deeper than {MAX_DEPTH} levels", event.start_mark
            )
        before = self._nodes
        self._nodes += 1
        self._depth += nested
        node = super().compose_node(parent, index)
        self._depth -= nested
        if event.anchor is not None:
            self._sizes[event.anchor] = self._nodes - before
        return node

    def _count_alias(self, event: Any) -> None:
        anchor = event.anchor
        if anchor not in self.anchors:
            return  # the composer reports the undefined alias
        if anchor not in self._sizes:
            raise ComposerError(
                None,
                None,
                f"alias *{anchor} is inside the node &{anchor} it names (a cycle)",
                event.start_mark,
            )
        self._nodes += self._sizes[anchor]
        self._aliased += self._sizes[anchor]
        if self._aliased > MAX_ALIAS_NODES:
            raise ComposerError(
                None,
                None,
                f"aliases expand to more than {MAX_ALIAS_NODES} nodes (an alias "
                "bomb?); write the values out instead of repeating anchors",
                event.start_mark,
            )

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A mapping, refusing a key given twice (PyYAML keeps the last silently)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], Any] = {}
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == _YAML_MERGE:
                    continue  # a merge key (<<) may bring keys given again here
                name = (key.tag, key.value)
                if name in seen:
                    raise ConstructorError(
                        None,
                        None,
                        f"key {key.value!r} given twice (first at line "
                        f"{seen[name].line + 1}); keep one",
                        key.start_mark,
                    )
                seen[name] = key.start_mark
        return super().construct_mapping(node, deep)

    def construct_bounded_int(self, node: Any) -> Any:
        """An int, refusing literals longer than `MAX_INT_DIGITS`."""
        if len(str(node.value)) > MAX_INT_DIGITS:
            raise ConstructorError(
                None,
                None,
                f"an integer of {len(node.value)} characters (at most "
                f"{MAX_INT_DIGITS})",
                node.start_mark,
            )
        return self.construct_yaml_int(node)


_BoundedLoader.add_constructor(_YAML_INT, _BoundedLoader.construct_bounded_int)


def read_text(
    path: str | os.PathLike[str],
    *,
    error: type[EntrenarError] = FormatError,
    max_bytes: int = MAX_CONFIG_BYTES,
    what: str = "file",
) -> str:
    """The text of a UTF-8 file, after checking its size.

    Args:
        path: the file.
        error: the exception type to raise.
        max_bytes: refuse larger files.
        what: what the file is, for the message (``"config file"``).

    Raises:
        error: no such file, too large, or not UTF-8 (naming the line and column).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise error(f"{path}: no such {what}")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise error(
            f"{path}: {size:,} bytes is over the {what} limit of {max_bytes:,} "
            "bytes; is it the right file?"
        )
    with open(path, "rb") as f:
        data = f.read(size + 1)  # not max_bytes + 1: read(n) allocates n bytes
    if len(data) > max_bytes:
        raise error(f"{path}: grew past the limit of {max_bytes} bytes while read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, col = _byte_position(data, e.start)
        raise error(
            f"{path} line {line}, column {col}: not UTF-8 text (byte "
            f"0x{data[e.start]:02x}); save the file as UTF-8"
        ) from None


def _byte_position(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and column (in bytes) of ``offset``."""
    line = data.count(b"\n", 0, offset) + 1
    return line, offset - (data.rfind(b"\n", 0, offset) + 1) + 1


def parse_yaml(
    text: str, source: str, *, error: type[EntrenarError] = FormatError
) -> Any:
    """One YAML document from ``text``, with the limits of the module docstring.

    Args:
        text: the YAML.
        source: the file (or ``"--set KEY"``) that the message names.
        error: the exception type to raise.

    Raises:
        error: invalid YAML or a limit exceeded, with the line and column.

    Example:
        >>> parse_yaml("{a: &x [1, 2], b: *x}", "f.yaml")
        {'a': [1, 2], 'b': [1, 2]}
        >>> parse_yaml("x: &a {y: *a}", "f.yaml")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        entrenar.errors.FormatError: f.yaml: ... *a is inside the node &a ...
    """
    try:
        loader = _BoundedLoader(text)  # checks for unprintable characters
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        if isinstance(e, yaml.reader.ReaderError):
            at = " (line {}, column {})".format(*_line_col(text, e.position))
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{source}: not valid YAML{at}: {problem}") from None
    except (ValueError, OverflowError, TypeError, RecursionError) as e:
        # a value the resolver accepted but Python cannot build (2001-13-45)
        raise error(f"{source}: not valid YAML: {type(e).__name__}: {e}") from None


def read_yaml(
    path: str | os.PathLike[str],
    *,
    error: type[EntrenarError] = FormatError,
    max_bytes: int = MAX_CONFIG_BYTES,
    what: str = "file",
) -> Any:
    """`read_text` then `parse_yaml`: a YAML file read within the limits."""
    path = os.fspath(path)
    text = read_text(path, error=error, max_bytes=max_bytes, what=what)
    return parse_yaml(text, path, error=error)


def _line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of character ``offset`` in ``text``."""
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def _near(text: str, offset: int) -> str:
    """Where an error is: ``"near '<text>'"`` or at the end of the line."""
    if offset >= len(text) or text[offset] in "\r\n":
        return "at the end of the line"
    start = max(text.rfind("\n", 0, offset) + 1, offset - 20)
    end = text.find("\n", offset, offset + 10)
    return f"near {text[start : end if end >= 0 else offset + 10]!r}"


def _too_deep(text: str, max_depth: int) -> int | None:
    """The offset of the first bracket nested deeper than ``max_depth``, or None.

    With ``max_depth=-1``, the offset of the first bracket at the deepest level.
    """
    if max_depth >= 0 and text.count("[") + text.count("{") <= max_depth:
        return None
    depth, deepest, where = 0, 0, None
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > max_depth >= 0:
                return m.start()
            if depth > deepest:
                deepest, where = depth, m.start()
        elif c in "]}":
            depth -= 1
    return where if max_depth < 0 else None


def parse_json(
    text: str,
    source: str,
    *,
    error: type[EntrenarError] = FormatError,
    max_depth: int | None = MAX_DEPTH,
    first_line: int = 1,
) -> Any:
    """One JSON value from ``text``, with the limits of the module docstring.

    Args:
        text: the JSON.
        source: the file the message names.
        error: the exception type to raise.
        max_depth: deepest nesting allowed; None checks only Python's own limit
            (for large files, where scanning for the depth costs more than it saves).
        first_line: the line of ``source`` that ``text`` starts on (for JSONL).

    Raises:
        error: invalid JSON or a limit exceeded, naming the line and column.

    Example:
        >>> parse_json('{"a": [1, 2}', "f.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        entrenar.errors.FormatError: f.json line 1, column 12: invalid JSON (...)
    """

    def fail(offset: int, problem: str) -> EntrenarError:
        line, col = _line_col(text, offset)
        return error(f"{source} line {line + first_line - 1}, column {col}: {problem}")

    deep = _too_deep(text, max_depth) if max_depth is not None else None
    if deep is not None:
        raise fail(deep, f"invalid JSON (nests deeper than {max_depth} levels)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(e.pos, f"invalid JSON ({e.msg}, {_near(text, e.pos)})") from None
    except RecursionError:
        deepest = _too_deep(text, -1) or 0
        raise fail(
            deepest, "invalid JSON (nests too deeply for Python's parser)"
        ) from None
    except ValueError as e:  # an integer longer than Python converts
        big = _JSON_BIG_INT.search(text)
        if big is None:
            raise error(f"{source}: invalid JSON ({e})") from None
        digits = len(big.group().lstrip("-"))
        raise fail(
            big.start(),
            f"invalid JSON (an integer of {digits} digits, at most {MAX_INT_DIGITS})",
        ) from None


def read_json(
    path: str | os.PathLike[str],
    *,
    error: type[EntrenarError] = FormatError,
    max_bytes: int = MAX_CONFIG_BYTES,
    max_depth: int | None = MAX_DEPTH,
    what: str = "file",
) -> Any:
    """`read_text` then `parse_json`: a JSON file read within the limits."""
    path = os.fspath(path)
    text = read_text(path, error=error, max_bytes=max_bytes, what=what)
    return parse_json(text, path, error=error, max_depth=max_depth)


__all__ = [
    "MAX_ALIAS_NODES",
    "MAX_CONFIG_BYTES",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "parse_json",
    "parse_yaml",
    "read_json",
    "read_text",
    "read_yaml",
]
