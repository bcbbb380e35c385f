"""Griffe extension: show the docstrings' doctests as Python code blocks.

Doctest lines (``>>> ...``, ``... ...`` and their expected output, up to a blank line)
written in a docstring's text would otherwise be read as Markdown: ``[0.6, 0.8]`` as a
link, ``>>>`` as quotes. Each such run of lines is wrapped in a ``pycon`` fence.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wrap every doctest block of ``text`` in a fenced ``pycon`` code block."""
    out: list[str] = []
    lines = text.splitlines()
    i, in_fence = 0, False
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_fence or not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i])
            i += 1
        out += [f"{indent}```pycon", *block, f"{indent}```"]
    return "\n".join(out)


def _walk(obj: Any, seen: set[int]) -> None:
    if id(obj) in seen or obj.is_alias:
        return
    seen.add(id(obj))
    if obj.docstring is not None:
        obj.docstring.value = fence_doctests(obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _walk(member, seen)


class DoctestBlocks(griffe.Extension):
    """Fence the doctests of every object of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite the docstrings of ``pkg`` and everything in it."""
        _walk(pkg, set())
