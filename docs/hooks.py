"""mkdocs hook: expand the nav's folder entries (``guide/``, ``api/``...) into pages.

Each such entry becomes the folder's pages (``index.md`` first, then by name), titled
by their source's title, so a page that docs/gen_pages.py adds for a new spec,
example, package or benchmark is in the navigation without editing mkdocs.yml.
"""

from __future__ import annotations

import os
from typing import Any

SPEC_ORDER = (
    "conventions", "autograd", "optimizers", "models", "quantization", "lora",
    "io", "data", "trainer", "config", "distillation", "merging", "distributed",
)  # fmt: skip


def _title(docs_dir: str, rel: str) -> str:
    """The page's title: its first ``# `` line or, for an include, the source's."""
    root = os.path.dirname(docs_dir)
    with open(os.path.join(docs_dir, rel), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("# "):
            return line[2:].replace("`", "").strip()
        if line.startswith('--8<-- "') and line.endswith('.md"'):
            return _title(root, line[len('--8<-- "') : -1])
    return os.path.splitext(os.path.basename(rel))[0]


def _order(folder: str, name: str) -> tuple[int, str]:
    stem = os.path.splitext(name)[0]
    if stem == "index":
        return (-1, "")
    if folder == "guide" and stem in SPEC_ORDER:
        return (SPEC_ORDER.index(stem), stem)
    return (len(SPEC_ORDER), stem)


def _expand(entry: Any, docs_dir: str) -> Any:
    if isinstance(entry, list):
        return [_expand(e, docs_dir) for e in entry]
    if isinstance(entry, dict):
        return {k: _expand(v, docs_dir) for k, v in entry.items()}
    if isinstance(entry, str) and entry.endswith("/"):
        folder = entry.rstrip("/")
        names = sorted(
            (
                n
                for n in os.listdir(os.path.join(docs_dir, folder))
                if n.endswith(".md")
            ),
            key=lambda n: _order(folder, n),
        )
        return [{_title(docs_dir, f"{folder}/{n}"): f"{folder}/{n}"} for n in names]
    return entry


def on_config(config: Any) -> Any:
    """Replace each folder entry of the nav by the folder's pages."""
    config["nav"] = _expand(config["nav"], config["docs_dir"])
    return config
