"""After `mkdocs build`: every public name has its entry in the built API reference.

    python docs/check_site.py   # `make docs` runs it after the build

The sources' check (tests/test_docs.py) sees that each name is listed; this one sees
that mkdocstrings rendered it: an anchor ``id="<module>.<name>"`` (or the object's
real path, for a name shown at it), a link (the root's packages), or a row of a
page's constants table. Exit 1 naming what is missing.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import gen_pages  # noqa: E402


def missing_names(site: str) -> list[str]:
    """``module.name`` for each public name without an entry in the built pages."""
    missing = []
    for module_name in gen_pages.api_modules():
        short = module_name.split(".", 1)[1] + "/" if "." in module_name else ""
        path = os.path.join(site, "api", short, "index.html")
        with open(path, encoding="utf-8") as f:
            page = f.read()
        module = importlib.import_module(module_name)
        for name in gen_pages.public_names(module_name):
            if name == "__version__":
                continue
            value = getattr(module, name, None)
            marks = [f'id="{module_name}.{name}"', f"<code>{name}</code></td>"]
            if isinstance(value, types.ModuleType):
                marks += [f'id="{value.__name__}"', f'href="{name}/"']
            if hasattr(value, "__module__") and hasattr(value, "__qualname__"):
                marks.append(f'id="{value.__module__}.{value.__qualname__}"')
            if not any(m in page for m in marks):
                missing.append(f"{module_name}.{name}")
    return missing


def main() -> int:
    """Check ``site/``; print what is missing."""
    missing = missing_names(os.path.join(ROOT, "site"))
    for name in missing:
        print(f"{name}: not rendered in site/api (see docs/gen_pages.py)")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
