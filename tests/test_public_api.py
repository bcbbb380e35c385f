"""Every exported name of every package is documented where a user would look.

A function or class needs its own docstring; any other exported value (constants,
tables, type aliases) must be described in one of the specs/*.md documents.
"""

import importlib
import inspect
import re
from pathlib import Path

import pytest

import entrenar

ROOT = Path(__file__).parents[1]
SPECS = "\n".join(p.read_text() for p in sorted((ROOT / "specs").glob("*.md")))
PACKAGES = sorted(
    name for name in entrenar.__all__ if inspect.ismodule(getattr(entrenar, name))
)


def _own_doc(obj) -> str:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return (doc or "").strip()


@pytest.mark.parametrize("package", PACKAGES)
def test_exports_are_documented(package):
    mod = importlib.import_module(f"entrenar.{package}")
    undocumented = []
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if inspect.ismodule(obj):
            continue
        if inspect.isclass(obj) or callable(obj):
            doc = _own_doc(obj)
            own = getattr(obj, "__name__", name)
            generated = re.fullmatch(rf"{re.escape(own)}\(.*\)", doc or "")
            if doc and not generated:
                continue
        if re.search(rf"\b{re.escape(name)}\b", SPECS):
            continue
        undocumented.append(name)
    assert not undocumented, f"entrenar.{package}: document {undocumented}"


def test_every_package_exports_a_list():
    for package in PACKAGES:
        mod = importlib.import_module(f"entrenar.{package}")
        assert isinstance(getattr(mod, "__all__", None), list), package
        assert mod.__doc__, f"entrenar.{package} states its protocol in a docstring"
