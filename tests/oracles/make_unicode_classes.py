"""Write entrenar/io/unicode_classes.py from llama.cpp's own Unicode table.

llama.cpp's pre-tokenizers class each code point by ``src/unicode-data.cpp``
(``unicode_ranges_flags`` and ``unicode_set_whitespace``, Unicode 15.1 in the copy
vendored in llama-cpp-python 0.3.36), not by the Unicode version of the Python that
runs entrenar (Python 3.11's ``unicodedata`` is 14.0: 5116 code points it calls
unassigned are letters, digits or punctuation there). Unassigned code points carry
the ``UNDEFINED`` flag, which its regexes treat like punctuation. This script keeps
the five classes the tokenizer needs as runs of code points::

    .venv/bin/python tests/oracles/make_unicode_classes.py \
        --llama-cpp /path/to/llama.cpp --out entrenar/io/unicode_classes.py
"""

from __future__ import annotations

import argparse
import itertools
import re
import textwrap
from pathlib import Path

LETTER, NUMBER, PUNCTUATION = 0x0004, 0x0002, 0x0020


def _block(src: str, name: str) -> str:
    start = src.index(name)
    return src[start : src.index("};", start)]


def classes(src: str) -> list[tuple[int, str]]:
    r"""``(first code point, class)`` runs of llama.cpp's classes.

    ``s`` whitespace, ``L`` letter, ``N`` number, ``p`` punctuation (``\p{P}``),
    ``P`` anything else.
    """
    flag_pairs = _block(src, "unicode_ranges_flags")
    pairs = re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}", flag_pairs)
    ranges = [(int(a, 16), int(b, 16)) for a, b in pairs]
    space_list = _block(src, "unicode_set_whitespace")
    spaces = {int(x, 16) for x in re.findall(r"0x([0-9A-F]+)", space_list)}
    flags = [0] * 0x110000
    for (first, f), (end, _) in itertools.pairwise(ranges):
        flags[first:end] = [f] * (end - first)
    runs: list[tuple[int, str]] = []
    for c in range(0x110000):
        f = flags[c]
        kind = (
            "s" if c in spaces else "L" if f & LETTER else "N" if f & NUMBER
            else "p" if f & PUNCTUATION else "P"
        )  # fmt: skip
        if not runs or runs[-1][1] != kind:
            runs.append((c, kind))
    return runs


def module(runs: list[tuple[int, str]], source: str) -> str:
    """The text of entrenar/io/unicode_classes.py."""
    starts = textwrap.fill(
        ", ".join(f"0x{c:X}" for c, _ in runs), 84, initial_indent="    ",
        subsequent_indent="    ",
    )  # fmt: skip
    kinds = "".join(k for _, k in runs)
    doc = textwrap.fill(
        f"From {source}. ``STARTS[i]`` is the first code point of a run of class "
        "``KINDS[i]``: ``s`` whitespace, ``L`` letter, ``N`` number, ``p`` "
        "punctuation (``\\p{P}``), ``P`` anything else (symbols, marks, controls, "
        "unassigned).",
        80,
    )
    title = "llama.cpp's Unicode classes (tests/oracles/make_unicode_classes.py)."
    doc = f"{title}\n\n{doc}\n"
    return (
        f'r"""{doc}"""\n\n# fmt: off\nSTARTS = (\n{starts},\n)\nKINDS = (\n'
        + "".join(f'    "{kinds[i : i + 80]}"\n' for i in range(0, len(kinds), 80))
        + ")\n# fmt: on\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", default="llama-cpp-python 0.3.36's llama.cpp")
    args = parser.parse_args(argv)
    src = (args.llama_cpp / "src" / "unicode-data.cpp").read_text(encoding="utf-8")
    args.out.write_text(module(classes(src), args.source), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
