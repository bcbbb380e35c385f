r"""Regular expressions from LoRA and adapter configs, checked before they run.

PEFT reads the keys of ``rank_pattern`` / ``alpha_pattern`` (and a string
``target_modules``) as regular expressions, and `LoRAConfig` targets that are not
plain names are ones too. Python's `re` backtracks, so a pattern such as
``(.*.*.*.*.*.*.*.*.*.*)*\$x`` would take longer than the age of the universe on one
module name. So a pattern runs only after `check_pattern` has:

- bounded its length (`MAX_PATTERN_CHARS`);
- refused lookarounds, backreferences and conditionals;
- bounded the ways it can match a module name of `NAME_CHARS` characters (computed
  from its parse tree: ``a|b`` adds the ways of its branches, a sequence multiplies
  them, a repeat of ``c`` ways taken ``k`` times has ``c**k``) by `MAX_MATCH_WAYS`,
  an upper bound of the backtracking work. Nested or stacked unbounded repeats
  exceed it; names, alternations of names and one or two ``.*`` / ``\d+`` do not.

A longer module name is checked again at its own length. A key that is a literal
name (what `save_adapter` writes: ``re.escape`` of the module) is matched as a
name suffix, without `re` (`peft_key_matches`).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Mapping
from typing import Any

from entrenar.errors import ConfigError

# The regex parser `re.compile` itself uses (private, so typed loosely).
try:  # Python >= 3.11
    _sre: Any = importlib.import_module("re._constants")
    _sre_parse: Any = importlib.import_module("re._parser")
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    _sre = importlib.import_module("sre_constants")
    _sre_parse = importlib.import_module("sre_parse")

MAX_PATTERN_CHARS = 1 << 16
"""Longest pattern accepted (64 Ki characters: an alternation of many module names)."""

NAME_CHARS = 48
"""Module-name length at which patterns are checked when first read."""

MAX_MATCH_WAYS = 10_000_000
"""Most ways a pattern may match one module name (`check_pattern`)."""

_LITERAL_KEY = re.compile(r"(?:[A-Za-z0-9_]|\\[^A-Za-z0-9])+")
_ONE_WAY = {_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.AT}
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)}
_CAP = MAX_MATCH_WAYS + 1


def _ways(items: Any, n: int) -> int:
    """Ways a parsed sequence can match within ``n`` characters (capped)."""
    total = 1
    for op, av in items:
        total = min(total * _item_ways(op, av, n), _CAP)
    return total


def _item_ways(op: Any, av: Any, n: int) -> int:
    if op in _ONE_WAY:
        return 1
    if op is _sre.SUBPATTERN:
        return _ways(av[3], n)
    if op is getattr(_sre, "ATOMIC_GROUP", None):
        return _ways(av, n)
    if op is _sre.BRANCH:
        return min(sum(_ways(b, n) for b in av[1]), _CAP)
    if op in _REPEATS:
        low, high, body = av
        ways, width = _ways(body, n), body.getwidth()[0]
        most = min(high, n // width if width else n + 1)
        if low > most:
            return 1  # cannot match: fails at once
        if ways == 1:
            return most - low + 1
        total, term = 0, min(ways**low, _CAP) if low < 64 else _CAP
        for _ in range(low, most + 1):
            total = min(total + term, _CAP)
            term = min(term * ways, _CAP)
            if total >= _CAP:
                break
        return total
    raise ConfigError(
        "lookarounds, backreferences and conditionals are not supported in patterns"
    )


@functools.lru_cache(maxsize=256)
def _match_ways(pattern: str, n: int) -> int:
    try:
        return _ways(_sre_parse.parse(pattern), n)
    except RecursionError:
        return _CAP


SEARCH = "(?:.*?)(?:{})"
"""How `re.search` runs a pattern (it tries every start): for `check_pattern`'s
``runs_as``."""

PEFT_KEY = r"(.*\.)?({})$"
"""How PEFT runs a ``rank_pattern`` / ``alpha_pattern`` key (with `re.match`)."""


def check_pattern(
    pattern: str, *, runs_as: str = "{}", name_chars: int = NAME_CHARS
) -> re.Pattern[str]:
    r"""``pattern`` compiled, after the checks of the module docstring.

    Args:
        pattern: the regular expression.
        runs_as: how it runs, ``{}`` standing for it (`SEARCH`, `PEFT_KEY`): the
            ways to match are counted for this whole expression.
        name_chars: length of the module names it will run on.

    Raises:
        ConfigError: too long, invalid, unsupported or too costly; the message
            quotes the pattern (the caller adds the file and key).

    Example:
        >>> check_pattern(r"layers\.\d+\.mlp\..*").pattern
        'layers\\.\\d+\\.mlp\\..*'
        >>> check_pattern(r"(.*.*.*.*.*.*.*.*.*.*)*\$x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        entrenar.errors.ConfigError: '(.*...)*\\$x': could match ... ways...
    """
    shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(
            f"{shown!r} has {len(pattern):,} characters, more than "
            f"{MAX_PATTERN_CHARS:,}"
        )
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ConfigError(f"{shown!r} is not a valid regex ({e})") from None
    try:
        ways = _match_ways(runs_as.replace("{}", pattern), name_chars)
    except ConfigError as e:
        raise ConfigError(f"{shown!r}: {e}") from None
    if ways > MAX_MATCH_WAYS:
        raise ConfigError(
            f"{shown!r}: could match a {name_chars}-character module name in "
            f"more than {MAX_MATCH_WAYS:,} ways (nested or stacked repeats such as "
            "(a*)* or .*.*.*), which could take hours; write the module names out "
            "(a|b) or use fewer repeats"
        )
    return compiled


def search_pattern(pattern: str, module: str) -> bool:
    """``re.search(pattern, module)``, with `check_pattern`'s checks first."""
    n = max(len(module), NAME_CHARS)
    return (
        check_pattern(pattern, runs_as=SEARCH, name_chars=n).search(module) is not None
    )


def peft_key_matches(key: str, module: str) -> bool:
    r"""PEFT's ``rank_pattern`` / ``alpha_pattern`` test, without runaway regexes.

    PEFT matches ``re.match(rf"(.*\.)?({key})$", module)`` (`PEFT_KEY`): the key is
    a suffix of the module name made of whole dotted parts. A literal key (letters,
    digits, ``_`` and escaped punctuation such as ``\.``) is matched that way
    without `re`; any other is matched with `re` after `check_pattern`.

    >>> peft_key_matches(r"layers\.0\.mlp\.up_proj", "model.layers.0.mlp.up_proj")
    True
    >>> peft_key_matches("q_proj", "model.layers.0.self_attn.xq_proj")
    False
    """
    if _LITERAL_KEY.fullmatch(key):
        name = re.sub(r"\\(.)", r"\1", key)
        return module == name or module.endswith("." + name)
    n = max(len(module), NAME_CHARS)
    check_pattern(key, runs_as=PEFT_KEY, name_chars=n)
    return re.match(PEFT_KEY.replace("{}", key), module) is not None


def peft_pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """The value of the first key of ``patterns`` matching ``module``, else ``default``.

    PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``get_pattern_key``: keys in
    their order, each tested with `peft_key_matches`).
    """
    for key, value in (patterns or {}).items():
        if peft_key_matches(key, module):
            return value
    return default


def check_peft_key(key: str) -> None:
    """Check a ``rank_pattern`` / ``alpha_pattern`` key as `peft_key_matches` runs it.

    Raises:
        ConfigError: see `check_pattern`.
    """
    if not _LITERAL_KEY.fullmatch(key):
        check_pattern(key, runs_as=PEFT_KEY)


__all__ = [
    "MAX_MATCH_WAYS",
    "MAX_PATTERN_CHARS",
    "NAME_CHARS",
    "PEFT_KEY",
    "SEARCH",
    "check_pattern",
    "check_peft_key",
    "peft_key_matches",
    "peft_pattern_value",
    "search_pattern",
]
